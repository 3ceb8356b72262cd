"""A GQA layer's q, k and v projections as one matrix, qkv_proj [D, K, G + 2, H]: for each KV
head, its G query heads, then its key head and its value head.

Why: a batch-1 step multiplies one row by each projection. Apart, q is a two-row GEMM with a
pad and a slice around it and k, v one XLA reduction (a tp shard's k and v are under XLA's
10 M-element GEMM threshold); together they are one GEMM over one matrix. On an H200,
Qwen3-30B-A3B's batch-1 step took 3.807 against 3.852 ms and Qwen3-8B's 4.449-4.488 against
4.467-4.504 (two leases: -1.2% and none), 3.586 against 3.605 ms at tp = 2; TTFT fell 3-7%
(BENCHMARKS.md, "q, k and v as one product").

Grouping by KV head keeps the tp split whole: splitting axis K over the shards hands each its
own KV heads and exactly their query heads, the query heads `o_proj` expects (query head n
belongs to KV head n // G, transformers' repeat_kv order).

Checkpoints keep the three apart (Hugging Face's layout and jspec's converted one), and so do
the layers as they are built and loaded. `fuse_qkv` joins them on the devices once the weights
are in place (jspec.build); `unfused_flat_state` splits them back for anything that saves.
Layers that keep them apart: GatedAttention (q_proj also emits a gate), FP8 weights (the FP8
kernel already takes q, k and v in one call), and KV heads copied over more shards than there
are heads (kv_head_replicas > 1).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jspec.models.layers import Attention

QKV_AXES = ("embed", "kv_heads", None, "head_dim")
APART_AXES = {"q_proj": ("embed", "q_heads", "head_dim"),
              "k_proj": ("embed", "kv_heads", "head_dim"),
              "v_proj": ("embed", "kv_heads", "head_dim")}


def _spec(array) -> tuple:
  sharding = getattr(array, "sharding", None)
  if not isinstance(sharding, NamedSharding):
    return (None,) * array.ndim
  return tuple(sharding.spec) + (None,) * (array.ndim - len(sharding.spec))


def fusable(attn) -> bool:
  """Whether `attn` can hold q, k and v as one matrix (see the module docstring)."""
  if type(attn) is not Attention or attn.fused_qkv or attn.kv_replicas != 1:
    return False
  if any(getattr(attn, name + "_scale") is not None for name in APART_AXES):
    return False
  q, k = attn.q_proj[...], attn.k_proj[...]
  # The query heads split over the same mesh axes as the KV heads, so a shard's query heads
  # are its KV heads' groups.
  return (q.shape[1] % k.shape[1] == 0
          and _spec(q)[:2] == _spec(k)[:2] == _spec(attn.v_proj[...])[:2])


def _join(q_DNH, k_DKH, v_DKH):
  d, n, h = q_DNH.shape
  heads = k_DKH.shape[1]
  return jnp.concatenate([q_DNH.reshape(d, heads, n // heads, h), k_DKH[:, :, None],
                          v_DKH[:, :, None]], axis=2)


def fuse_qkv(*modules) -> int:
  """Joins q, k and v into qkv_proj in every layer of `modules` (None skipped) that
  `fusable` takes, on the devices, in the KV heads' sharding; returns how many."""
  layers = [node for module in modules if module is not None
            for _, node in nnx.iter_graph(module) if isinstance(node, Attention)]
  layers = [attn for attn in dict.fromkeys(layers) if fusable(attn)]  # a shared layer once
  for attn in layers:
    q, k, v = attn.q_proj[...], attn.k_proj[...], attn.v_proj[...]
    spec = _spec(k)
    out = None
    if isinstance(k.sharding, NamedSharding):
      out = NamedSharding(k.sharding.mesh, PartitionSpec(spec[0], spec[1], None, spec[2]))
    qkv = jax.jit(_join, out_shardings=out)(q, k, v)
    attn.qkv_proj = nnx.Param(qkv, logical_axes=QKV_AXES,
                              init_scale=attn.q_proj.get_metadata().get("init_scale"))
    attn.qkv_proj_scale = None
    for name in APART_AXES:
      delattr(attn, name)
      delattr(attn, name + "_scale")
    attn.fused_qkv = True
  return len(layers)


def split_qkv(qkv_DKCH) -> dict:
  """qkv_proj -> {"q_proj": [D, N, H], "k_proj": [D, K, H], "v_proj": [D, K, H]}."""
  d, heads, c, h = qkv_DKCH.shape
  return {"q_proj": qkv_DKCH[:, :, :c - 2].reshape(d, heads * (c - 2), h),
          "k_proj": qkv_DKCH[:, :, c - 2], "v_proj": qkv_DKCH[:, :, c - 1]}


def unfused_flat_state(module, *filters) -> list:
  """nnx.to_flat_state(nnx.state(module, *filters)) with each qkv_proj as the q_proj, k_proj
  and v_proj it was joined from: the layout checkpoints and savers read."""
  flat = []
  for path, variable in nnx.to_flat_state(nnx.state(module, *filters)):
    if path[-1] != "qkv_proj":
      flat.append((path, variable))
      continue
    init_scale = variable.get_metadata().get("init_scale")
    for name, value in split_qkv(variable.get_value()).items():
      flat.append((path[:-1] + (name,),
                   nnx.Param(value, logical_axes=APART_AXES[name], init_scale=init_scale)))
  return flat

"""Attention for prefill chunks through a fused flash-attention kernel (cuDNN on a GPU).

Why: XLA runs a chunk's attention as two batched products with the float32 scores
[B, N, T, S] written out between them, against every slot of the prompt's bucket. On an H100
a 4096-token prompt in the default chunks of 256 spent 148 ms of its 277 ms there (Qwen3-8B
shapes); cuDNN's fused kernel, which never writes the scores, took 77 ms for the same chunks
(BENCHMARKS.md, "Prefill attention through cuDNN's fused kernel").

What it computes is exactly the XLA paths of `Attention._attend` and of
`MLAttention.attend_expanded`: query t of sequence b, at position p, sees the key slots
j <= p; the chunk's own keys and values are already written there. The positions come in as
a boolean mask (a chunk of a long prompt starts mid-cache, where a causal mask aligned at
slot 0 would be wrong); fully masked rows cannot occur, since every position sees slot 0.

Two key layouts: "BKSH", the GQA cache's own [B, K, S, H], and "BSKH", [B, S, K, H] (MLA's
per-head keys and values, expanded from the latent in that order), which is cuDNN's. The
cache's window is transposed into it in every layer of every chunk (7.4 ms of a 205 ms
prefill on an H100): jax's cuDNN wrapper takes the cache's order too, but the window must
still be copied out of the larger cache first, and a prefill through it was no faster on an
H100 (one run each; BENCHMARKS.md, "MLA prefill through cuDNN; …"). MLA's values are
narrower than its queries (128 against 192), which `jax.nn.dot_product_attention` does not
take: those go through jax's cuDNN wrapper itself. Off the GPU, and for dtypes cuDNN does not take
(float32), the same call runs as two products in XLA, which the CPU tests check against
NumPy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jspec.sharding.rules import ShardingRules

CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
CUDNN_MAX_HEAD_DIM = 256  # on Hopper (128 before it)
CUDNN_NARROWER_VALUES_VERSION = 91000  # cuDNN 9.10: values narrower than the queries
KV_LAYOUTS = ("BKSH", "BSKH")
IMPLEMENTATIONS = ("cudnn", "xla")


def cudnn_version() -> int:
  """The cuDNN version jax's GPU plugin loaded (e.g. 91000 for 9.10), 0 where there is none."""
  try:
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    return int(cudnn.check_cudnn_version())
  except (ImportError, RuntimeError, AttributeError):
    return 0


def fits_cudnn(head_dim: int, hopper: bool, value_dim: int | None = None,
               version: int = CUDNN_NARROWER_VALUES_VERSION) -> bool:
  """Whether cuDNN's flash attention takes heads of this width (a multiple of 8, at most 256
  on Hopper and 128 before); values narrower than the queries (MLA), also a multiple of 8,
  on Hopper from cuDNN `version` 9.10 only."""
  if value_dim is not None and value_dim != head_dim and not (
      hopper and version >= CUDNN_NARROWER_VALUES_VERSION and value_dim < head_dim
      and value_dim % 8 == 0):
    return False
  return head_dim % 8 == 0 and head_dim <= (CUDNN_MAX_HEAD_DIM if hopper else 128)


def _xla_attention(q_BTNH, keys, values, visible_BTS, scale: float, kv_layout: str):
  """Both products in XLA, float32 scores; the query heads in KV-group order."""
  b, t, n, h = q_BTNH.shape
  k = keys.shape[1] if kv_layout == "BKSH" else keys.shape[2]
  kv = "bksh" if kv_layout == "BKSH" else "bskh"
  q_BTKGH = q_BTNH.reshape(b, t, k, n // k, h)
  scores_BKGTS = jnp.einsum(f"btkgh,{kv}->bkgts", q_BTKGH, keys,
                            preferred_element_type=jnp.float32) * scale
  scores_BKGTS = jnp.where(visible_BTS[:, None, None], scores_BKGTS, -jnp.inf)
  probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1).astype(values.dtype)
  out_BTKGV = jnp.einsum(f"bkgts,{kv.replace('h', 'v')}->btkgv", probs_BKGTS, values)
  return out_BTKGV.reshape(b, t, n, values.shape[-1])


def _cudnn_attention(q_BTNH, keys, values, visible_BTS, scale: float, kv_layout: str):
  mask_B1TS = visible_BTS[:, None]
  if kv_layout == "BKSH":  # cuDNN's order, copied (with the window's slice) by one fusion
    keys, values = jnp.swapaxes(keys, 1, 2), jnp.swapaxes(values, 1, 2)
  if keys.shape[-1] == values.shape[-1]:
    return jax.nn.dot_product_attention(q_BTNH, keys, values, mask=mask_B1TS, scale=scale,
                                        implementation="cudnn")
  # Values narrower than the queries (MLA): jax's cuDNN wrapper takes them (cuDNN >= 9.10 on
  # Hopper), the public call does not.
  from jax._src.cudnn import fused_attention_stablehlo as cudnn

  return cudnn.dot_product_attention(q_BTNH, keys, values, mask=mask_B1TS, scale=scale,
                                     qkv_layout="BTNH")


def prefill_attention(q_BTNH, keys, values, positions_BT, *, implementation: str,
                      kv_layout: str = "BKSH", scale: float | None = None):
  """Causal attention of a chunk's queries [B, T, N, H] (N = K * G heads in KV-group order)
  against S key slots in `kv_layout` ([B, K, S, H] or [B, S, K, H]; values of width V <= H in
  the same order), by position [B, T]. scale: the scores' (default H^-0.5).
  Returns [B, T, N, V]. (sharded_prefill_attention takes "BSKH" keys of N heads only.)"""
  if kv_layout not in KV_LAYOUTS:
    raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be 'cudnn' or 'xla', got {implementation!r}")
  slots = keys.shape[2] if kv_layout == "BKSH" else keys.shape[1]
  scale = q_BTNH.shape[-1] ** -0.5 if scale is None else scale
  visible_BTS = jnp.arange(slots)[None, None, :] <= positions_BT[:, :, None]
  if implementation == "cudnn" and q_BTNH.dtype in CUDNN_DTYPES:
    return _cudnn_attention(q_BTNH, keys, values, visible_BTS, scale, kv_layout)
  return _xla_attention(q_BTNH, keys, values, visible_BTS, scale, kv_layout)


def sharded_prefill_attention(mesh: Mesh, rules: ShardingRules, implementation: str,
                              kv_layout: str = "BKSH", scale: float | None = None):
  """`prefill_attention` per shard of `mesh`, laid out as the caches are (sequences over the
  batch axes, heads over tp; MLA's per-head keys "BSKH", one per query head, over the query
  heads' axis): a custom call XLA cannot partition itself, and no collective is needed."""
  q = rules.spec(("batch", "seq", "q_heads", "head_dim"))
  if kv_layout == "BKSH":
    kv = rules.spec(("batch", "kv_heads", "cache_seq", "head_dim"))
  else:
    kv = rules.spec(("batch", "cache_seq", "q_heads", "head_dim"))
  positions = rules.spec(("batch", "seq"))
  call = functools.partial(prefill_attention, implementation=implementation,
                           kv_layout=kv_layout, scale=scale)
  return jax.shard_map(call, mesh=mesh, in_specs=(q, kv, kv, positions), out_specs=q,
                       check_vma=False)

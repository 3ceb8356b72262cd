"""The one table from logical axes to mesh axes, and the mesh itself.

Every PartitionSpec in jspec comes from `ShardingRules.spec(logical_axes)`: parameters carry
their logical axes as NNX metadata, caches and activations name theirs where they are made.
Trying another layout means editing this table, nothing else.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("dp", "ep", "tp")
MeshAxes = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """A dp x ep x tp mesh over the first dp*ep*tp devices (of all processes' devices, in
  `jax.devices()` order), as the CLI's --dp/--tp/--ep and vLLM's `tensor_parallel_size` take
  them: `MeshConfig(tp=2)` on an 8-GPU host uses GPUs 0 and 1. `num_devices`, where given,
  names the device count explicitly (the first `num_devices`) and must equal dp*ep*tp.
  `LLM(mesh=None)` is `MeshConfig()`: one device."""
  dp: int = 1
  tp: int = 1
  ep: int = 1
  num_devices: int | None = None

  def __post_init__(self):
    for name in ("dp", "tp", "ep"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"MeshConfig.{name}={value!r} must be an integer >= 1")
    if self.num_devices is not None and self.num_devices != self.size:
      raise ValueError(f"MeshConfig.num_devices={self.num_devices} must equal dp*ep*tp = "
                       f"{self.dp}*{self.ep}*{self.tp} = {self.size} (or be left out: the mesh "
                       "uses the first dp*ep*tp devices)")

  @property
  def size(self) -> int:
    return self.dp * self.tp * self.ep

  @property
  def batch_width(self) -> int:
    """Sequences are split over dp x ep, so batch buckets are multiples of this."""
    return self.dp * self.ep

  def make_mesh(self, devices=None) -> Mesh:
    devices = jax.devices() if devices is None else list(devices)
    if self.size > len(devices):
      raise ValueError(f"mesh dp*ep*tp = {self.dp}*{self.ep}*{self.tp} = {self.size} needs "
                       f"{self.size} devices, but only {len(devices)} are present")
    devices = devices[:self.size]
    # Every process runs the same program on the global mesh: each must own part of it.
    idle = sorted(set(range(jax.process_count())) - {d.process_index for d in devices})
    if idle:
      raise ValueError(f"the first {self.size} devices leave processes {idle} without a device; "
                       "a mesh over several processes must span all of them (raise dp)")
    grid = np.asarray(devices, dtype=object).reshape(self.dp, self.ep, self.tp)
    return Mesh(grid, MESH_AXES)


@dataclasses.dataclass(frozen=True)
class ShardingRules:
  """Logical axis -> mesh axes. Axes not listed are replicated."""
  batch: MeshAxes = ("dp", "ep")
  vocab: MeshAxes = "tp"
  # The rows of an embedding table that is not also the lm_head: whole on every device. A
  # step reads one row per token, as cheap whole as split, and split rows cost an all-reduce
  # a step; whole, the table costs (1 - 1/tp) of its bytes more memory per device (Qwen3-8B:
  # 0.62 GB at tp = 2). A tied table is the lm_head too, and follows `vocab`.
  embed_vocab: MeshAxes = None
  embed: MeshAxes = None
  q_heads: MeshAxes = "tp"
  kv_heads: MeshAxes = "tp"
  head_dim: MeshAxes = None
  mlp: MeshAxes = "tp"
  experts: MeshAxes = "ep"
  experts_router: MeshAxes = None
  moe_mlp: MeshAxes = "tp"
  mtp_concat: MeshAxes = None
  linear_heads: MeshAxes = "tp"   # linear-attention key heads (their value heads follow)
  cache_seq: MeshAxes = None
  latent: MeshAxes = None         # MLA's per-token latent: shared by all heads, so not over tp
  seq: MeshAxes = None

  def spec(self, logical_axes) -> PartitionSpec:
    """PartitionSpec for a tuple of logical axis names; refuses a mesh axis used twice."""
    physical, used = [], set()
    for name in logical_axes:
      flat = mesh_axes(None if name is None else getattr(self, name))
      if used & set(flat):
        raise ValueError(f"mesh axes {flat} used twice in logical axes {logical_axes}")
      used |= set(flat)
      physical.append(None if not flat else (flat[0] if len(flat) == 1 else flat))
    return PartitionSpec(*physical)

  def without_tp(self) -> "ShardingRules":
    """The same table with every 'tp' dropped: a draft head replicated across tensor shards."""
    def drop(axes):
      if axes == "tp":
        return None
      if isinstance(axes, tuple):
        kept = tuple(a for a in axes if a != "tp")
        return kept or None
      return axes
    return dataclasses.replace(self, **{f.name: drop(getattr(self, f.name))
                                        for f in dataclasses.fields(self)})

  def sharding(self, mesh: Mesh, logical_axes) -> NamedSharding:
    return NamedSharding(mesh, self.spec(logical_axes))


def mesh_axes(axes: MeshAxes) -> tuple[str, ...]:
  """A rule's mesh axes as a tuple: () for None, (name,) for one axis."""
  if axes is None:
    return ()
  return (axes,) if isinstance(axes, str) else tuple(axes)


def axis_size(mesh: Mesh, axes: MeshAxes) -> int:
  return math.prod(mesh.shape[a] for a in mesh_axes(axes))


def global_array(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
  """Every process holds the same host data; each device takes its slice (multi-host safe)."""
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def to_host(tree):
  """Fetch (possibly multi-host) global arrays to numpy on every process."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  from jax.experimental import multihost_utils
  return multihost_utils.process_allgather(tree, tiled=True)

"""The products of a tensor-parallel layer written shard by shard, with their one all-reduce.

Left to XLA's partitioner, a layer whose weights are split over tp compiles its few-row
products into XLA's own reductions (at batch 1 a 4096-wide column product became an
`input_reduce_fusion` reading its weights at about half the HBM rate the same product reaches
through jspec.pallas_kernels.skinny_gemm on one GPU), and the partial sums of the output
projections into all-reduces of XLA's choosing. Here each product is a `shard_map`:

  column(x, w)  x whole on every shard, w split over its output columns: each shard's
                columns, no collective (q, k, v, gate / up).
  row(x, w)     x and w split over the contracted axis: each shard's partial sum, then one
                all-reduce (o_proj, down_proj): exactly one collective per row product.

Inside a shard the product is skinny_gemm's `project` (the kernel where it pays, XLA's dot
elsewhere), and the all-reduce is jspec.pallas_kernels.workspace_all_reduce's one-shot kernel
where it takes the message (Hopper GPUs of one process, a small message), else `lax.psum`.

With the kernel, a row product may leave its sum to what reads it (`row(..., defer=True)`):
a `PartialSum`, which the residual add and RMSNorm after an attention or an MLP take in one
kernel with the all-reduce (jspec.pallas_kernels.workspace_norm; RMSNorm.add_and_norm), and
anything else sums first (`+` does).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jspec.pallas_kernels.skinny_gemm import twice
from jspec.sharding.rules import ShardingRules, axis_size, mesh_axes

# LLM(all_reduce_backend), for layers whose weights the mesh splits over tp:
#   "auto"         "kernel" on Hopper SXM GPUs of one process (measured fastest on 2 H100s:
#                  BENCHMARKS.md, "The workspace all-reduce"), "partitioner" elsewhere;
#   "partitioner"  XLA's partitioner places their products and all-reduces;
#   "xla"          jspec's products shard by shard, each row product reduced by XLA's
#                  all-reduce;
#   "kernel"       the same products, reduced by the workspace one-shot kernel (Hopper GPUs of
#                  one process only), and the MoE layers' collectives too
#                  (jspec.sharding.moe).
ALL_REDUCE_BACKENDS = ("auto", "partitioner", "xla", "kernel")


def resolve_all_reduce_backend(backend: str, projection_backend: str, mesh: Mesh) -> str:
  """The all-reduce backend "auto" stands for on `mesh` (any other name stands for itself):
  the kernel where it runs (Hopper GPUs on NVLink, every device in this process) and the
  projections are not left to XLA, XLA's partitioner otherwise."""
  from jspec.pallas_kernels import platform
  if backend != "auto":
    return backend
  one_process = all(d.process_index == jax.process_index() for d in mesh.devices.flat)
  # The kernel writes into its peers' memory by address: NVLink (SXM boards) gives every pair
  # peer access; a PCIe card may have none, so "auto" leaves PCIe boards to XLA.
  nvlink = not any("pcie" in d.device_kind.lower() for d in mesh.devices.flat)
  if projection_backend != "xla" and platform.on_hopper() and one_process and nvlink:
    return "kernel"
  return "partitioner"


def split_axis(mesh: Mesh, rules: ShardingRules, logical: str) -> str | None:
  """The one mesh axis of size > 1 that `logical` splits over, None where it is whole;
  refuses a split over several axes (the products assume one)."""
  axes = tuple(a for a in mesh_axes(getattr(rules, logical)) if mesh.shape[a] > 1)
  if len(axes) > 1:
    raise ValueError(f"tensor-parallel products split over one mesh axis; {logical} is split "
                     f"over {axes}")
  return axes[0] if axes else None


def all_reduce_fn(mesh: Mesh, axis: str, custom: bool):
  """(reduce, workspace): reduce(x, row) -> the sum of x over `axis` inside a shard_map, through
  the workspace kernel where `custom` and it takes x (jspec.pallas_kernels.workspace_all_reduce,
  Hopper GPUs of one process), psum otherwise; `workspace` (None without the kernel) holds the
  address table whose `rows` the shard_map must hand each device (`row` is ignored by psum)."""
  from jspec.pallas_kernels import platform, workspace_all_reduce as wsar

  size = axis_size(mesh, axis)
  workspace = wsar.workspace_for(mesh, axis) if custom and platform.on_hopper() and size > 1 \
      else None

  def reduce(x, row):
    if workspace is not None and wsar.fits(x.shape, x.dtype):
      return wsar.workspace_all_reduce(x, row, size)
    return lax.psum(x, axis)
  return reduce, workspace


def table_operand(workspace):
  """(table, spec) to hand a shard_map whose reduce takes `row`: the workspace's address table
  and its per-device spec, or an unused scalar where the sum is psum (workspace None)."""
  if workspace is None:
    return jnp.zeros((), jnp.int32), PartitionSpec()
  return workspace.rows, workspace.row_spec


class TensorParallelProducts:
  """`column` and `row` products of [B, T, ...] activations by weights split over one mesh
  `axis` (see the module docstring). `custom_all_reduce`: the row products' sums through the
  one-shot kernel where it takes them."""

  # Whether `row(..., defer=True)` may leave the sum to the norm after it (benchmarks turn
  # it off to time the fusion).
  defer_sums = True
  # A deferred row product as this many K slices' float32 partials, one batched product that
  # the norm kernel sums (0: one product, whose K-slice sum XLA adds as a kernel of its own
  # when its GEMM splits K, as it does for few rows).
  k_slices = 4

  def __init__(self, mesh: Mesh, rules: ShardingRules, axis: str, custom_all_reduce: bool,
               kernel_always: bool = False):
    from jspec.pallas_kernels import platform
    from jspec.pallas_kernels.skinny_gemm import project
    self.mesh, self.axis = mesh, axis
    if kernel_always or platform.on_hopper():
      self._local = functools.partial(project, always=kernel_always)
    else:  # the kernel off Hopper only where asked for ("pallas": interpreted off GPU)
      self._local = lambda x, w: jnp.einsum("...k,kn->...n", x, w)
    self._reduce, self._workspace = all_reduce_fn(mesh, axis, custom_all_reduce)
    self._lead = tuple(rules.spec(("batch", "seq")))

  def split_spec(self, ndim: int, dim: int) -> PartitionSpec:
    """The partition of an array of `ndim` axes split over the products' axis at `dim`."""
    return PartitionSpec(*(self.axis if i == dim else None for i in range(ndim)))

  def lead_spec(self) -> PartitionSpec:
    """The partition of the activations' [B, T] axes (whole over tp)."""
    return PartitionSpec(*self._lead)

  def reduce_operands(self):
    """(reduce, table, table_spec): the all-reduce a row product's shard_map calls per shard,
    reduce(partial, row), and the operand (with its spec) that hands each device its row."""
    return (self._reduce, *table_operand(self._workspace))

  def column(self, x_BTK, w_KO, split: int):
    """x [B, T, K] (whole on every shard) times w [K, *out] split over its axis `split` (an
    output axis): [B, T, *out], the same axis split; no collective."""
    def product(x, w):
      return self._local(x, w.reshape(w.shape[0], -1)).reshape(*x.shape[:-1], *w.shape[1:])
    w_spec = self.split_spec(w_KO.ndim, split)
    out_spec = PartitionSpec(*self._lead, *w_spec[1:])
    return jax.shard_map(product, mesh=self.mesh,
                         in_specs=(PartitionSpec(*self._lead, None), w_spec),
                         out_specs=out_spec, check_vma=False)(x_BTK, w_KO)

  def row(self, x_BTI, w_IO, in_axes: int = 1, defer: bool = False, tokens: int | None = None):
    """x [B, T, *in] times w [*in, *out] over the `in_axes` input axes, the first of them split
    over the mesh axis in both: each shard's partial product, summed over the shards by one
    all-reduce; [B, T, *out] whole on every shard. `defer`: a PartialSum instead, where the
    workspace kernel is on and the output is one axis [B, T, D] (else the sum as without).
    `tokens` 1 with x [1, 2, ...]: a batch-1 step's row and its copy (the attention kernel
    wrote it twice: Attention._doubles_row), taken as the two rows that K-slice partials of one
    row need; where this product makes none (`takes_doubled_row`), the first row."""
    in_shape, out_shape = w_IO.shape[:in_axes], w_IO.shape[in_axes:]
    defer = defer and self.defers(len(out_shape))
    slices = self._slices(x_BTI.shape[:2], math.prod(in_shape)) if defer else 0
    if tokens is not None and tokens != x_BTI.shape[1]:
      if (tokens, x_BTI.shape[:2]) != (1, (1, 2)):
        raise ValueError(f"a doubled row is x [1, 2, ...] of 1 token, got {x_BTI.shape} "
                         f"for {tokens}")
      if not slices:
        x_BTI = x_BTI[:, :1]

    def product(x, w, row):
      k = math.prod(w.shape[:in_axes])
      if slices:
        return _k_slice_partials(x.reshape(*x.shape[:2], k), w.reshape(k, -1), slices)
      partial = self._local(x.reshape(*x.shape[:2], k), w.reshape(k, -1))
      if defer:
        return partial[None]
      return self._reduce(partial, row).reshape(*x.shape[:2], *out_shape)
    x_spec = PartitionSpec(*self._lead, *self.split_spec(len(in_shape), 0))
    rows, row_spec = table_operand(self._workspace)
    out_spec = PartitionSpec(*self._lead, *(None,) * len(out_shape))
    result = jax.shard_map(product, mesh=self.mesh,
                           in_specs=(x_spec, self.split_spec(w_IO.ndim, 0), row_spec),
                           out_specs=PartitionSpec(self.axis, *out_spec) if defer else out_spec,
                           check_vma=False)(x_BTI, w_IO, rows)
    if not defer:
      return result
    return PartialSum(result, self, x_BTI.dtype, (tokens or x_BTI.shape[1]) if slices else None)

  def defers(self, out_axes: int) -> bool:
    """Whether a row product of `out_axes` output axes asked to defer its all-reduce leaves it
    to the norm after it (a PartialSum): where the workspace kernel is on and the output is
    one axis [B, T, D]."""
    return self.defer_sums and self._workspace is not None and out_axes == 1

  def takes_doubled_row(self, k: int) -> bool:
    """Whether `row(..., defer=True)` of a batch-1 step's one row by a weight of K input rows
    makes K-slice partials, which take that row twice."""
    return (self.defer_sums and self._workspace is not None
            and self._slices((1, 1), k) > 0)

  def _slices(self, lead_BT, k: int) -> int:
    """K slices for a deferred row product of x [B, T, ...] by a weight of K input rows: the
    class's k_slices where the norm kernel takes a shard's rows (few: decode and verify
    steps, not prefill chunks, whose partials would be large and summed apart) and a shard's
    K cuts into slices of whole 64-row tiles; 0 (one product) otherwise."""
    from jspec.pallas_kernels import workspace_all_reduce as wsar
    b, t = NamedSharding(self.mesh, PartitionSpec(*self._lead)).shard_shape(tuple(lead_BT))
    local_k = k // self.mesh.shape[self.axis]
    if (self.k_slices > 1 and b * t <= wsar.NORM_ROWS
        and local_k % (self.k_slices * 64) == 0):
      return self.k_slices
    return 0

  def sum_partials(self, partials_ABTD, dtype, tokens=None):
    """The all-reduce a deferred row product left out: [A, B, T, D] -> [B, T, D]; K-slice
    partials (`tokens`, the window's T) summed over their slices first."""
    rows, row_spec = table_operand(self._workspace)

    def reduce(p, row):
      mine = p[0] if tokens is None else jnp.sum(p, axis=0)[:, :tokens].astype(dtype)
      return self._reduce(mine, row)
    return jax.shard_map(reduce, mesh=self.mesh,
                         in_specs=(PartitionSpec(self.axis, *self._lead, None), row_spec),
                         out_specs=PartitionSpec(*self._lead, None),
                         check_vma=False)(partials_ABTD, rows)

  def add_and_norm(self, partials_ABTD, residual_BTD, scale_D, eps: float,
                   zero_centered: bool, sliced: bool = False):
    """(h, norm(h)) for h = residual + the sum of the partials, in one kernel
    (jspec.pallas_kernels.workspace_norm), or None where it does not take a shard's rows.
    `sliced`: the partials are K slices' float32 partials, which the kernel sums first."""
    from jspec.pallas_kernels import workspace_norm
    lead = PartitionSpec(*self._lead, None)
    b, t, d = NamedSharding(self.mesh, lead).shard_shape(residual_BTD.shape)
    if (self._workspace is None
        or partials_ABTD.dtype != (jnp.float32 if sliced else residual_BTD.dtype)
        or scale_D.dtype != residual_BTD.dtype
        or not workspace_norm.fits((b * t, d), residual_BTD.dtype)):
      return None
    size = self.mesh.shape[self.axis]

    def per_shard(p, residual, scale, row):
      p = p.reshape(p.shape[0], -1, d) if sliced else p.reshape(b * t, d)
      h, normed = workspace_norm.workspace_add_norm(
          p, residual.reshape(b * t, d), scale, row, size, eps=eps,
          zero_centered=zero_centered)
      return h.reshape(b, t, d), normed.reshape(b, t, d)
    return jax.shard_map(per_shard, mesh=self.mesh,
                         in_specs=(PartitionSpec(self.axis, *lead), lead, PartitionSpec(),
                                   self._workspace.row_spec),
                         out_specs=(lead, lead), check_vma=False)(
        partials_ABTD, residual_BTD, scale_D, self._workspace.rows)


class PartialSum:
  """A row product's output before its all-reduce: each shard's partial sums, [A, B, T, D]
  split over the products' axis. `reduced()` is the output; `+` sums first; a norm after a
  residual add takes it whole (`add_and_norm`, one kernel with the sum)."""

  def __init__(self, partials_ABTD, products: TensorParallelProducts, dtype, tokens=None,
               optional: bool = False):
    """dtype: the product's; tokens: the window's T where the partials are the K slices'
    float32 partials [A * S, B, T or 2 T, D] (_k_slice_partials), None for [A, B, T, D].
    optional: the product summed over the shards before it deferred (FP8's,
    jspec.models.fp8_tensor_parallel): a reader with a kernel of its own for a summed delta
    (the MoE norm + router kernel, a norm writing e4m3 rows) sums it first and keeps that
    kernel, as before, where a bf16 product's reader gives its kernel up."""
    self.partials_ABTD, self.products, self.tokens = partials_ABTD, products, tokens
    self.optional = optional
    self.dtype = jnp.dtype(dtype)
    b, t, d = partials_ABTD.shape[1:]
    self.shape = (b, t if tokens is None else tokens, d)

  def reduced(self):
    return self.products.sum_partials(self.partials_ABTD, self.dtype, self.tokens)

  def add_and_norm(self, residual_BTD, scale_D, eps: float, zero_centered: bool):
    """(residual + the sum, its RMSNorm) in one kernel, or None where it does not fit."""
    return self.products.add_and_norm(self.partials_ABTD, residual_BTD, scale_D, eps,
                                      zero_centered, sliced=self.tokens is not None)

  def __add__(self, other):
    return self.reduced() + other

  def __radd__(self, other):
    return other + self.reduced()


def _k_slice_partials(x_BTK, w_KN, slices: int):
  """[S, B, T', N] float32: k_slice_partials of x's B x T rows (T' = 2 for one row, else T)."""
  b, t, k = x_BTK.shape
  parts_SMN = k_slice_partials(x_BTK.reshape(b * t, k), w_KN, slices)
  return parts_SMN.reshape(slices, b, -1, parts_SMN.shape[-1])


def k_slice_partials(x_MK, w_KN, slices: int, rows_last: bool = False):
  """[S, M', N] float32 (rows_last: [S, N, M']): x's and w's K axis cut into S slices, each
  slice's product, in one batched product (XLA's GEMM per slice, no K-slice sum of its own).
  One row (M = 1) goes twice, M' = 2 (as skinny_gemm's two-row products: XLA would rewrite a
  one-row dot of these sizes into a reduction); M' = M otherwise."""
  m, k = x_MK.shape
  x_MSK = x_MK.reshape(m, slices, k // slices)
  if m == 1:
    x_MSK = twice(x_MSK)
  return jnp.einsum("msk,skn->snm" if rows_last else "msk,skn->smn", x_MSK,
                    w_KN.reshape(slices, k // slices, -1), preferred_element_type=jnp.float32)


def tensor_parallel_products(mesh: Mesh, rules: ShardingRules, custom_all_reduce: bool,
                             kernel_always: bool = False) -> TensorParallelProducts | None:
  """The products for layers laid out by `rules` on `mesh`, where the mesh splits their heads
  and MLP over one tp axis (q heads, KV heads and the MLP over the same one); None where it
  splits none of them (the layers keep their own products), or where the batch is split over
  that axis too."""
  heads = split_axis(mesh, rules, "q_heads")
  mlp = split_axis(mesh, rules, "mlp")
  if heads is None and mlp is None:
    return None
  whole = all(split_axis(mesh, rules, name) is None for name in ("embed", "head_dim", "seq"))
  if heads != mlp or heads in mesh_axes(rules.batch) or not whole:
    return None
  return TensorParallelProducts(mesh, rules, heads, custom_all_reduce, kernel_always)

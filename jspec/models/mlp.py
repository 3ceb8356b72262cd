"""The SwiGLU MLP of the dense families' layers (and of MoE layers' shared experts), its
projections FP8 or not (jspec.models.linear), split over tp where the LLM gives it products.

Shape letters: B batch, T query tokens, D hidden, F MLP intermediate, C gate and up.
"""

from __future__ import annotations

import jax
from flax import nnx

from jspec.models.linear import (E4m3Rows, as_values, fp8_operands, fp8_rows_fit,
                                 fp8_whole_blocks, linear, project_named, project_to_norm)
from jspec.models.row_kernels import takes_rows

# Whether a decode or verify step's gate / up product and SiLU x up run as one kernel
# (MLP.swiglu_kernel, jspec.pallas_kernels.swiglu_gemm) where the norm backend runs the row
# kernels on Hopper GPUs, for shards of swiglu_gemm.MIN_F to MAX_F columns (measured faster
# there on an H200).
SWIGLU_KERNEL = True


class MLP(nnx.Module):
  """SwiGLU: down(silu(x @ gate) * (x @ up)), gate and up stored as one [D, 2, F] matrix.

  Why fused: at batch 1 a projection is a matrix-vector product, and one product over both
  matrices reads them faster than two (Qwen3-8B on an H200: 46.9 us per layer for the pair,
  against 2 x 27.5 us; BENCHMARKS.md). The middle axis is not sharded, so a tp shard holds
  the gate and up columns of its own slice of F and needs no communication.
  """

  def __init__(self, hidden: int, intermediate: int, dtype, rngs: nnx.Rngs,
               fp8_blocks: tuple = (None, None)):
    """fp8_blocks: the FP8 blocks of (gate_up_proj, down_proj), None where unquantized."""
    gate_up_block, down_block = fp8_blocks
    self.gate_up_proj, self.gate_up_proj_scale = linear(
        rngs, (hidden, 2, intermediate), dtype, ("embed", None, "mlp"), 1, gate_up_block)
    self.down_proj, self.down_proj_scale = linear(rngs, (intermediate, hidden), dtype,
                                                  ("mlp", "embed"), 1, down_block)
    # FP8 weights only: set as Attention's fp8_projection, fp8_add_norm and fp8_lanes are.
    self.fp8_projection = self.fp8_add_norm = None
    self.fp8_lanes = None
    # Whether gate / up's FP8 product takes its input as the norm's e4m3 rows
    # (linear.E4m3Rows), set by the LLM (jspec.backends.FP8_E4M3_ROWS); fp8_swiglu: (x, w8,
    # scale, lanes) -> the activation as e4m3 rows for down_proj
    # (jspec.models.fp8_row_kernels.sharded_fp8_swiglu; backends.FP8_E4M3_SWIGLU).
    self.fp8_e4m3_rows = False
    self.fp8_swiglu = None
    self.fp8_block = gate_up_block or down_block
    # Optional products for weights split over tp, as Attention.tp_products and fp8_tp.
    self.tp_products = self.fp8_tp = None
    # Optional (x [B, T, D], gate_up [D, 2, F]) -> the activation [B, T, F], for a step's few
    # rows (jspec.models.row_kernels.sharded_swiglu), set by the LLM where SWIGLU_KERNEL is on.
    self.swiglu_kernel = None

  def _dense(self, x, name: str, spec: str, fp8_sum_apart: bool = True):
    return project_named(self, x, name, spec, fp8_sum_apart=fp8_sum_apart)

  def takes_e4m3_rows(self, x_BTD) -> bool:
    """Whether this step's gate / up product reads the norm's e4m3 rows."""
    return (self.fp8_e4m3_rows and self.fp8_projection is not None
            and fp8_whole_blocks(self, ("gate_up_proj",))
            and fp8_rows_fit(self, x_BTD, ("gate_up_proj",)))

  def __call__(self, x_BTD, sum_later: bool = False):
    """sum_later: as Attention's, for down_proj's FP8 product. x may be the norm's e4m3 rows
    (takes_e4m3_rows), which only gate / up's FP8 product reads."""
    tp = self.tp_products if self.gate_up_proj_scale is None else None
    if sum_later and self._swiglu_e4m3(x_BTD):
      (w8,), (scale,), lanes = fp8_operands(self, ("gate_up_proj",), x_BTD.shape[-1])
      act_BTF = self.fp8_swiglu(x_BTD, w8, scale, lanes and lanes[0])
      return project_to_norm(self, act_BTF, "down_proj", "btf,fd->btd")
    act_BTF = self._activation(x_BTD, tp)
    if tp is not None and self.down_proj_scale is None:
      return tp.row(act_BTF, self.down_proj[...], defer=True)  # as Attention's o_proj
    fp8_row = self.fp8_tp and self.fp8_tp.layer_row(self, act_BTF, "down_proj",
                                                    defer=sum_later)
    if fp8_row is not None:
      return fp8_row
    if sum_later:
      return project_to_norm(self, act_BTF, "down_proj", "btf,fd->btd")  # as o_proj
    return self._dense(act_BTF, "down_proj", "btf,fd->btd")

  def _swiglu_e4m3(self, x_BTD) -> bool:
    """Whether gate / up's partials go to fp8_swiglu, and down_proj takes e4m3 rows: where
    gate / up take the norm's (so where the setting was measured), with the weights whole on
    every shard (FP8 weights split over tp go through fp8_tp's products instead)."""
    return (self.fp8_swiglu is not None and isinstance(x_BTD, E4m3Rows)
            and self.fp8_add_norm is not None and self.fp8_tp is None
            and fp8_whole_blocks(self, ("gate_up_proj", "down_proj"))
            and fp8_rows_fit(self, x_BTD, ("gate_up_proj",)))

  def _activation(self, x_BTD, tp):
    """silu(x @ gate) * (x @ up): one kernel where `swiglu_kernel` takes the step, else the
    product, then the activation in XLA (elementwise: XLA fuses an FP8 product's K-slice sum
    into it)."""
    if (self.swiglu_kernel is not None and self.gate_up_proj_scale is None
        and takes_rows(x_BTD, ndim=3)):
      return self.swiglu_kernel(as_values(x_BTD), self.gate_up_proj[...])
    sharded = self.fp8_tp and self.fp8_tp.layer_column(self, x_BTD, ("gate_up_proj",), 1)
    if tp is not None:
      x_BTD = as_values(x_BTD)
      gate_up_BTCF = tp.column(x_BTD, self.gate_up_proj[...], split=2)
    elif sharded:  # FP8 over tp: each shard its columns of F
      gate_up_BTCF, = sharded
    else:
      gate_up_BTCF = self._dense(x_BTD, "gate_up_proj", "btd,dcf->btcf", fp8_sum_apart=False)
    return jax.nn.silu(gate_up_BTCF[:, :, 0]) * gate_up_BTCF[:, :, 1]

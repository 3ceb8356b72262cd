"""Which weight a tp layer's fused all-reduce + norm pulls into L2 while it waits for its peers:
the weight of the product that reads the norm's output (jspec.pallas_kernels.workspace_norm,
L2_PREFETCH_BYTES). After the attention's norm that is the MLP's gate / up; after the MLP's
(the next layer's input norm) the next layer's fused q / k / v.

Only the dense paths whose products TensorParallelProducts runs name one: MoE blocks, latent
attention, FP8 weights and unfused q / k / v read first what the step's data decides or what
XLA lays out, and get None (nothing prefetched, the same results).
"""

from __future__ import annotations

from jspec.models import row_kernels
from jspec.models.layers import MLP, Attention
from jspec.sharding.tensor_parallel import NextWeight


def next_weight(module, rows: int) -> NextWeight | None:
  """The NextWeight of the first product `module` runs on a step of `rows` rows (B x T), None
  where there is none to prefetch."""
  if getattr(module, "tp_products", None) is None:
    return None
  if isinstance(module, MLP):
    return NextWeight(module.gate_up_proj[...], 2) if module.gate_up_proj_scale is None else None
  if isinstance(module, Attention) and module.fused_qkv:
    # The q / k / v kernel's K slices start at once: each slice's first bytes (row_kernels).
    sliced = (module.qkv_kernel is not None and not module.has_bias
              and row_kernels.QKV_SLICE_MIN_ROWS <= rows <= row_kernels.QKV_SLICE_ROWS)
    slices = row_kernels.qkv_k_slices() if sliced else 0
    return NextWeight(module.qkv_proj[...], 1, max(1, slices))
  return None

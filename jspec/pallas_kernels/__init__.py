"""MoE dispatch kernels in Pallas Mosaic GPU (interpret mode off-GPU)."""

from jspec.pallas_kernels.experts import choose_tilings, experts_pallas
from jspec.pallas_kernels.grouped_gemm import Tiling, down_weighted, gate_up_swiglu
from jspec.pallas_kernels.permute import permute_rows, unpermute_combine
from jspec.pallas_kernels.routing import RoutingPlan, max_tiles, plan_routing

__all__ = [
    "RoutingPlan", "Tiling", "choose_tilings", "down_weighted", "experts_pallas",
    "gate_up_swiglu", "max_tiles", "permute_rows", "plan_routing", "unpermute_combine",
]

"""MoE dispatch kernels in Pallas Mosaic GPU (interpret mode off-GPU)."""

from jspec.pallas_kernels.decode_gemm import DecodeTiling, down_decode, gate_up_decode
from jspec.pallas_kernels.decode_routing import DecodePlan, combine_slots, plan_decode
from jspec.pallas_kernels.experts import (choose_tilings, decode_tilings, experts_decode,
                                          experts_grouped, experts_pallas, use_decode_path)
from jspec.pallas_kernels.grouped_gemm import Tiling, down_weighted, gate_up_swiglu
from jspec.pallas_kernels.permute import permute_rows, unpermute_combine
from jspec.pallas_kernels.routing import RoutingPlan, max_tiles, plan_routing

__all__ = [
    "DecodePlan", "DecodeTiling", "RoutingPlan", "Tiling", "choose_tilings", "combine_slots",
    "decode_tilings", "down_decode", "down_weighted", "experts_decode", "experts_grouped",
    "experts_pallas", "gate_up_decode", "gate_up_swiglu", "max_tiles", "permute_rows",
    "plan_decode", "plan_routing", "unpermute_combine", "use_decode_path",
]

"""The 6-layer DeepSeek-V3 batch-32 step of ds_v3_b32_routed_2026-11-30.py with the MLA wgmma
form's chunk partials in float32 or the cache's dtype (PARTS=float32 | cache); run from the
checkout's root with PYTHONPATH=.
"""
import os, runpy, sys
from jspec.pallas_kernels import mla_decode
mla_decode.WGMMA_CACHE_DTYPE_PARTS = os.environ["PARTS"] == "cache"
print("wgmma partials:", os.environ["PARTS"], flush=True)
sys.argv = ["ds", "8192", "32768"]
runpy.run_path("benchmarks/results/ds_v3_b32_routed_2026-11-30.py", run_name="__main__")

"""What one small kernel costs inside a jitted loop of steps, by the kind that emits it: an XLA
fusion, a Pallas Triton kernel, a Pallas Mosaic GPU kernel (one program; and 132 programs
holding 192 KB of shared memory each, as jspec's persistent kernels do; and one program with
no TMA and no barrier, which tells the kernel's own setup from its launch).

Each chain is `--per-step` kernels of an [8, 128] float32 update (x * 1.0001 + 1e-6), in a
fori_loop of `--steps` steps, so that XLA runs it as the decode loops run: the loop body as a
CUDA graph. Printed: unprofiled wall time per kernel (best and median of 5 calls), then with
`--profile` each kind's kernel duration and the gap before it under the profiler (a negative gap:
the kernel began before the one before it had ended).

    python benchmarks/kernel_launch_cost.py --profile
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import triton as pltriton

from jspec.bench.profile import call_kernel_events
from jspec.pallas_kernels import platform


def _update(x):
  return x * 1.0001 + 1e-6


def xla_fusion(x):
  # The barrier keeps XLA from fusing the chain into one kernel.
  return jax.lax.optimization_barrier(_update(x))


def triton_kernel(x):
  def body(x_ref, o_ref):
    o_ref[...] = _update(x_ref[...])
  return pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        compiler_params=pltriton.CompilerParams(num_warps=4),
                        interpret=not platform.on_gpu(), name="tiny_triton")(x)


def mosaic_kernel(x, programs: int = 1, smem_kb: int = 0):
  def body(x_gmem, o_gmem):
    def scoped(tile, loaded, *reserved):
      plgpu.copy_gmem_to_smem(x_gmem, tile, loaded.at[0])
      plgpu.barrier_wait(loaded.at[0])
      tile[...] = _update(tile[...])
      plgpu.commit_smem()

      @pl.when(jax.lax.axis_index("sm") == 0)
      def _():
        plgpu.copy_smem_to_gmem(tile, o_gmem)

      plgpu.wait_smem_to_gmem(0)

    reserved = [plgpu.SMEM((smem_kb * 256,), jnp.float32)] if smem_kb else []
    pl.run_scoped(scoped, plgpu.SMEM(x.shape, x.dtype),
                  plgpu.Barrier(num_arrivals=1, num_barriers=1), *reserved)

  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(programs,),
                      grid_names=("sm",), interpret=platform.interpret_params(),
                      kernel_name="tiny_mosaic")(x)


def mosaic_direct_kernel(x):
  """The same update with no TMA and no barrier: registers loaded from global memory."""
  def body(x_gmem, o_gmem):
    o_gmem[...] = _update(x_gmem[...])
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(1,),
                      grid_names=("sm",), interpret=platform.interpret_params(),
                      kernel_name="tiny_mosaic_direct")(x)


KINDS = {
    "xla fusion": xla_fusion,
    "pallas triton": triton_kernel,
    "mosaic gpu, direct loads": mosaic_direct_kernel,
    "mosaic gpu, 1 program": mosaic_kernel,
    "mosaic gpu, 132 x 192 KB": lambda x: mosaic_kernel(x, 132, 192),
}


def chain(kernel, per_step: int, steps: int):
  def run(x):
    def step(_, x):
      for _ in range(per_step):
        x = kernel(x)
      return x
    return jax.lax.fori_loop(0, steps, step, x)
  return jax.jit(run)


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--per-step", type=int, default=40)
  parser.add_argument("--steps", type=int, default=50)
  parser.add_argument("--profile", action="store_true")
  args = parser.parse_args()
  x = jnp.ones((8, 128), jnp.float32)
  kernels = args.per_step * args.steps
  print(f"device: {jax.devices()[0].device_kind}; {kernels} kernels a call")
  print(f"{'kind':26s} {'us a kernel, best':>18s} {'median':>7s}")
  for name, kernel in KINDS.items():
    run = chain(kernel, args.per_step, args.steps)
    jax.block_until_ready(run(x))
    times = []
    for _ in range(5):
      start = time.perf_counter()
      jax.block_until_ready(run(x))
      times.append(time.perf_counter() - start)
    print(f"{name:26s} {1e6 * min(times) / kernels:18.2f} "
          f"{1e6 * float(np.median(times)) / kernels:7.2f}", flush=True)
  if args.profile:
    print(f"{'kind':26s} {'profiled kernels':>16s} {'duration us':>11s} {'gap before us':>13s}")
    for name, kernel in KINDS.items():
      events = [e for e in call_kernel_events(chain(kernel, args.per_step, args.steps), x)
                if "tiny" in e[2] or "fusion" in e[2]]
      durations = [(end - start) / 1e3 for start, end, _ in events]
      gaps = [(b[0] - a[1]) / 1e3 for a, b in zip(events, events[1:])]
      print(f"{name:26s} {len(events):16d} {np.median(durations):11.2f} "
            f"{np.median(gaps):13.2f}", flush=True)


if __name__ == "__main__":
  main()

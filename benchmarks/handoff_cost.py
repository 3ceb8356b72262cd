"""What a grid-wide handoff inside one persistent Mosaic GPU kernel costs, against a kernel
boundary, at decode sizes: the question a whole layer (or step) as one persistent kernel
turns on. The MoE experts as one kernel saved 0.6 µs a layer against two (BENCHMARKS.md, "MoE
decode experts as one persistent kernel ..."); this separates what a boundary costs from what
the handoff that replaces it costs.

Each phase: every program (one per SM) streams --tiles [128, 128] bfloat16 weight tiles through
a 3-stage TMA pipeline, multiplies each with its x [8, 128] (wgmma) and stores the [8, 128]
result. A program's x is the previous phase's result of the next program, (sm + 1) % P: each
phase depends on the one before it across programs, as a layer's next product does. Forms:

  kernels              one kernel a phase, in XLA's order
  persistent           one kernel for every phase: a program loads phase p + 1's weight tiles
                       while it waits for phase p's counter (a grid-shared semaphore) to count
                       every program, then loads its x from phase p's results (L2)
  persistent, no wait  the same without the counters: its results are wrong; its time is the
                       phases' work without a handoff

Printed per form: µs a phase (best and median of the repeats; each a jitted loop of --steps
passes of --phases phases), the outputs of the first two forms compared, then what a handoff
and a kernel boundary add to a phase.

    python3 benchmarks/handoff_cost.py --phases 48 --tiles 1 2 4
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jspec.pallas_kernels import decode_gemm, platform
from jspec.pallas_kernels.shared import smem_transforms

TILE = 128
ROWS = 8
STAGES = 3


def _proxy_fence():
  """fence.proxy.async.global (GPU only): the TMA's accesses ordered with the semaphores'."""
  if not platform.on_gpu():
    return
  from jax.experimental.mosaic.gpu import utils as mgpu_utils

  @plgpu.inline_mgpu()
  def _(ctx):
    del ctx
    mgpu_utils.inline_ptx("fence.proxy.async.global;", result_types=[],
                          has_side_effects=True)


# Jitted: the "kernels" form's calls are one lowering and one Mosaic GPU compile (the first
# phase is an operand, so that no call slices the weights).
@functools.partial(jax.jit, static_argnames=("phases", "wait"))
def phases_kernel(w, x0, first_1, phases: int, wait: bool):
  """w [all phases, P, tiles, 128, 128] bfloat16, x0 [P, 8, 128], first_1 int32 [1]: the
  results [phases, P, 8, 128] of phases first .. first + phases - 1, program s of each
  multiplying its tiles with the phase before's result of program (s + 1) % P (x0's for the
  first). wait: the counters between phases (GPU only)."""
  _, programs, tiles = w.shape[:3]
  sync = wait and platform.on_gpu()
  tile_t = smem_transforms(TILE, w.dtype)

  def body(first_ref, w_ref, x0_ref, out_ref):
    counters = pl.get_global(plgpu.SemaphoreType.REGULAR((phases,))) if sync else None

    def scoped(w_smem, x_smem, o_smem, loaded, x_loaded):
      sm = lax.axis_index("sm")
      source = lax.rem(sm + 1, jnp.int32(programs))
      first = first_ref[0]

      def fetch(step, slot):
        phase, t = lax.div(step, jnp.int32(tiles)), lax.rem(step, jnp.int32(tiles))
        plgpu.copy_gmem_to_smem(w_ref.at[first + phase, sm, t], w_smem.at[slot],
                                loaded.at[slot])

      for step in range(min(STAGES, phases * tiles)):
        fetch(jnp.int32(step), step)

      def phase_body(phase, _):
        @pl.when(phase == 0)
        def _():
          plgpu.copy_gmem_to_smem(x0_ref.at[source], x_smem, x_loaded.at[0])

        @pl.when(phase > 0)
        def _():
          if sync:
            plgpu.semaphore_wait(counters.at[phase - 1], programs, decrement=False,
                                 memory_scope="gpu")
            _proxy_fence()
          plgpu.copy_gmem_to_smem(out_ref.at[phase - 1, source], x_smem, x_loaded.at[0])

        plgpu.barrier_wait(x_loaded.at[0])

        def tile_body(t, acc):
          step = phase * tiles + t
          slot = lax.rem(step, jnp.int32(STAGES))
          plgpu.barrier_wait(loaded.at[slot])

          def mma(acc_ref):
            plgpu.wgmma(acc_ref, w_smem.at[slot].T, x_smem.T)
            return acc_ref[...]

          acc = acc + pl.run_scoped(mma, plgpu.ACC((TILE, ROWS)))
          pl.when(step + STAGES < phases * tiles)(
              functools.partial(fetch, step + STAGES, slot))
          return acc

        acc = lax.fori_loop(jnp.int32(0), jnp.int32(tiles), tile_body,
                            decode_gemm._zeros(1, (TILE, ROWS))[0])
        decode_gemm._store_transposed(acc, o_smem, out_ref.at[phase, sm])
        if sync:
          plgpu.wait_smem_to_gmem(0)  # landed, then counted
          _proxy_fence()
          plgpu.semaphore_signal(counters.at[phase], 1, memory_scope="gpu")
        return ()

      lax.fori_loop(jnp.int32(0), jnp.int32(phases), phase_body, ())
      plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(
        scoped,
        plgpu.SMEM((STAGES, TILE, TILE), w.dtype, transforms=tile_t),
        plgpu.SMEM((ROWS, TILE), x0.dtype, transforms=tile_t),
        plgpu.SMEM((ROWS, TILE), x0.dtype, transforms=tile_t),
        plgpu.Barrier(num_arrivals=1, num_barriers=STAGES),
        plgpu.Barrier(num_arrivals=1, num_barriers=1),
    )

  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((phases, programs, ROWS, TILE), x0.dtype),
      grid=(programs,), grid_names=("sm",), interpret=platform.interpret_params(),
      kernel_name="handoff_phases")(first_1, w, x0)


def one_pass(form: str):
  """x [P, 8, 128] -> the last phase's results, in `form`."""
  def run(w, x):
    if form == "kernels":
      for phase in range(w.shape[0]):
        x = phases_kernel(w, x, jnp.full((1,), phase, jnp.int32), phases=1, wait=False)[0]
      return x
    return phases_kernel(w, x, jnp.zeros((1,), jnp.int32), phases=w.shape[0],
                         wait=form == "persistent")[-1]
  return run


def timed(form: str, w, x, steps: int, repeats: int):
  """(best, median) µs a phase, and the results of one pass."""
  run = jax.jit(lambda w, x: lax.fori_loop(0, steps, lambda _, x: one_pass(form)(w, x), x))
  jax.block_until_ready(run(w, x))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(run(w, x))
    times.append(time.perf_counter() - start)
  per_phase = 1e6 / (steps * w.shape[0])
  return min(times) * per_phase, float(np.median(times)) * per_phase, jax.jit(
      one_pass(form))(w, x)


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--phases", type=int, default=48)
  parser.add_argument("--tiles", type=int, nargs="+", default=[1, 2, 4],
                      help="weight tiles a program streams a phase (32 KB each)")
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  programs = platform.num_sms()
  print(f"device: {jax.devices()[0].device_kind}; {programs} programs, {args.phases} phases")
  key = jax.random.key(0)
  x = jax.random.normal(key, (programs, ROWS, TILE), jnp.float32).astype(jnp.bfloat16)
  forms = ["kernels", "persistent", "persistent, no wait"]
  print(f"{'tiles':>5s} {'MB a phase':>10s} " + " ".join(f"{f:>21s}" for f in forms)
        + f" {'handoff us':>10s} {'boundary us':>11s}")
  for tiles in args.tiles:
    shape = (args.phases, programs, tiles, TILE, TILE)
    w = (jax.random.normal(jax.random.key(tiles), shape, jnp.float32)
         / np.sqrt(TILE * tiles)).astype(jnp.bfloat16)
    rows = {form: timed(form, w, x, args.steps, args.repeats) for form in forms}
    equal = np.array_equal(np.asarray(rows["kernels"][2], np.float32),
                           np.asarray(rows["persistent"][2], np.float32))
    best = {form: rows[form][0] for form in forms}
    cells = " ".join(f"{rows[f][0]:10.2f} / {rows[f][1]:8.2f}" for f in forms)
    print(f"{tiles:5d} {programs * tiles * TILE * TILE * 2 / 1e6:10.2f} {cells} "
          f"{best['persistent'] - best['persistent, no wait']:10.2f} "
          f"{best['kernels'] - best['persistent, no wait']:11.2f}"
          + ("" if equal else "   (kernels and persistent results DIFFER)"), flush=True)


if __name__ == "__main__":
  main()

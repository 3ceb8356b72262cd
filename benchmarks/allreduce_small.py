"""Small all-reduces over the GPUs of one host: NCCL's (XLA's psum) against jspec's one-shot
Mosaic GPU kernels, per message size, as a decode step issues them: a chain of dependent
all-reduces inside one jitted program, each followed by a scale (so XLA can neither merge nor
drop them).

  nccl       lax.psum (NCCL, or XLA's one-shot kernel under its flag)
  workspace  jspec.pallas_kernels.workspace_all_reduce: per-GPU workspaces registered once,
             one plain kernel launch a call (the tp layers' "kernel" backend), in its default
             protocol; workspace-lamport / workspace-flags name the protocol (the data polled
             as its own flag, or a flag raised after it: jspec.pallas_kernels.lamport_exchange)
  norm-lamport, norm-flags
             jspec.pallas_kernels.workspace_norm: the all-reduce fused with the residual add
             and RMSNorm of one row (the message), as a tp decode step at batch 1 calls it;
             checked against norm-flags; norm-lamport-prefetch with the residual and scale
             read before the exchange (workspace_norm.PREFETCH)
  mosaic     jspec.pallas_kernels.all_reduce: peer reads through remote_ref, launched by XLA
             as a collective kernel (its barrier and pointer table each call)

    python benchmarks/allreduce_small.py --impl nccl workspace mosaic --kb 8 32 64 --devices 2
    XLA_FLAGS=--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true \\
        python benchmarks/allreduce_small.py --impl nccl

Figures: microseconds per all-reduce, the chain's median wall time over --repeats calls less
the same chain without the all-reduces, divided by its length. `--form loop` runs the chain as
a `fori_loop` of layers (two all-reduces each), as the decode loop does; `unrolled` inlines it.
Every result is checked against psum's before it is timed.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jspec.pallas_kernels.all_reduce import one_shot_all_reduce
from jspec.pallas_kernels import workspace_norm
from jspec.pallas_kernels.workspace_all_reduce import fits, workspace_all_reduce, workspace_for
from jspec.pallas_kernels.workspace_norm import workspace_add_norm


def reduce_fn(impl: str, axis_size: int, blocks: int | None, skip_barrier: bool = False):
  """(x, row) -> the sum of x over "tp"; `row` is the workspace table's row (workspace only)."""
  if impl == "nccl":
    return lambda x, row: lax.psum(x, "tp")
  if impl.startswith("workspace"):
    protocol = impl.partition("-")[2] or None
    return lambda x, row: workspace_all_reduce(x, row, axis_size, max_blocks=blocks or 32,
                                               protocol=protocol)
  if impl.startswith("norm-"):
    protocol, _, prefetch = impl.partition("-")[2].partition("-")

    def add_norm(x, row):
      workspace_norm.PREFETCH = prefetch == "prefetch"  # read when the kernel is built
      row_1D = x.reshape(1, -1)
      scale = jnp.ones(row_1D.shape[1:], x.dtype)
      residual = jnp.zeros_like(row_1D)  # the same on every device, as a model's stream
      _, normed = workspace_add_norm(row_1D, residual, scale, row, axis_size, eps=1e-6,
                                     protocol=protocol)
      return normed.reshape(x.shape)
    return add_norm
  if impl == "mosaic":
    return lambda x, row: one_shot_all_reduce(x, "tp", axis_size, num_blocks=blocks,
                                              _skip_device_barrier=skip_barrier)
  if impl == "none":
    return lambda x, row: x
  raise ValueError(impl)


def sharded(mesh, fn):
  """fn(x, row) per device, x split over "tp" in rows, the workspace's table row beside it."""
  workspace = workspace_for(mesh, "tp")
  program = jax.jit(jax.shard_map(lambda x, row: fn(x[0], row)[None], mesh=mesh,
                                  in_specs=(P("tp"), workspace.row_spec), out_specs=P("tp"),
                                  check_vma=False))
  return lambda x: program(x, workspace.rows)


def chain_program(mesh, reduce, length: int, form: str):
  def chain(x, row):
    if form == "unrolled":
      for _ in range(length):
        x = reduce(x, row) * jnp.asarray(0.5, x.dtype)
    else:
      def layer(_, x):
        x = reduce(x, row) * jnp.asarray(0.5, x.dtype)
        return reduce(x, row) * jnp.asarray(0.5, x.dtype)
      x = lax.fori_loop(0, length // 2, layer, x)
    return x
  return sharded(mesh, chain)


def time_call(fn, x, repeats: int) -> float:
  fn(x).block_until_ready()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn(x).block_until_ready()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--impl", nargs="+", default=["nccl", "workspace"],
                      choices=["nccl", "workspace", "workspace-lamport", "workspace-flags",
                               "norm-lamport", "norm-lamport-prefetch", "norm-flags",
                               "mosaic"])
  parser.add_argument("--kb", type=int, nargs="+", default=[8, 32, 64])
  parser.add_argument("--devices", type=int, default=2)
  parser.add_argument("--length", type=int, default=72, help="all-reduces in the chain")
  parser.add_argument("--form", nargs="+", default=["unrolled", "loop"],
                      choices=["unrolled", "loop"])
  parser.add_argument("--blocks", type=int, nargs="+", default=[8],
                      help="the kernels' blocks (at most, for workspace; ignored by nccl)")
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--skip-barrier", action="store_true",
                      help="the kernel without XLA's barrier before it: unsafe, measures the "
                           "barrier's cost only")
  args = parser.parse_args()

  devices = jax.devices()[:args.devices]
  mesh = Mesh(np.asarray(devices), ("tp",))
  dtype = jnp.dtype(args.dtype)
  print(f"# {len(devices)} x {devices[0].device_kind}, jax {jax.__version__}, "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, "
        f"NCCL_PROTO={os.environ.get('NCCL_PROTO', '')!r}", flush=True)
  rows = []
  for kb in args.kb:
    n = kb * 1024 // dtype.itemsize
    x_host = np.random.default_rng(kb).standard_normal((args.devices, n)).astype(np.float32)
    x = jax.device_put(jnp.asarray(x_host, dtype), NamedSharding(mesh, P("tp")))
    want = {}
    for form in args.form:
      base = time_call(chain_program(mesh, reduce_fn("none", args.devices, None), args.length,
                                     form), x, args.repeats)
      for impl in args.impl:
        norm = impl.startswith("norm-")
        for blocks in (args.blocks if impl.startswith(("workspace", "mosaic")) else [None]):
          if impl.startswith("workspace") and not fits(x.shape[1:], dtype, blocks):
            print(f"  {kb:4d} KB {impl} blocks={blocks}: no even split, skipped")
            continue
          if norm and not workspace_norm.fits((1, n), dtype):
            print(f"  {kb:4d} KB {impl}: not one row the norm kernel takes, skipped")
            continue
          reduce = reduce_fn(impl, args.devices, blocks, args.skip_barrier)
          got = np.asarray(sharded(mesh, reduce)(x).astype(jnp.float32))
          reference = "norm-flags" if norm else "nccl"
          if reference not in want:
            program = sharded(mesh, reduce_fn(reference, args.devices, None))
            want[reference] = np.asarray(program(x).astype(jnp.float32))
          exact = bool(np.array_equal(got, want[reference]))
          close = bool(np.allclose(got, want[reference], rtol=2e-2, atol=2e-2))
          same = bool(all(np.array_equal(got[0], g) for g in got))
          wall = time_call(chain_program(mesh, reduce, args.length, form), x, args.repeats)
          per_call = 1e6 * (wall - base) / args.length
          rows.append((kb, form, impl, blocks, per_call, 1e6 * wall / args.length, exact,
                       close, same))
          print(f"  {kb:4d} KB {form:9s} {impl:17s} blocks={blocks}: {per_call:7.2f} us "
                f"(chain {1e6 * wall / args.length:.2f} us/op) exact={exact} close={close} "
                f"shards_equal={same}", flush=True)
  print("\n| message | form | all-reduce | blocks | us per all-reduce | chain us/op | equals psum"
        " (norm-*: norm-flags) | shards equal |")
  print("| ---: | --- | --- | ---: | ---: | ---: | --- | --- |")
  for kb, form, impl, blocks, per_call, chain, exact, close, same in rows:
    equal = "bitwise" if exact else ("within 2e-2" if close else "NO")
    print(f"| {kb} KB | {form} | {impl} | {blocks or ''} | {per_call:.2f} | {chain:.2f} | "
          f"{equal} | {same} |")


if __name__ == "__main__":
  main()

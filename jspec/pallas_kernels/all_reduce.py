"""A one-shot all-reduce of a small message over one mesh axis, as one Pallas Mosaic GPU kernel
whose peer reads go through `remote_ref`.

The layers do not use it: XLA launches a kernel that reads peer memory as a collective, with a
device barrier (~9 µs on 2 H100s) and a pointer table copy before every call, which left a
tp = 2 step no faster. jspec.pallas_kernels.workspace_all_reduce, launched as a plain kernel,
replaced it. It stays as the Pallas form of the idea, tested in interpret mode, and as
benchmarks/allreduce_small.py's `mosaic` row.

Each shard reads every shard's message straight from its peer's memory over NVLink (peer
pointers: `plgpu.remote_ref`, which in a one-process mesh XLA's collective metadata provides)
and sums the messages itself; then it tells each peer it is done reading, and waits for every
peer to say the same before its input may be reused. One launch, one round of flags, no
staging copies: the shape vLLM's and TensorRT-LLM's one-shot all-reduces take for messages of
a few KB, where NCCL's ring pays its fixed cost per call.

Every shard adds the messages in the same order (shard 0 first) in float32 and rounds once,
so all shards hold the same bits, as a replicated activation must.

Shape letters: N the message's elements, A the number of shards on the axis.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jspec.pallas_kernels import platform

# One warpgroup load moves 16 bytes per thread: 128 threads x 8 bf16 elements.
LOAD_BYTES = 16
# Past this the ring's bandwidth wins over reading every peer's message whole (vLLM's
# one-shot limit on NVLink is of the same order).
MAX_MESSAGE_BYTES = 256 * 1024
# Blocks the message is spread over: each block's reads are in flight at once, and a
# peer's reads cost about a microsecond of latency each.
DEFAULT_BLOCKS = 8


def tile_elements(dtype) -> int:
  """Elements one warpgroup reads per load: 128 threads x 16 bytes."""
  return 128 * (LOAD_BYTES // jnp.dtype(dtype).itemsize)


def fits_kernel(shape, dtype) -> bool:
  """A message the kernel takes: a float16 / bfloat16 / float32 array of whole warpgroup tiles,
  at most MAX_MESSAGE_BYTES."""
  dtype = jnp.dtype(dtype)
  if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
    return False
  size = math.prod(shape)
  return size % tile_elements(dtype) == 0 and 0 < size * dtype.itemsize <= MAX_MESSAGE_BYTES


def one_shot_all_reduce(x, axis_name: str, axis_size: int, *, num_blocks: int | None = None,
                        interpret=None, _skip_device_barrier: bool = False):
  """The sum of `x` over the mesh axis `axis_name` (of `axis_size` shards), inside a
  `shard_map` over that axis: what `lax.psum(x, axis_name)` gives, with every shard's result
  bit-identical (summed in shard order in float32). `x` must fit `fits_kernel`.

  XLA runs a cross-device barrier before the kernel (its launch of a kernel that reads peer
  memory); `_skip_device_barrier` leaves it out, which is unsafe (a peer may read an input
  its owner has not written yet) and exists only to measure what the barrier costs
  (benchmarks/allreduce_small.py --skip-barrier)."""
  if not fits_kernel(x.shape, x.dtype):
    raise ValueError(f"one_shot_all_reduce takes float messages of whole {tile_elements(x.dtype)}"
                     f"-element tiles up to {MAX_MESSAGE_BYTES} bytes; got {x.shape} {x.dtype}")
  if axis_size == 1:
    return x
  tile = tile_elements(x.dtype)
  vec = LOAD_BYTES // jnp.dtype(x.dtype).itemsize
  tiles = x.size // tile
  blocks = min(tiles, num_blocks or DEFAULT_BLOCKS)
  layout = plgpu.Layout.WG_STRIDED((tile,), vec_size=vec)

  def body(x_ref, y_ref, done_sem):
    me = lax.axis_index(axis_name)

    @plgpu.nd_loop((tiles,), collective_axes="blocks")
    def _(loop):
      (t,) = loop.index
      rows = pl.ds(t * tile, tile)
      total = None
      for shard in range(axis_size):
        part = plgpu.layout_cast(plgpu.remote_ref(x_ref, {axis_name: shard})[rows], layout)
        part = part.astype(jnp.float32)
        total = part if total is None else total + part
      y_ref[rows] = total.astype(y_ref.dtype)

    # This block has read its tiles of every peer's message: tell the same block of each
    # peer (a scratch semaphore is the block's own), then wait until that block of every
    # peer has read ours. Once every block returns, no peer reads our input any more, and
    # XLA may reuse its buffer.
    for shard in range(axis_size):
      @pl.when(me != shard)
      def _():
        pl.semaphore_signal(done_sem, device_id={axis_name: shard})
    pl.semaphore_wait(done_sem, axis_size - 1)

  flat = x.reshape(x.size)
  out = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct(flat.shape, flat.dtype),
      grid=(blocks,),
      grid_names=("blocks",),
      scratch_types=[plgpu.SemaphoreType.REGULAR],
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
          skip_device_barrier=_skip_device_barrier),
      interpret=_interpret_params() if interpret is None else interpret,
  )(flat)
  return out.reshape(x.shape)


def _interpret_params():
  """None on a GPU; off it, the interpreter with fresh buffers zeroed: it cannot fill a
  semaphore with NaN, and on the GPU a kernel's semaphores start at zero."""
  if platform.on_gpu():
    return None
  return plgpu.InterpretGPUParams(uninitialized_memory="zero")

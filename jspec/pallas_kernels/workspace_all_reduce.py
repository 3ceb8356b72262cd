"""A one-shot all-reduce of a small message through a workspace every GPU keeps for its peers.

XLA's all-reduce costs 12-19 µs at 8 KB on 2 GPUs; a `remote_ref` kernel pays XLA's collective
launch (a ~9 µs barrier). vLLM, SGLang and TensorRT-LLM register one buffer per GPU once and
keep their handshake flags in it, so a call is one plain kernel launch. Here the same:

  PeerWorkspace(mesh, axis)   one buffer on every device of the mesh, allocated once
                              and kept alive, and a table of the buffers' addresses: each
                              device holds its own row (its reduction group's addresses in
                              axis order, and its rank in the group).
  workspace_all_reduce(x, row, ...)
                              inside a shard_map: each block writes its part of x into every
                              peer's workspace (its own too), learns that every peer's part
                              has landed in its own, and sums the parts in rank order.

How a block learns it, the `protocol`: "lamport" (float messages, the default) polls the data
itself, whose empty slots hold a bit pattern no part is sent as (jspec.pallas_kernels.
lamport_exchange: one crossing of NVLink); "flags" (int32 messages always) raises a flag after
the data and waits for the peers' flags, as described next.

The kernel reaches the workspaces through their raw addresses, so XLA sees an ordinary
custom call: no collective launch, no barrier. The flags are counting semaphores that each
call raises and consumes, so they are zero again once every device has finished a call, and
a peer's flag for the next call may arrive early without harm. The parts go to one of two
slots by the call's parity (a counter per block): a peer can be at most one call ahead,
since it cannot finish a call without our flag for it, so it never writes the slot we read.

The workspace is per block, not per message byte: block b of every call uses slot b, its own
counter and its own flags, so calls with different messages or block counts never overlap. Each
kind of kernel has a region of its own (`Region`; the handshake they share is
jspec.pallas_kernels.peer_exchange's, which jspec.pallas_kernels.workspace_norm uses too). Every
device of a group must make the same calls in the same order, as the devices of one SPMD program
do. The buffers live as long as the process (the compiled programs hold their addresses).

Peer addresses are valid inside one process (a one-process mesh over local GPUs, with peer
access, as XLA enables it between them); across hosts the layers keep XLA's all-reduce.

Shape letters: N the message's elements, A the devices on the axis, G the kernel's blocks.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jspec.pallas_kernels import lamport_exchange as lamport
from jspec.pallas_kernels.peer_exchange import MAX_DEVICES, Region, as_kernel, exchange

# The message a block writes, reads and sums: 128 threads x 16 bytes, one vector each.
TILE_BYTES = 128 * 16
# Blocks a call may use, each with its own two data slots per peer and its own flags.
MAX_BLOCKS = 64
# Bytes of the message one block carries.
BLOCK_BYTES = 8 * 1024
# The largest message: 32 blocks (the default) of BLOCK_BYTES. Larger ones (prefill chunks,
# big batches) keep XLA's all-reduce, whose ring is bandwidth-bound where this kernel writes
# every part to every device; the two were not timed against each other past 64 KB.
MAX_MESSAGE_BYTES = 256 * 1024
FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
# int32 sums wrap, so a sum with zeros is exact for any bits: an all-gather of words written
# into slots of their own (jspec.sharding.moe).
DTYPES = FLOAT_DTYPES + (jnp.dtype(jnp.int32),)


# The all-reduce's region: MAX_BLOCKS slots of BLOCK_BYTES.
SUM_REGION = Region(0, MAX_BLOCKS, BLOCK_BYTES)
# The all-reduce + residual add + RMSNorm's region (jspec.pallas_kernels.workspace_norm), after
# the all-reduce's: rows of up to 16 KB, each split over blocks of one tile, so a row has
# NORM_ROW_BYTES // TILE_BYTES slots of TILE_BYTES (row r's chunk c in slot r * 8 + c).
NORM_ROWS = 32
NORM_ROW_BYTES = 16 * 1024
NORM_ROW_SLOTS = NORM_ROW_BYTES // TILE_BYTES


def norm_region(axis_size: int) -> Region:
  return Region(SUM_REGION.end(axis_size), NORM_ROWS * NORM_ROW_SLOTS, TILE_BYTES)


# The same two kinds of kernel without flags (jspec.pallas_kernels.lamport_exchange), float
# messages only: the all-reduce's blocks, then the norm's rows with a set of slots per chunk
# count (lamport.first_row_slot).
def lamport_sum_region(axis_size: int) -> lamport.LamportRegion:
  return lamport.LamportRegion(norm_region(axis_size).end(axis_size), MAX_BLOCKS, BLOCK_BYTES)


def lamport_norm_region(axis_size: int) -> lamport.LamportRegion:
  return lamport.LamportRegion(lamport_sum_region(axis_size).end(axis_size),
                               lamport.row_slots(NORM_ROWS, NORM_ROW_SLOTS), TILE_BYTES)


def workspace_bytes(axis_size: int) -> int:
  return lamport_norm_region(axis_size).end(axis_size)


# How a message is handed over: "lamport" (the data polled, one NVLink crossing) or "flags" (a
# flag raised after the data). int32 messages take the flags: every bit pattern is a valid
# int32, so a word may be the all-ones pattern that marks an empty Lamport slot (the MoE
# gather's words in the Lamport form, with a stand-in for that word, measured no faster on
# H200s and was removed).
PROTOCOLS = ("lamport", "flags")
DEFAULT_PROTOCOL = "lamport"


def protocol_for(dtype, protocol: str | None) -> str:
  if protocol is not None and protocol not in PROTOCOLS:
    raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
  if jnp.dtype(dtype) == jnp.dtype(jnp.int32):
    if protocol == "lamport":  # an int32 word may be all ones: the Lamport form's sentinel
      raise ValueError("int32 messages take the flags protocol; the Lamport form reserves the "
                       "all-ones word, which an int32 part may hold")
    return "flags"
  return protocol or DEFAULT_PROTOCOL


def fits(shape, dtype, max_blocks: int = 32) -> bool:
  """A message the kernel takes: float16 / bfloat16 / float32 / int32, a whole number of 2 KB
  tiles, at most MAX_MESSAGE_BYTES, that `max_blocks` blocks can split evenly (plan_blocks)."""
  dtype = jnp.dtype(dtype)
  nbytes = math.prod(shape) * dtype.itemsize
  if dtype not in DTYPES or not 0 < nbytes <= MAX_MESSAGE_BYTES or nbytes % TILE_BYTES:
    return False
  try:
    plan_blocks(nbytes, max_blocks)
  except ValueError:
    return False
  return True


def plan_blocks(nbytes: int, max_blocks: int = 32) -> tuple[int, int]:
  """(G blocks, tiles per block) for a message of `nbytes`: the most blocks up to
  `max_blocks` that split its tiles evenly, each carrying at most BLOCK_BYTES. More blocks
  put more of the message in flight at once; a block's flags cost the same at any size."""
  tiles = nbytes // TILE_BYTES
  if tiles * TILE_BYTES != nbytes or tiles == 0:
    raise ValueError(f"a message of {nbytes} bytes is not a whole number of {TILE_BYTES}-byte "
                     "tiles")
  per_block_max = BLOCK_BYTES // TILE_BYTES
  for blocks in range(min(tiles, max_blocks, MAX_BLOCKS), 0, -1):
    if tiles % blocks == 0 and tiles // blocks <= per_block_max:
      return blocks, tiles // blocks
  raise ValueError(f"a message of {tiles} tiles has no even split over at most {max_blocks} "
                   f"blocks of at most {per_block_max} tiles")


def group_rows(device_ids: np.ndarray, axis: int, addresses: dict[int, int]) -> np.ndarray:
  """The address table: for each device of the mesh array `device_ids` (ids, any rank), the
  int32 words [low, high of the workspace address of each device of its group in axis
  order..., its rank in the group], where its group is the devices that differ from it only
  along `axis`. Shape [*device_ids.shape, 2 A + 1]."""
  ids = np.moveaxis(device_ids, axis, -1)
  size = ids.shape[-1]
  rows = np.zeros((*ids.shape, 2 * size + 1), np.uint32)
  for index in np.ndindex(ids.shape[:-1]):
    group = ids[index]
    words = np.array([[addresses[int(d)] & 0xFFFFFFFF, addresses[int(d)] >> 32] for d in group],
                     np.uint64).astype(np.uint32).reshape(-1)
    for rank in range(size):
      rows[index + (rank,)] = np.concatenate([words, [rank]])
  return np.moveaxis(rows.view(np.int32), -2, axis)


class PeerWorkspace:
  """The workspace of every device of `mesh` for all-reduces over `axis` (see the module
  docstring). `row_spec` places `rows` so that each device holds its own row inside a
  shard_map over the whole mesh."""

  def __init__(self, mesh: Mesh, axis: str):
    if axis not in mesh.axis_names:
      raise ValueError(f"mesh has no axis {axis!r}: {mesh.axis_names}")
    size = mesh.shape[axis]
    if not 2 <= size <= MAX_DEVICES:
      raise ValueError(f"the workspace all-reduce takes 2 to {MAX_DEVICES} devices on an axis; "
                       f"{axis!r} has {size}")
    devices = mesh.devices
    if any(d.process_index != jax.process_index() for d in devices.flat):
      raise ValueError("the workspace all-reduce reaches its peers by address, which holds "
                       "within one process; this mesh spans processes")
    self.mesh, self.axis, self.axis_size = mesh, axis, size
    self.row_spec = PartitionSpec(*mesh.axis_names, None)
    words = np.zeros(workspace_bytes(self.axis_size) // 4, np.int32)
    for region in self._lamport_regions():  # empty data slots: all-ones bytes
      words[region.data_offset // 4:region.end(size) // 4] = -1
    # A copy per device: on the CPU a device_put may alias the host array itself, which
    # would hand every device one buffer (and one address).
    self._buffers = {d.id: jax.device_put(words.copy(), d) for d in self.mesh.devices.flat}
    for buffer in self._buffers.values():
      buffer.block_until_ready()
    addresses = {d: int(b.unsafe_buffer_pointer()) for d, b in self._buffers.items()}
    ids = np.vectorize(lambda d: d.id)(self.mesh.devices)
    table = group_rows(ids, self.mesh.axis_names.index(self.axis), addresses)
    self.rows = jax.device_put(table, NamedSharding(self.mesh, self.row_spec))

  def counters(self) -> dict[int, np.ndarray]:
    """Each device's per-slot call counters, the all-reduce's slots then the norm kernel's
    (for tests: every device of a group must agree)."""
    return {d: np.concatenate([words[r.counters_offset // 4:r.counters_offset // 4 + r.slots]
                               for r in self._regions()]) for d, words in self._read().items()}

  def flags(self) -> dict[int, np.ndarray]:
    """Each device's flags [slots, MAX_DEVICES], the all-reduce's slots then the norm
    kernel's: all zero between programs."""
    return {d: np.concatenate([words[r.flags_offset // 4:r.counters_offset // 4]
                               .reshape(r.slots, MAX_DEVICES) for r in self._regions()])
            for d, words in self._read().items()}

  def lamport_idle(self) -> dict[int, bool]:
    """Per device: whether every Lamport slot's next two phases are empty (all ones), as
    they must be between programs (the third holds the slot's last call)."""
    idle = {}
    for d, words in self._read().items():
      ok = True
      for region in self._lamport_regions():
        count = words[region.counters_offset // 4:][:region.slots]
        data = words[region.data_offset // 4:region.end(self.axis_size) // 4].reshape(
            lamport.PHASES, self.axis_size, region.slots, -1)
        for step in (0, 1):
          phase = (count + step) % lamport.PHASES
          ok &= bool((data[phase, :, np.arange(region.slots)] == -1).all())
      idle[d] = ok
    return idle

  def _regions(self) -> tuple[Region, Region]:
    return SUM_REGION, norm_region(self.axis_size)

  def _lamport_regions(self) -> tuple[lamport.LamportRegion, lamport.LamportRegion]:
    return lamport_sum_region(self.axis_size), lamport_norm_region(self.axis_size)

  def _read(self) -> dict[int, np.ndarray]:
    # The kernels write the buffers behind JAX's back, and JAX keeps the host copy of an array
    # it has read once: read a fresh device copy each time.
    return {d: np.asarray(jnp.array(b, copy=True) + 0) for d, b in self._buffers.items()}


_WORKSPACES: dict[tuple, PeerWorkspace] = {}


def workspace_for(mesh: Mesh, axis: str) -> PeerWorkspace:
  """The one workspace of (mesh, axis), made on first use and kept for the process."""
  key = (tuple(d.id for d in mesh.devices.flat), mesh.devices.shape, mesh.axis_names, axis)
  if key not in _WORKSPACES:
    _WORKSPACES[key] = PeerWorkspace(mesh, axis)
  return _WORKSPACES[key]


def workspace_all_reduce(x, row, axis_size: int, *, max_blocks: int = 32,
                         protocol: str | None = None):
  """The sum of `x` over the devices of its group, inside a shard_map that hands each device
  its own `row` of a PeerWorkspace's table (any shape of 2 A + 1 int32 words). Every device's
  result holds the same bits: the parts are summed in rank order in float32 and rounded once
  (under "lamport" an all-ones NaN element is sent as the quiet NaN). `protocol`: see
  PROTOCOLS; int32 messages take "flags". Hopper GPUs only (the kernel is Mosaic GPU's, with
  no interpreter)."""
  protocol = protocol_for(x.dtype, protocol)
  if not fits(x.shape, x.dtype, max_blocks):
    raise ValueError(f"workspace_all_reduce takes float16 / bfloat16 / float32 / int32 messages "
                     f"of whole "
                     f"{TILE_BYTES}-byte tiles up to {MAX_MESSAGE_BYTES} bytes that "
                     f"{max_blocks} blocks split evenly; got {x.shape} {x.dtype}")
  row = row.reshape(-1)
  if row.shape != (2 * axis_size + 1,) or row.dtype != jnp.int32:
    raise ValueError(f"row: expected {2 * axis_size + 1} int32 words, got {row.shape} {row.dtype}")
  flat = x.reshape(-1)
  blocks, tiles_per_block = plan_blocks(flat.size * flat.dtype.itemsize, max_blocks)
  kernel = _build(flat.size, jnp.dtype(flat.dtype), axis_size, blocks, tiles_per_block,
                  protocol)
  return kernel(flat, row).reshape(x.shape)


@functools.cache
def _build(n: int, dtype, axis_size: int, blocks: int, tiles_per_block: int,
           protocol: str = "flags"):
  # Mosaic GPU's own modules: imported here, so that jspec imports without a GPU build.
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, gpu
  import jax.experimental.mosaic.gpu as mgpu
  from jax.experimental.mosaic.gpu import utils as mu

  vec = 16 // dtype.itemsize
  chunk = tiles_per_block * TILE_BYTES // dtype.itemsize  # elements a block carries

  def body(ctx, x_ref, row_ref, y_ref, scratch):
    del ctx, scratch
    block = gpu.block_id(gpu.Dimension.x)
    start = arith.muli(block, arith.constant(ir.IndexType.get(), chunk))
    integer = dtype == jnp.dtype(jnp.int32)
    mine = mgpu.FragmentedArray.load_strided(mu.memref_slice(x_ref, mu.ds(start, chunk)),
                                             vec_size=vec, is_signed=True if integer else None)
    if protocol == "lamport":
      load_parts, done = lamport.exchange(row_ref, axis_size, lamport_sum_region(axis_size),
                                          block, mine)
    else:
      load_parts, done = exchange(row_ref, axis_size, SUM_REGION, block, mine)
    parts = load_parts()
    # The parts summed in rank order in float32 (int32: as they are), rounded once: the same
    # bits everywhere.
    widen = (lambda a: a) if integer else (lambda a: a.astype(ir.F32Type.get()))
    total = widen(parts[0])
    for part in parts[1:]:
      total = total + widen(part)
    total = total if integer else total.astype(mine.mlir_dtype)
    total.store_untiled(mu.memref_slice(y_ref, mu.ds(start, chunk)))
    done()

  return as_kernel(body, "workspace_all_reduce", blocks,
                   (jax.ShapeDtypeStruct((n,), dtype),
                    jax.ShapeDtypeStruct((2 * axis_size + 1,), jnp.int32)),
                   jax.ShapeDtypeStruct((n,), dtype))

"""The workspace handshake without flags: each device polls its peers' parts themselves
(TensorRT-LLM's "Lamport" one-shot all-reduce).

jspec.pallas_kernels.peer_exchange hands a part over with a flag: the sender stores the part
into the peer's workspace, orders the stores with a release at system scope (a round trip over
NVLink for the acknowledgements) and then raises a flag that must cross NVLink again before the
peer may read. Here the data is its own flag. Every data slot holds all-ones bytes (the
sentinel) until a peer's part lands in it; the reader polls its slot with volatile loads until
no element holds the sentinel, which is one crossing of NVLink instead of three.

That needs three things:
- No part may hold the sentinel's bit pattern. All ones is a NaN (of any float width), so the
  sender turns such an element into the positive quiet NaN of its width (sums are NaN either
  way). int32 parts, whose words may be all ones, keep the flags.
- A slot must hold the sentinel again before its next use: three phases a slot, a call uses
  phase (its call count mod 3), and a block re-fills the phase its slot used one call before,
  which every reader finished in the previous kernel. A peer is never more than one call ahead
  (it cannot finish a call without our part), so it never writes the phase being re-filled.
- Blocks that read each other's slots (the chunks of one norm row) must agree on the phase
  without reading each other's counters, which move while they run: a row's chunk slots are
  used together (the norm region keeps a set of slots per chunk count), so every chunk's count
  equals the block's own.

The workspace's Lamport regions start filled with the sentinel (PeerWorkspace does this).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jspec.pallas_kernels.peer_exchange import MAX_DEVICES, workspace_pointers

PHASES = 3
# 16-byte vectors a thread polls in one loop (64 registers): enough to overlap the loads'
# latencies, few enough to leave registers for the rest of the kernel.
POLL_BATCH = 16


@dataclasses.dataclass(frozen=True)
class LamportRegion:
  """A part of the workspace: counters[s] (int32, a call count per slot), then data slots
  [PHASES][A sources][slots] of `slot_bytes` each, which start as all-ones bytes."""
  offset: int
  slots: int
  slot_bytes: int

  @property
  def counters_offset(self) -> int:
    return self.offset

  @property
  def data_offset(self) -> int:
    return self.offset + -(-(self.slots * 4) // 4096) * 4096

  def end(self, axis_size: int) -> int:
    return self.data_offset + PHASES * axis_size * self.slots * self.slot_bytes


def row_slots(rows: int, max_chunks: int) -> int:
  """Slots of a norm region that keeps a set per chunk count (1..max_chunks) for `rows` rows."""
  return rows * max_chunks * (max_chunks + 1) // 2


def first_row_slot(rows: int, chunks: int, row):
  """The first slot of `row` for rows of `chunks` chunks (row a Python int or an MLIR index):
  the sets of smaller chunk counts come first, then row r's chunks at r * chunks."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith
  base = rows * (chunks - 1) * chunks // 2
  if isinstance(row, int):
    return base + row * chunks
  index = ir.IndexType.get()
  return arith.addi(arith.constant(index, base), arith.muli(row, arith.constant(index, chunks)))


def exchange(row_ref, axis_size: int, region: LamportRegion, slot, part, *, first_slot=None,
             chunks: int = 1):
  """peer_exchange.exchange's contract without flags: hands `part` (a FragmentedArray of one
  vector of 16 bytes a thread or more, at most `region.slot_bytes`; floats) to every device
  of the group as block `slot` of `region`; with `chunks` > 1 the block is one of the row's blocks
  that own slots first_slot .. first_slot + chunks - 1. Returns (parts, done): `parts(c)` is
  chunk c of every rank in rank order (None: this block's own), polled from this device's
  workspace, and `done()` re-fills the phase before this one and counts the call."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, llvm, scf, vector
  import jax.experimental.mosaic.gpu as mgpu
  from jax.experimental.mosaic.gpu import fragmented_array as fa
  from jax.experimental.mosaic.gpu import utils as mu

  assert axis_size <= MAX_DEVICES
  i8 = ir.IntegerType.get_signless(8)
  i32 = ir.IntegerType.get_signless(32)
  i64 = ir.IntegerType.get_signless(64)
  index = ir.IndexType.get()
  words_ty = ir.VectorType.get((4,), i32)
  dtype = part.mlir_dtype
  width = mu.bitwidth(dtype)
  vec = part.layout.vec_size
  if vec * width != 128 or not isinstance(dtype, ir.FloatType):
    raise ValueError(f"a Lamport part is 16-byte float vectors; got {vec} x {dtype}")
  n_vectors = part.registers.size  # a thread's 16-byte vectors of the part
  first_slot = slot if first_slot is None else first_slot
  base, rank, me = workspace_pointers(row_ref, axis_size)

  def const64(v):
    return arith.constant(i64, v)

  def as64(value):
    return arith.index_cast(i64, value) if value.type == index else arith.extui(i64, value)

  def at(pointer, byte_offset):
    return mu.getelementptr(pointer, [byte_offset], i8)

  slot64, first64, rank64 = as64(slot), as64(first_slot), arith.extui(i64, rank)
  counter = at(me, arith.addi(const64(region.counters_offset),
                              arith.muli(slot64, const64(4))))
  count = llvm.load(i32, counter)
  phase = arith.extui(i64, arith.remui(count, arith.constant(i32, PHASES)))

  def data(owner, phase64, source64, n_slot64):  # the slot [phase][source][slot], a pointer
    n = arith.addi(arith.muli(arith.addi(arith.muli(phase64, const64(axis_size)), source64),
                              const64(region.slots)), n_slot64)
    return at(owner, arith.addi(const64(region.data_offset),
                                arith.muli(n, const64(region.slot_bytes))))

  # 1. No element may look empty: all ones becomes the positive quiet NaN of its width.
  uint = ir.IntegerType.get_signless(width)
  bits = part.bitcast(uint, output_is_signed=False)
  ones = (1 << width) - 1
  quiet_nan = {16: 0x7E00 if str(dtype) == "f16" else 0x7FC0, 32: 0x7FC00000}[width]
  splat = lambda v: mgpu.FragmentedArray.splat(arith.constant(uint, v), part.shape,
                                               part.layout, is_signed=False)
  bits = (bits == splat(ones)).select(splat(quiet_nan), bits)
  sent = bits.bitcast(dtype)
  # 2. The part into [phase][rank][slot] of every workspace (ours too, for the row's other
  #    blocks on this device).
  part_ty = ir.MemRefType.get(part.shape, dtype)
  for s in range(axis_size):
    sent.store_untiled(mu.ptr_as_memref(data(base(s), phase, rank64, slot64), part_ty))

  thread = mu.thread_idx()
  thread64 = as64(arith.remui(thread, arith.constant(thread.type, 128)))

  def poll_together(slot_ptrs):
    """This thread's vectors of every slot in `slot_ptrs`, once none holds the sentinel: each
    loop trip loads a batch of them at once (their latencies overlap) and goes round again
    while any is empty."""
    addresses = [at(p, arith.muli(arith.addi(thread64, const64(i * 128)), const64(16)))
                 for p in slot_ptrs for i in range(n_vectors)]
    words = []
    for batch in range(0, len(addresses), POLL_BATCH):
      group = addresses[batch:batch + POLL_BATCH]
      types = [words_ty] * len(group)
      loop = scf.WhileOp(types, [llvm.mlir_undef(words_ty)] * len(group))
      before = loop.before.blocks.append(*types)
      with ir.InsertionPoint.at_block_begin(before):
        loaded = [llvm.load(words_ty, a, alignment=16, volatile_=True) for a in group]
        empty = None
        for w in loaded:
          hit = _holds_sentinel(w, width)
          empty = hit if empty is None else arith.ori(empty, hit)
        scf.condition(empty, loaded)
      after = loop.after.blocks.append(*types)
      with ir.InsertionPoint.at_block_begin(after):
        scf.yield_(after.arguments)
      words.extend(loop.results)
    registers = [vector.bitcast(ir.VectorType.get((vec,), dtype), w) for w in words]
    return [fa.FragmentedArray(
        _registers=np.array(registers[k:k + n_vectors], dtype=object).reshape(
            part.registers.shape), _layout=part.layout, _is_signed=part.is_signed)
            for k in range(0, len(registers), n_vectors)]

  polled = {}

  def parts(chunk=None):
    if not polled:  # every slot the caller may ask for, in one poll: own chunk, then each
      keys = [None] + (list(range(chunks)) if chunks > 1 else [])
      n_slots = [slot64 if k is None else arith.addi(first64, const64(k)) for k in keys]
      arrays = poll_together([data(me, phase, const64(s), n) for n in n_slots
                              for s in range(axis_size)])
      for j, k in enumerate(keys):
        polled[k] = arrays[j * axis_size:(j + 1) * axis_size]
    return polled[chunk if chunks > 1 else None]

  def done():
    # Every thread has read `count` (and polled) before it moves: the barrier.
    mu.warpgroup_barrier()
    # The phase one call back: every block that read it did so in an earlier kernel.
    previous = arith.extui(i64, arith.remui(arith.addi(count, arith.constant(i32, PHASES - 1)),
                                            arith.constant(i32, PHASES)))
    full = arith.constant(words_ty, ir.DenseElementsAttr.get_splat(
        words_ty, ir.IntegerAttr.get(i32, -1)))
    for s in range(axis_size):
      for i in range(region.slot_bytes // (128 * 16)):
        offset = arith.muli(arith.addi(thread64, const64(i * 128)), const64(16))
        llvm.store(full, at(data(me, previous, const64(s), slot64), offset), alignment=16)
    with mu.single_thread(mu.ThreadSubset.WARPGROUP):
      llvm.store(arith.addi(count, arith.constant(i32, 1)), counter)
  return parts, done


def _holds_sentinel(words, width: int):
  """Whether any element of a vector<4 x i32> is all ones (16- or 32-bit elements)."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, vector
  i32 = ir.IntegerType.get_signless(32)
  minus_one = arith.constant(i32, -1)
  masks = [0] if width == 32 else [0xFFFF0000 - (1 << 32), 0x0000FFFF]
  empty = None
  for k in range(4):
    word = vector.extract(words, dynamic_position=[], static_position=[k])
    for mask in masks:
      filled = arith.ori(word, arith.constant(i32, mask)) if mask else word
      hit = arith.cmpi(arith.CmpIPredicate.eq, filled, minus_one)
      empty = hit if empty is None else arith.ori(empty, hit)
  return empty

"""The workspace's regions, the handshake its kernels share and their launch: inside a Mosaic GPU
kernel, one block's part handed to every device of its group through the PeerWorkspace
(jspec.pallas_kernels.workspace_all_reduce says how the workspace, its regions, flags and
parities work). Used by the plain all-reduce and by the all-reduce + residual add + RMSNorm
(jspec.pallas_kernels.workspace_norm).
"""

from __future__ import annotations

import dataclasses

import jax

# Devices a group may have (the flags' layout).
MAX_DEVICES = 8


@dataclasses.dataclass(frozen=True)
class Region:
  """A part of the workspace with flags, counters and data slots of its own: slot s of a call
  (a kernel block) uses flags[s][source] (int32), counters[s] (int32) and the data slots
  [2 parities][A sources][s] of `slot_bytes` each. Kernels that share a region share its
  slots' call parity, so each kind of kernel has its own."""
  offset: int
  slots: int
  slot_bytes: int

  @property
  def flags_offset(self) -> int:
    return self.offset

  @property
  def counters_offset(self) -> int:
    return self.offset + self.slots * MAX_DEVICES * 4

  @property
  def data_offset(self) -> int:
    return self.offset + -(-(self.slots * (MAX_DEVICES + 1) * 4) // 4096) * 4096

  def end(self, axis_size: int) -> int:
    return self.data_offset + 2 * axis_size * self.slots * self.slot_bytes


def exchange(row_ref, axis_size: int, region: Region, slot, part, *, first_slot=None,
             chunks: int = 1):
  """Inside a Mosaic GPU kernel of one warpgroup a block: hands `part` (a FragmentedArray of at
  most `region.slot_bytes`) to every device of the group through the workspaces whose addresses
  `row_ref` holds (a PeerWorkspace row), as the block `slot` of `region`.

  With `chunks` > 1 the block is one of `chunks` blocks that split one row: they own the slots
  first_slot .. first_slot + chunks - 1 (`slot` among them), and each waits for all of them, so
  that every block of the row can read the whole row (a norm needs it).

  Returns (parts, done): `parts(c)` loads chunk c's part of every rank in rank order from this
  device's workspace (c a static chunk number, or None: this block's own), and `done()` moves
  this block's slot to its other parity for the next call (after the parts are read)."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, llvm, scf
  import jax.experimental.mosaic.gpu as mgpu
  from jax.experimental.mosaic.gpu import utils as mu

  i8 = ir.IntegerType.get_signless(8)
  i32 = ir.IntegerType.get_signless(32)
  i64 = ir.IntegerType.get_signless(64)
  index = ir.IndexType.get()
  vec = part.layout.vec_size
  part_ty = ir.MemRefType.get(part.shape, part.mlir_dtype)
  first_slot = slot if first_slot is None else first_slot

  def const64(v):
    return arith.constant(i64, v)

  def at(pointer, byte_offset):  # pointer + byte_offset (i64)
    return mu.getelementptr(pointer, [byte_offset], i8)

  def as64(value):
    return arith.index_cast(i64, value) if value.type == index else arith.extui(i64, value)

  base, rank, me = workspace_pointers(row_ref, axis_size)
  rank64 = arith.extui(i64, rank)
  slot64, first64 = as64(slot), as64(first_slot)

  def counter_ptr(n_slot64):
    return at(me, arith.addi(const64(region.counters_offset), arith.muli(n_slot64, const64(4))))

  def parity(n_slot64):  # the call parity of a slot, read before any flag is raised
    return arith.extui(i64, arith.andi(llvm.load(i32, counter_ptr(n_slot64)),
                                       arith.constant(i32, 1)))

  # Every chunk's parity, read before this block raises its flags: a sibling block moves its
  # slot's counter only after it has seen them, so none has moved yet.
  own_count = llvm.load(i32, counter_ptr(slot64))
  own_parity = arith.extui(i64, arith.andi(own_count, arith.constant(i32, 1)))
  parities = [parity(arith.addi(first64, const64(c))) for c in range(chunks)]

  def data(owner, parity64, source64, n_slot64):  # data slot [parity][source][slot]
    n = arith.addi(arith.muli(arith.addi(arith.muli(parity64, const64(axis_size)), source64),
                              const64(region.slots)), n_slot64)
    offset = arith.addi(const64(region.data_offset), arith.muli(n, const64(region.slot_bytes)))
    return mu.ptr_as_memref(at(owner, offset), part_ty)

  def flag(owner, n_slot64, source64):  # flags[slot][source] of a workspace
    n_flag = arith.addi(arith.muli(n_slot64, const64(MAX_DEVICES)), source64)
    return at(owner, arith.addi(const64(region.flags_offset), arith.muli(n_flag, const64(4))))

  # Thread k of the warpgroup works flag k in "warp-major" order (thread 32 (k % 4) + k // 4),
  # so that the first flags' signals and waits run in different warps at once.
  thread = arith.index_cast(i32, mu.thread_idx()) if mu.thread_idx().type == index \
      else mu.thread_idx()
  lane = arith.remui(thread, arith.constant(i32, 128))
  k = arith.addi(arith.muli(arith.remui(lane, arith.constant(i32, 32)), arith.constant(i32, 4)),
                 arith.divui(lane, arith.constant(i32, 32)))

  def kth(k_static):
    return arith.cmpi(arith.CmpIPredicate.eq, k, arith.constant(i32, k_static))

  # 1. The part into data slot [parity][rank][slot] of every workspace (ours too).
  for s in range(axis_size):
    part.store_untiled(data(base(s), own_parity, rank64, slot64))
  # 2. All threads past their stores (the barrier), then thread k raises our flag in rank k's
  #    workspace with release semantics at system scope, which is cumulative over the stores
  #    the barrier ordered before it: a peer that sees the flag sees the part. (vLLM's custom
  #    all-reduce orders its stores so. A system fence in every thread as well cost 2.7 µs a
  #    call at 8 KB on 2 H100s: BENCHMARKS.md.) Each of the row's `chunks` blocks consumes one.
  mu.warpgroup_barrier()
  for s in range(axis_size):
    mu.SemaphoreRef(flag(base(s), slot64, rank64)).signal(chunks, predicate=kth(s))
  # 3. Every (chunk, rank) flag in our workspace, thread k waiting for flag k (consume one:
  #    acquire), then the barrier that orders the loads after every wait.
  n_flags = chunks * axis_size
  waiting = arith.cmpi(arith.CmpIPredicate.ult, k, arith.constant(i32, n_flags))
  if_op = scf.IfOp(waiting)
  with ir.InsertionPoint(if_op.then_block):
    k64 = arith.extui(i64, k)
    which = arith.addi(first64, arith.divui(k64, const64(axis_size)))
    _consume_one(flag(me, which, arith.remui(k64, const64(axis_size))))
    scf.YieldOp([])
  mu.warpgroup_barrier()

  def parts(chunk=None):
    where = (own_parity, slot64) if chunk is None else (
        parities[chunk], arith.addi(first64, const64(chunk)))
    return [mgpu.FragmentedArray.load_strided(data(me, where[0], const64(s), where[1]),
                                              vec_size=vec, is_signed=part.is_signed)
            for s in range(axis_size)]

  def done():  # this slot's next call uses the other parity's data slots
    with mu.single_thread(mu.ThreadSubset.WARPGROUP):
      llvm.store(arith.addi(own_count, arith.constant(i32, 1)), counter_ptr(slot64))
  return parts, done


def workspace_pointers(row_ref, axis_size: int):
  """From a PeerWorkspace row inside a kernel: (base(s), the workspace of rank s (static) as a
  pointer; this device's rank (i32); this device's workspace as a pointer)."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, llvm, memref
  i32 = ir.IntegerType.get_signless(32)
  i64 = ir.IntegerType.get_signless(64)
  index = ir.IndexType.get()

  def word(k):
    return memref.load(row_ref, [arith.constant(index, k)])

  def base(s):
    low = arith.extui(i64, word(2 * s))
    high = arith.extui(i64, word(2 * s + 1))
    return llvm.inttoptr(llvm.PointerType.get(),
                         arith.ori(arith.shli(high, arith.constant(i64, 32)), low))

  rank = word(2 * axis_size)
  me = base(0)
  for s in range(1, axis_size):
    me = arith.select(arith.cmpi(arith.CmpIPredicate.eq, rank, arith.constant(i32, s)),
                      base(s), me)
  return base, rank, me


def _consume_one(flag_ptr):
  """Spin until the counting semaphore at `flag_ptr` is positive, take one (a relaxed
  compare-and-swap at system scope), then an acquire fence: the calling thread alone
  (SemaphoreRef.wait's loop, without its single-thread guard and barrier)."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, scf
  from jax.experimental.mosaic.gpu import utils as mu
  i32 = ir.IntegerType.get_signless(32)
  one = arith.constant(i32, 1)
  loop = scf.WhileOp([i32], [one])
  before = loop.before.blocks.append(i32)
  with ir.InsertionPoint.at_block_begin(before):
    [expected] = before.arguments
    seen = mu.inline_ptx("atom.relaxed.sys.global.cas.b32 $0, [$1], $2, $3;", flag_ptr,
                         expected, arith.subi(expected, one), result_types=i32,
                         has_side_effects=True)
    scf.condition(arith.cmpi(arith.CmpIPredicate.ne, seen, expected),
                  [arith.maxui(seen, one)])
  after = loop.after.blocks.append(i32)
  with ir.InsertionPoint.at_block_begin(after):
    scf.yield_(after.arguments)
  mu.inline_ptx("fence.acquire.sys;", has_side_effects=True)


def as_kernel(body, name: str, grid: int, in_shape, out_shape, scratch=()):
  """`body` as a Mosaic GPU kernel of `grid` blocks of one warpgroup, for sm90."""
  from jax._src.interpreters import mlir as jax_mlir
  from jax._src.lib.mlir import ir
  from jax.experimental import mosaic as _  # noqa: F401  (registers the dialects)
  import jax.experimental.mosaic.gpu as mgpu
  with jax_mlir.make_ir_context() as context, ir.Location.unknown():
    mgpu.dialect.register_dialect(context)
    return mgpu.as_gpu_kernel(body, grid=(grid, 1, 1), block=(128, 1, 1), in_shape=in_shape,
                              out_shape=out_shape, smem_scratch_shape=scratch,
                              module_name=name, kernel_name=name)

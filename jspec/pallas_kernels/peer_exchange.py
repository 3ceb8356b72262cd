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


def exchange(row_ref, axis_size: int, region: Region, slot, part):
  """Inside a Mosaic GPU kernel of one warpgroup a block: hands `part` (a FragmentedArray of at
  most `region.slot_bytes`) to every device of the group through the workspaces whose addresses
  `row_ref` holds (a PeerWorkspace row), as the block `slot` of `region`. Returns (parts, done):
  every rank's part in rank order, loaded from this device's workspace, and `done()`, which
  moves the slot to its other parity for the next call (after the parts are read)."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, llvm, memref
  import jax.experimental.mosaic.gpu as mgpu
  from jax.experimental.mosaic.gpu import utils as mu

  i8 = ir.IntegerType.get_signless(8)
  i32 = ir.IntegerType.get_signless(32)
  i64 = ir.IntegerType.get_signless(64)
  index = ir.IndexType.get()
  ptr = llvm.PointerType.get()
  vec = part.layout.vec_size
  part_ty = ir.MemRefType.get(part.shape, part.mlir_dtype)

  def const64(v):
    return arith.constant(i64, v)

  def word(k):
    return memref.load(row_ref, [arith.constant(index, k)])

  def base(s):  # the workspace of rank s (static), as a pointer
    low = arith.extui(i64, word(2 * s))
    high = arith.extui(i64, word(2 * s + 1))
    return llvm.inttoptr(ptr, arith.ori(arith.shli(high, const64(32)), low))

  def at(pointer, byte_offset):  # pointer + byte_offset (i64)
    return mu.getelementptr(pointer, [byte_offset], i8)

  rank = word(2 * axis_size)
  rank64 = arith.extui(i64, rank)
  slot64 = arith.index_cast(i64, slot)
  me = base(0)
  for s in range(1, axis_size):
    me = arith.select(arith.cmpi(arith.CmpIPredicate.eq, rank, arith.constant(i32, s)),
                      base(s), me)
  counter_ptr = at(me, arith.addi(const64(region.counters_offset),
                                  arith.muli(slot64, const64(4))))
  count = llvm.load(i32, counter_ptr)
  parity64 = arith.extui(i64, arith.andi(count, arith.constant(i32, 1)))

  def data(owner, source64):  # data slot [parity][source][slot] of a workspace
    n_slot = arith.addi(arith.muli(arith.addi(arith.muli(parity64, const64(axis_size)),
                                              source64), const64(region.slots)), slot64)
    offset = arith.addi(const64(region.data_offset), arith.muli(n_slot,
                                                                const64(region.slot_bytes)))
    return mu.ptr_as_memref(at(owner, offset), part_ty)

  def flag(owner, source64):  # flags[slot][source] of a workspace
    n_flag = arith.addi(arith.muli(slot64, const64(MAX_DEVICES)), source64)
    return at(owner, arith.addi(const64(region.flags_offset), arith.muli(n_flag, const64(4))))

  # 1. The part into data slot [parity][rank][slot] of every workspace (ours too).
  for s in range(axis_size):
    part.store_untiled(data(base(s), rank64))
  # 2. All threads past their stores (the barrier), then one thread raises our flag in every
  #    workspace with release semantics at system scope, which is cumulative over the stores
  #    the barrier ordered before it: a peer that sees the flag sees the part. (vLLM's custom
  #    all-reduce orders its stores so. A system fence in every thread as well cost 2.7 µs a
  #    call at 8 KB on 2 H100s: BENCHMARKS.md.)
  mu.warpgroup_barrier()
  for s in range(axis_size):
    mu.SemaphoreRef(flag(base(s), rank64)).signal(1)
  # 3. Every rank's flag in our workspace: wait, consume (acquire, then the barrier).
  for s in range(axis_size):
    mu.SemaphoreRef(flag(me, const64(s))).wait(1)
  parts = [mgpu.FragmentedArray.load_strided(data(me, const64(s)), vec_size=vec,
                                             is_signed=part.is_signed)
           for s in range(axis_size)]

  def done():  # this slot's next call uses the other parity's data slots
    with mu.single_thread(mu.ThreadSubset.WARPGROUP):
      llvm.store(arith.addi(count, arith.constant(i32, 1)), counter_ptr)
  return parts, done


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

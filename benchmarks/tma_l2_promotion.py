"""Runs a benchmark with every Mosaic GPU TMA descriptor built with an L2 promotion, to test
whether the few-row FP8 kernel's stream (3.6-3.9 TB/s on an H200, where XLA's bf16 GEMMs
stream 4.3-4.5) is held by how its loads reach DRAM:

    python3 benchmarks/tma_l2_promotion.py 256 benchmarks/fp8_kernel_routes.py --rows 1 ...
    python3 benchmarks/tma_l2_promotion.py none benchmarks/fp8_kernel_routes.py --rows 1 ...

Mosaic GPU's runtime encodes each descriptor with CU_TENSOR_MAP_L2_PROMOTION_NONE (jaxlib's
mosaic/gpu/runtime.cc); CUTLASS and DeepGEMM load through descriptors with 256-byte promotion,
so an L2 miss fetches 256 bytes where the box's 256-byte rows are read. There is no option
for it, so this sets the field after Mosaic's own encoding, in the host code that builds the
descriptor: the field's bits are found on this machine by encoding one descriptor through
libcuda both ways (ctypes) and comparing the bytes, not taken from any documented layout. An
experiment, outside the library: every Mosaic GPU kernel the benchmark compiles gets it.
On an H200 neither 128- nor 256-byte promotion moved the kernel or the Qwen3-8B FP8 step
(BENCHMARKS.md, "The TMA descriptors' L2 promotion ...").
"""

from __future__ import annotations

import atexit
import ctypes
import runpy
import sys

PROMOTIONS = {"none": 0, "64": 1, "128": 2, "256": 3}  # CUtensorMapL2promotion
DESCRIPTOR_BYTES = 128


def encode(cuda, address: int, promotion: int) -> bytes:
  """A 2-D uint8 [256, 256] descriptor (box 128 x 128, 128-byte swizzle) at `address`."""
  storage = ctypes.create_string_buffer(DESCRIPTOR_BYTES + 64)
  start = -ctypes.addressof(storage) % 64  # CUtensorMap is 64-byte aligned
  pointer = ctypes.c_void_p(ctypes.addressof(storage) + start)
  u64, u32 = ctypes.c_uint64, ctypes.c_uint32
  result = cuda.cuTensorMapEncodeTiled(
      pointer, ctypes.c_int(0), u32(2), ctypes.c_void_p(address),
      (u64 * 2)(256, 256), (u64 * 1)(256), (u32 * 2)(128, 128), (u32 * 2)(1, 1),
      ctypes.c_int(0), ctypes.c_int(3), ctypes.c_int(promotion), ctypes.c_int(0))
  if result:
    raise RuntimeError(f"cuTensorMapEncodeTiled returned {result}")
  return bytes(storage.raw[start:start + DESCRIPTOR_BYTES])


def field_bits(plain: bytes, again: bytes, promoted: bytes) -> list[tuple[int, int]]:
  """(byte, OR mask) pairs that turn `plain` (a descriptor encoded without promotion, twice)
  into `promoted` (the same with it): refused where the encoding is not deterministic or the
  field's bits are not all zero without promotion (an OR could not set them)."""
  if plain != again:
    raise RuntimeError("the descriptor's encoding is not deterministic")
  diff = [(i, a ^ b) for i, (a, b) in enumerate(zip(plain, promoted)) if a != b]
  if not diff or not all(plain[i] & mask == 0 for i, mask in diff):
    raise RuntimeError(f"no promotion field that an OR sets: {diff}")
  return diff


def promotion_bits(promotion: int) -> list[tuple[int, int]]:
  """field_bits of descriptors encoded by this machine's libcuda."""
  import jax.numpy as jnp
  cuda = ctypes.CDLL("libcuda.so.1")
  buffer = jnp.zeros((256, 256), jnp.uint8)
  address = buffer.unsafe_buffer_pointer()
  return field_bits(encode(cuda, address, 0), encode(cuda, address, 0),
                    encode(cuda, address, promotion))


def install(bits: list[tuple[int, int]]):
  """Wraps launch_context's func.call: after each mosaic_gpu_init_tma_desc, ORs `bits` into
  the descriptor's host bytes. Returns the wrapper's undoing, whose `patched` counts the
  descriptor builds given the bits."""
  from jax.experimental.mosaic.gpu import launch_context
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import arith, llvm

  real = launch_context.func
  patched = [0]

  class Func:
    def __getattr__(self, name):
      return getattr(real, name)

    @staticmethod
    def call(results, callee, args, *rest, **kwargs):
      out = real.call(results, callee, args, *rest, **kwargs)
      if callee == "mosaic_gpu_init_tma_desc":
        i8 = ir.IntegerType.get_signless(8)
        for byte, mask in bits:
          address = llvm.getelementptr(llvm.PointerType.get(), args[0], [], [byte], i8,
                                       llvm.GEPNoWrapFlags.none)
          value = llvm.load(i8, address)
          signed = mask - 256 if mask >= 128 else mask  # an i8 constant's value
          llvm.store(arith.ori(value, arith.constant(i8, signed)), address)
        patched[0] += 1
      return out

  launch_context.func = Func()

  def undo():
    launch_context.func = real
  undo.patched = patched  # how many descriptor builds were given the bits
  return undo


def main():
  if len(sys.argv) < 3 or sys.argv[1] not in PROMOTIONS:
    raise SystemExit(f"usage: {sys.argv[0]} {{{','.join(PROMOTIONS)}}} script.py [args]")
  promotion = PROMOTIONS[sys.argv[1]]
  if promotion:
    bits = promotion_bits(promotion)
    print(f"L2 promotion {sys.argv[1]}: descriptor bytes {[(i, hex(m)) for i, m in bits]}",
          flush=True)
    undo = install(bits)
    atexit.register(lambda: print(f"L2 promotion set in {undo.patched[0]} descriptor builds",
                                  flush=True))
  else:
    print("L2 promotion none (Mosaic GPU's own)", flush=True)
  script = sys.argv[2]
  sys.argv = sys.argv[2:]
  runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
  main()

"""GQA attention of a decode or verify step over a short KV cache, in one Pallas (Triton)
kernel.

Why: at a short context XLA runs a decode step's attention as three kernels a layer (the
scores' batched product, the softmax, the product with the values) over the whole cache
bucket: 8.5 µs a layer for Qwen3-8B at batch 1 and 13.7 µs at batch 8 (context 512, an H100;
BENCHMARKS.md, "Short-context decode attention in one kernel"). The flash-decoding path
(jspec.models.decode_attention) splits long caches over many programs and merges them, which
pays off at long contexts but adds kernels at short ones. Here one program per (sequence, KV
head) reads that head's valid slots once, in blocks, with an online softmax, for all its query
rows (the group's heads x the step's tokens): one kernel, nothing to merge.

Where those programs are too few to fill the GPU (a batch of 1 to 8 over 4 to 8 KV heads a
shard: 4 to 64 programs on 132 SMs), each one's slots are split over `splits` programs, which
write their normalised partial outputs and log-sum-exps, merged by
jspec.pallas_kernels.mla_merge's one-launch kernel. Why: a program's loop over its blocks is
latency-bound (a block's loads, two dots and the softmax in sequence), so 5 blocks of 128
slots took about as long over 8 programs as over 64 (7.1 against 9.6 us, an H100), and a
tp = 2 shard, with half the programs, gained nothing from its half of the work.

Query rows of one KV head are contiguous in `q_BRH` ([B, K x T x G, H], row t x G + g is head
g of the group at token t): a decode step's q [B, 1, N, H] is that layout as it is. A row at
token t sees slots 0 .. start + t (the step's own keys are in the cache already).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jspec.pallas_kernels import mla_merge, platform
from jspec.pallas_kernels.fp8_block_kernel import BLOCK, E4M3
from jspec.pallas_kernels import fp8_gemm
from jspec.pallas_kernels.fp8_gemm import act_lanes_size
from jspec.pallas_kernels.quantize_rows import e4m3_groups
from jspec.pallas_kernels.residual_norm import store_scale_lanes

# The most slots a step may attend (its kv_window) for the layers to take the kernel: one
# program reads a (sequence, KV head)'s slots alone, so a longer window would leave most SMs
# idle (the flash-decoding path splits it).
MAX_SLOTS = 1024
MIN_ROWS = 16  # Triton's dot takes at least 16 rows
MAX_ROWS = 64  # query rows per KV head one program holds (as the flash-decoding path's)
MASKED = -1e30  # a score no slot keeps (finite: a row with no visible slot stays finite)


def fits_heads(head_dim: int) -> bool:
  """Whether a head is one Triton block."""
  return platform.triton_block(head_dim)


# The split, from the kernel alone on an H200 (Qwen3-8B's heads, 576 of 640 slots seen;
# BENCHMARKS.md, "Short-context attention split over programs"): 4 and 8 (sequence, KV head)
# pairs took 7.7-8.0 us unsplit and 3.9-4.7 split 10 ways in 64-slot blocks (4.6-5.1 split 5
# ways in 128; the merge's 1.3-1.6 us included); 32 pairs 8.7 against 7.4 split 8 ways; 64
# pairs gained nothing (10.6-14.3 against 9.3 us), nor did 2 blocks split in 2 (4.4-4.5
# against 4.2-4.3 us). So: 64-slot
# blocks, about two programs per SM, where pairs are at most a quarter of the SMs
# (SPLIT_MAX_PAIRS: another bound) and the window holds at least SPLIT_MIN_SLOTS; at most
# MAX_SPLITS (SPLITS False: never). 64 pairs (Qwen3-8B at batch 8, context 624) split in two
# (SPLIT_MAX_PAIRS=64, MAX_SPLITS=2): the FP8 step 1.2% / 1.7% shorter in two processes, bf16's
# unchanged, in four 0.2% shorter; inside one process's spread, so not the default.
SPLITS = True
SPLIT_BLOCK_SLOTS = 64
SPLIT_MIN_SLOTS = 512
MAX_SPLITS = 16
SPLIT_MAX_PAIRS: int | None = None


def choose_splits(batch: int, kv_heads: int, slots: int, num_sms: int) -> tuple[int, int | None]:
  """(splits, block_slots) for a cache of `slots` read by batch x kv_heads pairs: (1, None)
  where not split (one program per pair, `choose_block_slots`' blocks), else SPLIT_BLOCK_SLOTS
  and as many splits as bring the programs to twice `num_sms`, at most one per block."""
  pairs = batch * kv_heads
  most_pairs = num_sms // 4 if SPLIT_MAX_PAIRS is None else SPLIT_MAX_PAIRS
  if (not SPLITS or pairs > most_pairs or slots < SPLIT_MIN_SLOTS
      or slots % SPLIT_BLOCK_SLOTS):
    return 1, None
  # at least 8 where pairs <= num_sms / 4 (and slots >= 512 = 8 blocks); fewer past that
  splits = min(2 * num_sms // pairs, slots // SPLIT_BLOCK_SLOTS, MAX_SPLITS)
  return (splits, SPLIT_BLOCK_SLOTS) if splits > 1 else (1, None)


def fits_kernel(slots: int, head_dim: int, rows_per_kv_head: int) -> bool:
  """Whether the kernel takes a cache of `slots` (whole blocks of 16) and a step's query rows
  per KV head (at most MAX_ROWS). Which caches are short enough to take it (MAX_SLOTS of them
  attended) is the caller's choice: the kernel reads only the slots each row sees."""
  return slots % MIN_ROWS == 0 and fits_heads(head_dim) and rows_per_kv_head <= MAX_ROWS


# Slots per loop step, Triton's warps and loads in flight: the fastest of 14 tilings at
# Qwen3-8B's heads over 640 slots on an H100 (7.1 µs at batch 1, 9.6 at batch 8, against
# 12.6 / 15.1 with 64-slot steps two loads deep; four deep no faster, five do not fit the
# shared memory; BENCHMARKS.md, "Short-context decode attention in one kernel").
BLOCK_SLOTS = 128
NUM_WARPS = 4
NUM_STAGES = 3
# Shared memory for the key and value blocks in flight (NUM_STAGES - 1 of each): that tiling's
# 128 KiB. Wider heads or float32 caches take shorter blocks: 128 slots of 128-wide float32
# heads asked for 272 KiB, past Hopper's 227, and Qwen3.5's 256-wide bf16 heads weigh as much.
STAGED_BYTES = 128 << 10


def choose_block_slots(slots: int, head_dim: int, itemsize: int) -> int:
  """Slots per loop step: the most of BLOCK_SLOTS, 64, 32, 16 that divides the cache and whose
  key and value blocks, NUM_STAGES - 1 deep, fit STAGED_BYTES (16 always: a block of 16 rows
  of a 256-wide float32 head is 16 KiB)."""
  def staged(b):
    return 2 * (NUM_STAGES - 1) * b * head_dim * itemsize
  return next((b for b in (BLOCK_SLOTS, 64, 32) if slots % b == 0 and staged(b) <= STAGED_BYTES),
              MIN_ROWS)


def _token_rows(token_R, head_R, first_head, tokens: int, heads: int, head_dim: int):
  """The rows of [B, T x N, H] (token by token) that a KV head's rows t x G + g are (token
  token_R's head head_R, the first of them first_head; a padding row's token past T), as an
  index after the sequence's: a slice for one token (they are contiguous), else arrays
  (interpret mode indexes by arrays only where no index is a slice)."""
  if tokens == 1:
    return pl.ds(first_head, head_R.shape[0]), slice(None)
  return (token_R * heads + head_R)[:, None], jnp.arange(head_dim)[None, :]


def _kernel(start_ref, q_ref, k_ref, v_ref, *out_refs, rows: int, block_rows: int,
            group: int, block_slots: int, slots: int, scale: float, copies: int, splits: int,
            q_token_major: bool, out_token_major: bool, interpret: bool):
  b, head = pl.program_id(0), pl.program_id(1)
  row_ids = jnp.arange(block_rows)
  row_mask = row_ids < rows
  q_rows = pl.ds(head * rows, block_rows)
  tokens, head_dim = rows // group, q_ref.shape[2]
  heads = q_ref.shape[1] // tokens
  token_R, head_R = row_ids // group, head * group + row_ids % group
  token_rows = _token_rows(token_R, head_R, head * group, tokens, heads, head_dim)
  q = pltriton.load(q_ref.at[(b, *token_rows) if q_token_major else (b, q_rows, slice(None))],
                    mask=row_mask[:, None], other=0.0)
  start = start_ref[b]
  position = start + row_ids // group  # the last slot each row sees
  # Blocks up to the last row's slot, within the cache (an idle sequence's position may lie
  # anywhere: its rows are dropped by the caller, but no read may leave the cache).
  blocks = jnp.clip((start + (rows - 1) // group) // block_slots + 1, 0, slots // block_slots)
  first, last = 0, blocks
  if splits > 1:  # this program's share of the blocks, the shares as even as they divide
    per = (blocks + splits - 1) // splits
    first = pl.program_id(2) * per
    last = jnp.minimum(blocks, first + per)

  def body(j, carry):
    acc, top, total = carry
    slots = pl.ds(j * block_slots, block_slots)
    keys = k_ref[b, head, slots, :]
    scores = pltriton.dot(q, keys, trans_b=True) * scale
    slot_ids = j * block_slots + jnp.arange(block_slots)
    scores = jnp.where(slot_ids[None, :] <= position[:, None], scores, MASKED)
    new_top = jnp.maximum(top, scores.max(axis=-1))
    # A row that sees none of a split's slots (a verify window's earlier rows, in a split past
    # their last slot) sums junk weights of 1 over MASKED scores here; its log-sum-exp is then
    # MASKED + log(count), which the merge weighs exp(-1e30) = 0.
    probs = jnp.exp(scores - new_top[:, None])
    correction = jnp.exp(top - new_top)
    values = v_ref[b, head, slots, :]
    acc = acc * correction[:, None] + pltriton.dot(probs.astype(values.dtype), values)
    return acc, new_top, total * correction + probs.sum(axis=-1)

  init = (jnp.zeros((block_rows, head_dim), jnp.float32),
          jnp.full((block_rows,), MASKED, jnp.float32), jnp.zeros((block_rows,), jnp.float32))
  acc, top, total = lax.fori_loop(first, last, body, init)
  out = acc / jnp.maximum(total, 1e-30)[:, None]  # no slot seen: 0
  if splits > 1:
    parts_ref, lse_ref = out_refs
    split = pl.program_id(2)
    pltriton.store(parts_ref.at[b, split, q_rows, :], out, mask=row_mask[:, None])
    lse = jnp.where(total > 0, top + jnp.log(jnp.maximum(total, 1e-30)), -jnp.inf)
    pltriton.store(lse_ref.at[b, split, q_rows], lse, mask=row_mask)
    return
  o_ref, *quantized = out_refs
  out = out.astype(o_ref.dtype)
  batch = o_ref.shape[0] // copies
  for c in range(copies):
    pltriton.store(o_ref.at[(c * batch + b, *token_rows) if out_token_major
                            else (c * batch + b, q_rows, slice(None))],
                   out, mask=row_mask[:, None])
  if quantized:
    _store_e4m3(out, token_R, head_R, row_mask, b, token_rows, *quantized, interpret=interpret)


def _store_e4m3(out_RH, token_R, head_R, row_mask, b, token_rows, x8_ref, lanes_ref, *,
                interpret: bool):
  """KV head `head`'s rows of sequence b (row t x G + g: token t's head g of the group) in
  e4m3 into x8_ref [B, T x N, H] token by token, as o_proj reads them (each row one 128-wide
  head, scaled as residual_norm.store_e4m3 scales a group), and their scales into lanes_ref
  [N, L] at lane b x T + t."""
  tokens = x8_ref.shape[1] // lanes_ref.shape[0]
  x8, scale_R = e4m3_groups(out_RH.astype(jnp.float32), interpret)
  pltriton.store(x8_ref.at[(b, *token_rows)], x8, mask=row_mask[:, None])
  if tokens == 1:  # a decode step: the rows contiguous, one lane
    groups, lane_R = token_rows[0], b
  else:
    groups, lane_R = head_R, b * tokens + token_R
  store_scale_lanes(lanes_ref, groups, scale_R, lane_R, x8_ref.shape[0] * tokens,
                    real_G=row_mask)


@functools.partial(jax.jit, static_argnames=("group", "scale", "copies", "splits", "block_slots",
                                             "num_warps", "num_stages", "interpret", "quantize",
                                             "token_major"))
def short_attention(q_BRH: jax.Array, keys_BKSH: jax.Array, values_BKSH: jax.Array,
                    start_B: jax.Array, *, group: int, scale: float, copies: int = 1,
                    splits: int | None = None, block_slots: int | None = None,
                    num_warps: int | None = None, num_stages: int | None = None,
                    interpret: bool | None = None, quantize: bool = False,
                    token_major: bool = False):
  """[B, K x T x G, H]: each query row's softmax(q k^T * scale) v over the slots it sees
  (0 .. start + t for token t), in q's dtype. q_BRH as the module docstring lays it out;
  caches [B, K, S, H]; start_B: each sequence's first position in the step.

  token_major: q and the output token by token instead, [B, T x N, H] (N = K x G heads in
  order: a step's q [B, T, N, H] as it is, and the output as o_proj reads it), the kernel
  reading and writing each token's rows where they lie: no transposes around a verify
  window's call (for one token the two layouts are one).

  `copies` > 1: [copies x B, K x T x G, H], the output written that many times over (copy c
  at rows c x B ..). Why: a batch-1 tp step's one row goes to o_proj's K-slice partials as two
  equal rows (tensor_parallel.k_slice_partials), and a second store here costs less than the
  kernel that would copy it.

  `splits`: programs each (sequence, KV head)'s slots are split over, merged after;
  `block_slots`: slots per loop step. Both None: `choose_splits` for this GPU (never split off
  a GPU); splits None alone: 1; block_slots None alone: `choose_block_slots`. `num_warps`,
  `num_stages`: Triton's, NUM_WARPS and NUM_STAGES where None (the blocks' shared-memory
  budget assumes NUM_STAGES: deeper pipelines are for benchmarks' given blocks).

  quantize (128-wide heads, one copy, at most fp8_gemm.MAX_ROWS tokens B x T): (the output
  token by token [B, T x N, H] whether or not q is, the same
  values in e4m3 [B x T, N x H], each head scaled as fp8_gemm.quantize_activations scales a
  128-group, and their scales in the FP8 kernel's lanes, fp8_gemm.act_lanes): o_proj's input
  as its few-row FP8 kernel takes it (linear.E4m3Rows), written by this kernel or by the merge
  after its splits, so that no pass of its own quantizes it and no transpose regroups a
  verify window's rows."""
  b, q_rows, head_dim = q_BRH.shape
  _, kv_heads, slots, _ = keys_BKSH.shape
  rows = q_rows // kv_heads
  if (q_rows % kv_heads or rows % group or values_BKSH.shape != keys_BKSH.shape
      or keys_BKSH.shape[0] != b or keys_BKSH.shape[3] != head_dim or start_B.shape != (b,)):
    raise ValueError(f"short_attention takes q [B, K*T*G, H] (or [B, T*N, H] token by token), "
                     f"caches [B, K, S, H] and starts [B], got {q_BRH.shape}, "
                     f"{keys_BKSH.shape}, {values_BKSH.shape}, {start_B.shape} with G={group}")
  if copies < 1:
    raise ValueError(f"copies must be at least 1, got {copies}")
  if not fits_kernel(slots, head_dim, rows):
    raise ValueError(f"short_attention takes caches of a multiple of {MIN_ROWS} slots, "
                     f"head_dim a power of two >= 16 and at most {MAX_ROWS} rows per KV "
                     f"head, got S={slots}, H={head_dim}, {rows} rows")
  if interpret is None:
    interpret = not platform.on_gpu()
  fitting = choose_block_slots(slots, head_dim, keys_BKSH.dtype.itemsize)
  if splits is None and block_slots is None:
    splits, block_slots = choose_splits(b, kv_heads, slots, platform.num_sms())
    block_slots = block_slots and min(block_slots, fitting)  # within the shared memory
  if block_slots is None:
    block_slots = fitting
  elif slots % block_slots or block_slots % MIN_ROWS:
    raise ValueError(f"block_slots {block_slots} must be a multiple of {MIN_ROWS} dividing "
                     f"the cache's {slots} slots")
  splits = splits or 1
  tokens, heads = rows // group, kv_heads * group
  if quantize and (head_dim != BLOCK or copies != 1 or b * tokens > fp8_gemm.MAX_ROWS):
    raise ValueError(f"short_attention quantizes {BLOCK}-wide heads once for up to "
                     f"{fp8_gemm.MAX_ROWS} tokens, got H={head_dim}, {copies} copies, "
                     f"{b} x {tokens} tokens")
  out_token_major = (token_major or quantize) and tokens > 1  # for one token: the same rows
  if not 1 <= splits <= slots // block_slots:
    raise ValueError(f"splits must be 1 to the cache's {slots // block_slots} blocks, got "
                     f"{splits}")
  kernel = functools.partial(
      _kernel, rows=rows, block_rows=max(MIN_ROWS, 1 << (rows - 1).bit_length()),
      group=group, block_slots=block_slots, slots=slots, scale=scale, copies=copies,
      splits=splits, q_token_major=token_major and tokens > 1,
      out_token_major=out_token_major, interpret=interpret)
  params = pltriton.CompilerParams(num_warps=num_warps or NUM_WARPS,
                                   num_stages=num_stages or NUM_STAGES)
  start_B = start_B.astype(jnp.int32)
  if splits == 1:
    out_shape = (jax.ShapeDtypeStruct((copies * b, q_rows, head_dim), q_BRH.dtype),)
    if quantize:
      lanes = act_lanes_size(b * tokens, heads * head_dim) // heads
      out_shape += (jax.ShapeDtypeStruct((b, q_rows, head_dim), E4M3),
                    jax.ShapeDtypeStruct((heads, lanes), jnp.float32))
    out = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(b, kv_heads), compiler_params=params,
        interpret=interpret, name="short_attention" + ("_e4m3" if quantize else ""),
    )(start_B, q_BRH, keys_BKSH, values_BKSH)
    if quantize:
      return out[0], out[1].reshape(b * tokens, -1), out[2].reshape(-1)
    return out[0]
  parts_BKRH, lse_BKR = pl.pallas_call(
      kernel, out_shape=(jax.ShapeDtypeStruct((b, splits, q_rows, head_dim), jnp.float32),
                         jax.ShapeDtypeStruct((b, splits, q_rows), jnp.float32)),
      grid=(b, kv_heads, splits), compiler_params=params, interpret=interpret,
      name="short_attention_split")(start_B, q_BRH, keys_BKSH, values_BKSH)
  return mla_merge.merge_chunks(parts_BKRH, lse_BKR, dtype=q_BRH.dtype, copies=copies,
                                interpret=interpret, quantize=quantize,
                                token_groups=(tokens, group) if out_token_major else None)

"""A MoE layer's batch-1 decode output left uncombined (decode_routing.SlotRows) and combined by
the next residual add + RMSNorm's kernel (residual_norm.add_slot_rows_rms_norm), in interpret
mode: h and norm(h) bit for bit those of the combine (decode_routing.combine_slot_rows) followed
by rms_norm, over random slot rows, slots (-1 picks among them) and widths; bad input refused;
a Qwen3-MoE model takes it at every MoE layer of a batch-1 decode step and keeps its greedy
tokens. On a GPU (`gpu` marker): the compiled kernel against the compiled pair."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from helpers import fixture_dir, greedy_token_ids
from jspec.models import moe as moe_module
from jspec.pallas_kernels import decode_routing, residual_norm

# (rows M, slots S, top_k K, width D, dtype of x, dtype of the slot rows, zero_centered)
CASES = [(1, 8, 8, 2048, jnp.bfloat16, jnp.bfloat16, False),
         (1, 8, 8, 4096, jnp.bfloat16, jnp.bfloat16, True),
         (2, 12, 6, 512, jnp.float32, jnp.float32, False),
         (3, 9, 4, 3072, jnp.bfloat16, jnp.float32, False),
         (5, 16, 3, 128, jnp.float32, jnp.float32, True),
         (1, 4, 4, 7168, jnp.bfloat16, jnp.bfloat16, False),
         (8, 20, 2, 1024, jnp.bfloat16, jnp.bfloat16, True)]


def _inputs(rng, rows, slots, top_k, width, dtype, rows_dtype):
  padded = max(8, 1 << (rows - 1).bit_length())
  x = jnp.asarray(rng.standard_normal((rows, width)) * 2, dtype)
  scale = jnp.asarray(1 + rng.standard_normal(width) / 4, dtype)
  slot_rows = jnp.asarray(rng.standard_normal((slots, padded, width)) / 3, rows_dtype)
  slot = rng.integers(0, slots, (rows, top_k))
  slot[rng.random((rows, top_k)) < 0.2] = -1  # repeated or out-of-range picks add nothing
  return x, scale, slot_rows, jnp.asarray(slot, jnp.int32)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_kernel_equals_the_combine_then_the_norm(case):
  rows, slots, top_k, width, dtype, rows_dtype, zero_centered = CASES[case]
  x, scale, slot_rows, slot = _inputs(np.random.default_rng(case), rows, slots, top_k, width,
                                      dtype, rows_dtype)
  h, normed = residual_norm.add_slot_rows_rms_norm(x, scale, slot_rows, slot, eps=1e-6,
                                                   zero_centered=zero_centered, interpret=True)
  y = decode_routing.combine_slot_rows(slot_rows, slot, dtype)
  want_h, want_normed = residual_norm.rms_norm(x, scale, y, eps=1e-6,
                                               zero_centered=zero_centered, interpret=True)
  np.testing.assert_array_equal(np.asarray(h), np.asarray(want_h))
  np.testing.assert_array_equal(np.asarray(normed), np.asarray(want_normed))
  # and y is the slots' sum as NumPy takes it
  rows_np = np.asarray(slot_rows, np.float32)
  want_y = np.zeros((rows, width), np.float32)
  for m in range(rows):
    for k in range(top_k):
      if slot[m, k] >= 0:
        want_y[m] += rows_np[slot[m, k], m]
  np.testing.assert_allclose(np.asarray(y, np.float32), want_y, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("case", [0, 1, 5])
def test_one_row_whose_pick_k_is_slot_k_reads_no_slots(case):
  """slot_MK None (the router kernel's batch-1 plan): the kernel's h and norm(h) are those of
  slots 0..K-1 given explicitly, and of the combine then the norm."""
  rows, slots, top_k, width, dtype, rows_dtype, zero_centered = CASES[case]
  x, scale, slot_rows, _ = _inputs(np.random.default_rng(50 + case), 1, slots, top_k, width,
                                   dtype, rows_dtype)
  implied = residual_norm.add_slot_rows_rms_norm(x, scale, slot_rows, top_k=top_k, eps=1e-6,
                                                 zero_centered=zero_centered, interpret=True)
  given = jnp.arange(top_k, dtype=jnp.int32)[None]
  explicit = residual_norm.add_slot_rows_rms_norm(x, scale, slot_rows, given, eps=1e-6,
                                                  zero_centered=zero_centered, interpret=True)
  y = decode_routing.SlotRows(slot_rows, None, dtype, (1, 1, width), top_k=top_k).reduced()
  want = residual_norm.rms_norm(x, scale, y.reshape(1, width), eps=1e-6,
                                zero_centered=zero_centered, interpret=True)
  for got, other, reference in zip(implied, explicit, want):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(other))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(reference))


def test_slot_rows_stand_for_their_combine():
  x, _, slot_rows, slot = _inputs(np.random.default_rng(7), 2, 6, 4, 256, jnp.float32,
                                  jnp.float32)
  deferred = decode_routing.SlotRows(slot_rows, slot, jnp.float32, (2, 1, 256))
  y = decode_routing.combine_slot_rows(slot_rows, slot, jnp.float32).reshape(2, 1, 256)
  np.testing.assert_array_equal(np.asarray(deferred.reduced()), np.asarray(y))
  np.testing.assert_array_equal(np.asarray(x[:, None] + deferred), np.asarray(x[:, None] + y))
  np.testing.assert_array_equal(np.asarray(deferred + x[:, None]), np.asarray(y + x[:, None]))
  with pytest.raises(ValueError, match="do not make an output"):
    decode_routing.SlotRows(slot_rows, slot, jnp.float32, (3, 1, 256))
  with pytest.raises(ValueError, match="without slots"):
    decode_routing.SlotRows(slot_rows, None, jnp.float32, (2, 1, 256), top_k=4)
  with pytest.raises(ValueError, match="without slots"):
    decode_routing.SlotRows(slot_rows, None, jnp.float32, (1, 1, 256), top_k=7)


def test_bad_input_is_refused():
  x, scale, slot_rows, slot = _inputs(np.random.default_rng(3), 2, 6, 4, 256, jnp.float32,
                                      jnp.float32)
  call = lambda *a: residual_norm.add_slot_rows_rms_norm(*a, eps=1e-6, interpret=True)
  with pytest.raises(ValueError, match="integer slots"):
    call(x, scale, slot_rows, slot.astype(jnp.float32))
  with pytest.raises(ValueError, match="slot rows"):
    call(x, scale, slot_rows[:, :, :128], slot)
  with pytest.raises(ValueError, match="integer slots"):
    call(x, scale, slot_rows, slot[:1])
  with pytest.raises(ValueError, match="without slots"):
    call(x, scale, slot_rows, None)  # two rows, and no top_k
  with pytest.raises(ValueError, match="without slots"):
    call(x[:1], scale, slot_rows)  # no top_k
  wide = jnp.zeros((1, 8192), jnp.float32)
  with pytest.raises(ValueError, match="K x D"):
    call(wide, jnp.ones(8192), jnp.zeros((8, 8, 8192)), jnp.zeros((1, 8), jnp.int32))
  assert not residual_norm.takes_slot_rows(8, 8192) and residual_norm.takes_slot_rows(8, 4096)


def test_a_moe_model_combines_its_experts_in_the_next_norm_with_its_tokens(monkeypatch):
  """Qwen3-MoE with the row and router kernels and the Pallas experts at batch 1: each decode
  step's MoE layers leave their slot rows to the next norm (the final norm's as well), and
  the greedy tokens are those of the combine apart."""
  calls = []
  kernel = residual_norm.add_slot_rows_rms_norm
  monkeypatch.setattr(residual_norm, "add_slot_rows_rms_norm",
                      lambda x, *a, **k: (calls.append(x.shape), kernel(x, *a, **k))[1])

  def tokens():
    llm = jspec.LLM(model=fixture_dir("qwen3_moe"), dtype="float32", max_model_len=64,
                    max_num_seqs=1, norm_backend="pallas", moe_backend="pallas")
    return greedy_token_ids(llm, [[5, 9, 2, 7, 7, 1]], 5)

  combined_in_norm = tokens()
  assert calls and all(shape == (1, calls[0][1]) for shape in calls)
  # each MoE layer of each traced decode step: the norm after it is the next layer's or the
  # final one
  assert len(calls) % _moe_layers() == 0
  made = len(calls)
  monkeypatch.setattr(moe_module, "SLOT_ROWS", False)
  assert tokens() == combined_in_norm and len(calls) == made


def _moe_layers() -> int:
  with open(f"{fixture_dir('qwen3_moe')}/config.json") as f:
    config = json.load(f)
  return config["num_hidden_layers"] - len(config["mlp_only_layers"])


@pytest.mark.gpu
def test_gpu_the_compiled_kernel_equals_the_compiled_pair():
  for case, (rows, slots, top_k, width, dtype, rows_dtype, zero_centered) in enumerate(CASES):
    x, scale, slot_rows, slot = _inputs(np.random.default_rng(case), rows, slots, top_k, width,
                                        dtype, rows_dtype)
    h, normed = jax.block_until_ready(residual_norm.add_slot_rows_rms_norm(
        x, scale, slot_rows, slot, eps=1e-6, zero_centered=zero_centered))
    y = decode_routing.combine_slot_rows(slot_rows, slot, dtype)
    want_h, want_normed = residual_norm.rms_norm(x, scale, y, eps=1e-6,
                                                 zero_centered=zero_centered)
    np.testing.assert_array_equal(np.asarray(h), np.asarray(want_h))
    # The sum of squares may be ordered otherwise by the compiler: one rounding at most.
    ulp = np.abs(np.asarray(want_normed, np.float32)) * float(jnp.finfo(dtype).eps) + 1e-6
    assert np.all(np.abs(np.asarray(normed, np.float32) - np.asarray(want_normed, np.float32))
                  <= ulp)

"""The FP8 expert path's activation kernel (jspec.pallas_kernels.expert_act): the gate / up
kernel's K-slice partials [2, P, S, F, N] to act [S, N, F] bfloat16, against float64 NumPy
(the slices summed, SiLU(gate) x up, transposed), within one bfloat16 rounding; slots from
num_slots on zero whatever their partials hold. In interpret mode here; the GPU run is
marked `gpu`."""

import jax.numpy as jnp
import numpy as np
import pytest

from jspec.pallas_kernels import expert_act, platform

RUN_SEED = 20261201


def _partials(rng, splits, slots, ffn, rows, used):
  parts = rng.standard_normal((2, splits, slots, ffn, rows)).astype(np.float32) * 2
  parts[:, :, used:] = np.nan  # not written by the gate / up kernel: anything may be there
  return parts


def _act64(parts, used):
  """[S, N, F] float64: silu(sum_p gate) * sum_p up over the used slots, 0 past them."""
  gate, up = (parts[w, :, :used].astype(np.float64).sum(axis=0) for w in (0, 1))
  act = np.zeros((parts.shape[2],) + parts.shape[4:] + parts.shape[3:4])
  act[:used] = np.swapaxes(gate / (1 + np.exp(-gate)) * up, 1, 2)
  return act


def _assert_one_rounding(got, want):
  got = np.asarray(got, np.float32).astype(np.float64)
  # bfloat16 keeps 8 significant bits: one rounding is within 2^-8 of the value's magnitude;
  # the float32 sums of a few unit-sized partials add under 1e-5 (the absolute term).
  assert np.isfinite(got).all()
  assert (np.abs(got - want) <= 2.0 ** -8 * np.abs(want) + 1e-4).all(), \
      np.abs(got - want).max()


@pytest.mark.parametrize("case", range(8))
def test_activation_is_the_summed_slices_silu_times_up_rounded_once(case):
  """Slices P of 1 to 8 (3 and 5 not powers of two), N of 8 to 32, F of 128 to 768, some
  slots unused."""
  rng = np.random.default_rng([RUN_SEED, case])
  splits = [1, 2, 3, 4, 5, 8, 8, 2][case]
  rows = [8, 8, 16, 8, 32, 8, 16, 32][case]
  ffn = [128, 768, 256, 384, 128, 768, 512, 256][case]
  slots = int(rng.integers(2, 10))
  used = int(rng.integers(1, slots + 1))
  parts = _partials(rng, splits, slots, ffn, rows, used)
  got = expert_act.gate_up_act(jnp.asarray(parts), jnp.asarray([used], jnp.int32))
  assert got.shape == (slots, rows, ffn) and got.dtype == jnp.bfloat16
  _assert_one_rounding(got, _act64(parts, used))
  assert not np.asarray(got[used:], np.float32).any()


def test_a_program_holds_at_most_its_share_of_partials():
  """Columns per program: powers of two dividing F, the partials a program loads within
  VALUES_PER_PROGRAM per weight (or the smallest block)."""
  for splits, ffn, rows in [(8, 768, 8), (1, 768, 8), (3, 256, 32), (16, 128, 64)]:
    cols = expert_act.columns_per_program(splits, ffn, rows)
    assert ffn % cols == 0 and cols & (cols - 1) == 0
    padded = 1 << (splits - 1).bit_length()
    assert (cols == expert_act.MIN_COLUMNS
            or padded * cols * rows <= expert_act.VALUES_PER_PROGRAM)
  assert expert_act.columns_per_program(8, 768, 8) == 32


def test_partials_of_another_layout_are_refused():
  with pytest.raises(ValueError, match="float32 partials"):
    expert_act.gate_up_act(jnp.zeros((3, 2, 4, 128, 8), jnp.float32), jnp.ones(1, jnp.int32))
  with pytest.raises(ValueError, match="float32 partials"):
    expert_act.gate_up_act(jnp.zeros((2, 2, 4, 128, 12), jnp.float32), jnp.ones(1, jnp.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not platform.on_gpu(), reason="needs a GPU")
@pytest.mark.parametrize("rows", [8, 32])
def test_activation_on_the_gpu_at_qwen3_30b_a3b_shapes(rows):
  """8 slots of 768-wide experts in 8 slices, as a Qwen3-30B-A3B decode step's gate / up
  kernel leaves them."""
  rng = np.random.default_rng([RUN_SEED, 99, rows])
  parts = _partials(rng, 8, 8, 768, rows, 7)
  got = expert_act.gate_up_act(jnp.asarray(parts), jnp.asarray([7], jnp.int32))
  _assert_one_rounding(got, _act64(parts, 7))
  assert got.dtype == jnp.bfloat16 and not np.asarray(got[7:], np.float32).any()

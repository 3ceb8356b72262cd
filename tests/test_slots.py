"""max_num_seqs="auto": the most sequences the memory plan fits for max_model_len, said aloud;
an explicit count that does not fit is refused before anything is allocated, with the figures."""

import pytest

import jspec
from helpers import fixture_dir
from jspec import memory_plan as plan_lib

DENSE = fixture_dir("qwen3_dense")
MTP = {"method": "mtp", "num_speculative_tokens": 2}


def _llm(**kwargs):
  return jspec.LLM(model=DENSE, dtype="float32", max_model_len=64, speculative_config=MTP,
                   **kwargs)


def _capacity_for(rows: int, mesh=None) -> int:
  """A device capacity whose usable 90% holds the weights and `rows` rows of caches, and not
  twice as many."""
  plan = _llm(max_num_seqs=rows, mesh=mesh).memory_plan
  return int((plan.total_bytes + (plan.total_bytes - plan.weight_bytes) // 2) / 0.9)


@pytest.mark.parametrize("rows", [2, 16])
def test_auto_takes_the_largest_batch_that_fits(rows, capsys):
  capacity = _capacity_for(rows)
  llm = _llm(device_memory_bytes=capacity)  # "auto" is the default
  assert llm.max_num_seqs == llm.memory_plan.max_num_seqs == rows
  assert llm.memory_plan.total_bytes <= 0.9 * capacity
  assert f"max_num_seqs='auto': {rows} sequences at max_model_len=64" in capsys.readouterr().err
  with pytest.raises(ValueError, match=rf"max_num_seqs={2 * rows} x max_model_len=64 does not "
                                       rf"fit: {2 * rows} rows: weights .* per device"):
    _llm(device_memory_bytes=capacity, max_num_seqs=2 * rows)


def test_auto_counts_rows_per_data_parallel_shard():
  """Caches are split over dp: four shards hold four times the rows of one."""
  mesh = jspec.MeshConfig(dp=4, num_devices=4)
  capacity = _capacity_for(2)
  assert _llm(device_memory_bytes=capacity, mesh=mesh).max_num_seqs == 8


def test_auto_is_capped_and_defaults_where_memory_is_unknown():
  assert _llm(device_memory_bytes=2**40).max_num_seqs == plan_lib.AUTO_MAX_NUM_SEQS
  assert _llm().max_num_seqs == plan_lib.AUTO_UNKNOWN_CAPACITY_NUM_SEQS  # CPU: no capacity


def test_auto_refuses_when_not_one_sequence_fits():
  with pytest.raises(ValueError, match=r"max_num_seqs='auto': not even 1 sequence.* "
                                       r"max_model_len=64 fit: 1 rows: weights"):
    _llm(device_memory_bytes=2**16)


@pytest.mark.parametrize("value", [0, -3, "many", 2.5])
def test_bad_max_num_seqs(value):
  with pytest.raises(ValueError, match="must be an integer >= 1 or 'auto'"):
    _llm(max_num_seqs=value)

"""ModelConfig: the fields every decoder has, then one group per kind of part that only some
families have (moe, mla, linear attention, mtp), declared by the family that has it."""

import dataclasses
import glob
import os

import pytest

from jspec.bench.presets import PRESETS
from jspec.config import LinearAttentionConfig, MLAConfig, ModelConfig, MoEConfig, MTPConfig
from jspec.models.hf_config import config_from_dir

GROUPS = {"moe": MoEConfig, "mla": MLAConfig, "linear": LinearAttentionConfig, "mtp": MTPConfig}
FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def test_a_groups_fields_live_in_the_group_only():
  """No group field is also a flat one, bare or under the group's prefix (moe_..., linear_...,
  ..._mtp_...), but for two names that mean the decoder's own at the top: its dense MLP's
  intermediate_size and its num_layers."""
  flat = {f.name for f in dataclasses.fields(ModelConfig)}
  for name, group in GROUPS.items():
    assert name in flat
    for field in dataclasses.fields(group):
      spellings = {field.name, f"{name}_{field.name}", field.name.replace("num_", f"num_{name}_")}
      assert not spellings & flat - {"intermediate_size", "num_layers"}, (name, field.name)


@pytest.mark.parametrize("fixture", sorted(
    os.path.basename(os.path.dirname(p)) for p in glob.glob(f"{FIXTURES}/*/config.json")))
def test_each_checkpoint_declares_the_groups_of_its_parts(fixture):
  """Read from the published config.json: experts give `moe`, latent attention `mla`, Gated
  DeltaNet layers `linear`, declared MTP / NextN layers `mtp`; a model without the part has
  None there (the predicates read the groups)."""
  config = config_from_dir(os.path.join(FIXTURES, fixture))
  family = config.architecture
  has_experts = family in ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "Glm4MoeForCausalLM",
                           "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM",
                           "Qwen3NextForCausalLM", "Qwen3_5MoeForConditionalGeneration",
                           "Qwen3_5MoeForCausalLM")
  assert (config.moe is not None) == has_experts == config.is_moe
  assert (config.mla is not None) == config.is_mla == (
      family in ("DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM"))
  assert (config.linear is not None) == ("linear_attention" in config.layer_types)
  if config.mtp is not None:
    assert config.mtp.num_layers >= 1


def test_replace_takes_a_groups_changes_as_a_dict():
  tiny = PRESETS["tiny-moe"]
  changed = tiny.replace(hidden_size=96, moe=dict(num_experts=4, intermediate_size=40))
  assert changed.hidden_size == 96
  assert changed.moe == dataclasses.replace(tiny.moe, num_experts=4, intermediate_size=40)
  assert tiny.moe.num_experts == 8  # frozen: the original is untouched
  assert tiny.replace(moe=None).is_moe is False
  with pytest.raises(ValueError, match="has no mla group to change"):
    tiny.replace(mla=dict(kv_lora_rank=16))
  with pytest.raises(TypeError):
    tiny.replace(moe=dict(num_expert=4))  # a misspelt field is refused, never dropped


@pytest.mark.parametrize("field, value", [("num_layers", -5), ("hidden_size", 0),
                                          ("num_kv_heads", 0), ("head_dim", 64.0),
                                          ("vocab_size", True), ("intermediate_size", -1)])
def test_widths_and_counts_out_of_range_are_refused(field, value):
  with pytest.raises(ValueError, match=f"{field}={value!r}"):
    PRESETS["tiny-moe"].replace(**{field: value})


def test_a_model_without_layers_or_dense_mlps_is_a_config():
  """Zero layers (a roofline's non-layer bytes) and a zero dense intermediate size (MoE-only
  families) stay valid."""
  tiny = PRESETS["tiny-moe"]
  assert tiny.replace(num_layers=0, layer_types=()).num_layers == 0
  assert tiny.replace(intermediate_size=0).intermediate_size == 0

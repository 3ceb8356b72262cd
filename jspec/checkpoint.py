"""Converted checkpoints: jspec's own parameter tree saved with orbax.

`jspec convert` reads a Hugging Face directory once (name mapping, transposes, expert
stacking) and writes the result with orbax next to a copy of config.json and the tokenizer
files. `LLM(model=converted_dir)` restores it straight into the sharding the rules give,
skipping the conversion.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import orbax.checkpoint as ocp
from flax import nnx

from jspec.models.mtp import MTPHead, MTPSpec
from jspec.models.params import unpadded_shape
from jspec.models.qkv_fusion import unfused_flat_state
from jspec.models.registry import family_of
from jspec.sharding.plan import sharded_configs

PARAMS_DIR = "jspec_params"
MTP_SPEC_FILE = "jspec_mtp.json"
LAYOUT_FILE = "jspec_layout.json"
# Version of the saved parameter tree; raised whenever a module's parameters change shape or
# name, so an older directory is refused with a reason instead of an orbax tree mismatch.
# 2: dense MLPs store gate and up as one gate_up_proj [D, 2, F].
PARAM_LAYOUT = 2
_COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model")


def is_converted(model_dir: str) -> bool:
  return os.path.isdir(os.path.join(model_dir, PARAMS_DIR))


def check_output_dir(out_dir: str):
  """Refuses a directory that holds files (before any model is loaded, where callers can)."""
  if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
    raise FileExistsError(f"output directory {out_dir!r} exists and is not empty: choose a new "
                     "directory or empty this one")


def save_converted(llm, out_dir: str):
  """Writes llm's parameters (target and MTP head) with orbax, plus config and tokenizer."""
  check_output_dir(out_dir)
  os.makedirs(out_dir, exist_ok=True)
  for name in _COPIED:
    src = os.path.join(llm.model_dir, name)
    if os.path.isfile(src):
      shutil.copy(src, os.path.join(out_dir, name))
  # Saved with q, k and v apart, as the layers are built (jspec.models.qkv_fusion).
  tree = {"target": nnx.from_flat_state(unfused_flat_state(llm.target))}
  if llm.mtp is not None:
    tree["mtp"] = nnx.from_flat_state(unfused_flat_state(llm.mtp))
  with open(os.path.join(out_dir, MTP_SPEC_FILE), "w") as f:
    json.dump(None if llm.mtp_spec is None else dataclasses.asdict(llm.mtp_spec), f)
  with open(os.path.join(out_dir, LAYOUT_FILE), "w") as f:
    json.dump({"param_layout": PARAM_LAYOUT}, f)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(os.path.abspath(os.path.join(out_dir, PARAMS_DIR)), tree)


def restore_converted(model_dir: str, cfg, dtype, mesh, target_rules, draft_rules=None):
  """(target, MTP head or None, MTPSpec or None), each array restored into its sharding."""
  layout_path = os.path.join(model_dir, LAYOUT_FILE)
  layout = None
  if os.path.isfile(layout_path):
    with open(layout_path) as f:
      layout = json.load(f).get("param_layout")
  if layout != PARAM_LAYOUT:
    raise ValueError(f"{model_dir!r} was converted with parameter layout {layout or 1}; this "
                     f"jspec reads layout {PARAM_LAYOUT}: run `jspec convert` again from the "
                     "Hugging Face checkpoint")
  with open(os.path.join(model_dir, MTP_SPEC_FILE)) as f:
    spec_dict = json.load(f)
  mtp_spec = None if spec_dict is None else MTPSpec(**spec_dict)
  draft_rules = draft_rules or target_rules
  target_cfg, draft_cfg = sharded_configs(cfg, mesh, target_rules, draft_rules)
  model = family_of(cfg).model
  modules = {"target": (nnx.eval_shape(lambda: model(target_cfg, dtype, nnx.Rngs(0))),
                        target_rules)}
  if mtp_spec is not None:
    modules["mtp"] = (nnx.eval_shape(lambda: MTPHead(draft_cfg, mtp_spec, dtype, nnx.Rngs(0),
                                                     model)), draft_rules)
  abstract_tree, graphdefs = {}, {}
  for name, (module, rules) in modules.items():
    graphdef, state = nnx.split(module)
    graphdefs[name] = graphdef
    abstract_tree[name] = jax.tree.map(
        lambda v, r=rules: v.replace(jax.ShapeDtypeStruct(  # the module's dtype per parameter
            v.get_value().shape, v.get_value().dtype,
            sharding=r.sharding(mesh, v.get_metadata()["logical_axes"]))),
        state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  params_dir = os.path.abspath(os.path.join(model_dir, PARAMS_DIR))
  with ocp.StandardCheckpointer() as checkpointer:
    saved = checkpointer.metadata(params_dir).item_metadata.tree
    # Padded parameters (vocabulary, experts: ModelConfig.padded_for) were saved as padded
    # for the mesh they were converted on; padding is zeros at the ends of axes, so orbax's
    # non-strict restore (zero-fill or truncate at the ends) gives this mesh's padding.
    repadded = [_repadded(saved, name, module) for name, (module, _) in modules.items()]
    restored = checkpointer.restore(params_dir, abstract_tree, strict=not any(repadded))
  target = nnx.merge(graphdefs["target"], restored["target"])
  mtp = nnx.merge(graphdefs["mtp"], restored["mtp"]) if mtp_spec is not None else None
  return target, mtp, mtp_spec


def _saved_shape(saved, name: str, path: tuple) -> tuple:
  node = saved
  try:
    for key in (name,) + tuple(path) + ("value",):
      node = node[str(key)]
  except KeyError:
    raise ValueError(f"converted checkpoint has no parameter {name}.{'.'.join(map(str, path))}: "
                     "convert the checkpoint again") from None
  return tuple(node.shape)


def _repadded(saved, name: str, module) -> bool:
  """Whether any parameter of `module` was saved with another padding than it has here. Each
  is checked: saved with its shape, or, where it is padded, at least its true shape."""
  differs = False
  for path, variable in nnx.to_flat_state(nnx.state(module)):
    got, shape = _saved_shape(saved, name, path), tuple(variable.get_value().shape)
    true = unpadded_shape(variable)
    padded = "unpadded_shape" in variable.get_metadata()
    if got != shape and not (padded and len(got) == len(true)
                             and all(g >= t for g, t in zip(got, true))):
      raise ValueError(f"converted parameter {name}.{'.'.join(map(str, path))} has shape {got}, "
                       f"this config needs {true if padded else shape}: convert the checkpoint "
                       "again")
    differs |= got != shape
  return differs

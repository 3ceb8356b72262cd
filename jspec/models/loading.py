"""Loading a local Hugging Face directory into sharded NNX modules.

Modules are first built abstractly (`nnx.eval_shape`: no memory), then each parameter is read
from safetensors one tensor at a time, converted to jspec's layout on the host, and placed
straight into its final sharding with `jax.make_array_from_callback`, which hands each device
only its own slice. The host never holds more than the tensors of one parameter.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jspec.config import ModelConfig
from jspec.models import eagle3
from jspec.models import weights as W
from jspec.models.mtp import MTPHead, MTPSpec
from jspec.models.params import unpadded_shape
from jspec.models.registry import family_of
from jspec.models.safetensors_index import SafetensorsIndex
from jspec.progress import progress
from jspec.sharding.plan import sharded_configs
from jspec.sharding.rules import ShardingRules


def _validate_names(index: SafetensorsIndex, rules: dict, skipped: tuple[str, ...] = (),
                    duplicates: frozenset[str] = frozenset()):
  """Every tensor a rule reads exists, and every tensor is read, ignorable, skipped or a
  checked duplicate: a tensor nobody reads is a layout jspec misunderstands, not something to
  drop silently."""
  wanted = {name for rule in rules.values() for name in rule.names}
  missing = sorted(wanted - index.names)
  if missing:
    shown = ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
    raise ValueError(f"checkpoint is missing {len(missing)} tensors: {shown}")
  skipped_names = {n for n in index.names if n.startswith(skipped)} if skipped else set()
  if skipped_names:
    print(f"jspec: skipping {len(skipped_names)} tensors under {', '.join(skipped)} "
          "(vision tower; jspec generates text only)", flush=True)
  unexpected = sorted(n for n in index.names - wanted - skipped_names - duplicates
                      if not W.ignorable(n))
  if unexpected:
    shown = ", ".join(unexpected[:8]) + (f" (+{len(unexpected) - 8} more)"
                                         if len(unexpected) > 8 else "")
    hint = ("; the *.weight_scale_inv are FP8 block scales, which jspec reads where config.json "
            "has an FP8 quantization_config and the weight's FP8 form is supported, and not "
            "for a projection kind that modules_to_not_convert lists in some layer (jspec "
            "keeps each kind in one precision: it must list a projection in every layer or in "
            "none)"
            if any(n.endswith("weight_scale_inv") for n in unexpected) else "")
    raise ValueError(f"checkpoint has {len(unexpected)} unexpected tensors: {shown}{hint}")


def _materialize(abstract_module, rules: dict, index: SafetensorsIndex, mesh: Mesh,
                 sharding_rules: ShardingRules, dtype, label: str):
  graphdef, abstract_state = nnx.split(abstract_module)
  flat = nnx.to_flat_state(abstract_state)
  arrays = {}
  for path, variable in progress(list(flat), description=f"loading {label}"):
    if path not in rules:
      raise AssertionError(f"no checkpoint rule for parameter {path}")  # a jspec bug, not input
    rule = rules[path]
    hf_arrays = []
    for name, hf_shape in zip(rule.names, rule.hf_shapes):
      array = index.read(name)
      if tuple(array.shape) != hf_shape:
        raise ValueError(f"tensor {name!r} has shape {tuple(array.shape)}, expected {hf_shape}")
      target_dtype = variable.get_value().dtype
      float8 = array.dtype.name.startswith("float8")
      if not (np.issubdtype(array.dtype, np.floating) or float8
              or array.dtype.name == "bfloat16"):
        raise ValueError(f"tensor {name!r} has dtype {array.dtype}, expected a float type")
      if float8 and jnp.dtype(target_dtype).name.startswith("float8") and (
          array.dtype.name != jnp.dtype(target_dtype).name):  # e5m2 would be re-rounded
        raise ValueError(f"tensor {name!r} has dtype {array.dtype}; jspec reads FP8 weights "
                         f"as {jnp.dtype(target_dtype).name} and converts none")
      if float8 != jnp.dtype(target_dtype).name.startswith("float8"):
        # An FP8 weight read as a plain one would lose its block scales (wrong weights), and
        # a plain one stored as FP8 would lose its precision.
        expected = "an FP8 weight (float8 with block scales)" if not float8 else "an unquantized one"
        raise ValueError(f"tensor {name!r} has dtype {array.dtype}; jspec expects {expected} "
                         "there (the checkpoint's quantization_config and its tensors disagree: "
                         "modules_to_not_convert must list a projection in every layer or in "
                         "none, as jspec keeps each kind in one precision; or this weight's FP8 "
                         "form is not supported yet)")
      hf_arrays.append(array)
    # The module's own dtype for each parameter: `dtype`, except what it keeps in float32.
    host = rule.build(*hf_arrays).astype(variable.get_value().dtype)
    shape = tuple(variable.get_value().shape)
    if tuple(host.shape) != unpadded_shape(variable):  # a jspec bug, not input
      raise AssertionError(f"rule for {path} built {host.shape}, the module holds "
                           f"{unpadded_shape(variable)}")
    sharding = sharding_rules.sharding(mesh, variable.get_metadata()["logical_axes"])
    block = ((lambda idx, h=host: h[idx]) if host.shape == shape
             else (lambda idx, h=host: _padded_block(h, idx, shape)))
    arrays[path] = jax.make_array_from_callback(shape, sharding, block)
  for path, variable in flat:
    variable.set_value(arrays[path])
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _padded_block(host: np.ndarray, index: tuple, shape: tuple) -> np.ndarray:
  """`index` (a device's slices) of `host` zero-padded at the end of each axis to `shape`,
  built without a padded copy of the whole tensor (ModelConfig.padded_for says why padded)."""
  bounds = [s.indices(n)[:2] for s, n in zip(index, shape)]
  block = np.zeros([stop - start for start, stop in bounds], host.dtype)
  present = tuple(slice(start, min(stop, n)) for (start, stop), n in zip(bounds, host.shape))
  block[tuple(slice(0, max(0, p.stop - p.start)) for p in present)] = host[present]
  return block


def load_checkpoint(model_dir: str, cfg: ModelConfig, dtype, mesh: Mesh,
                    target_rules: ShardingRules, draft_rules: ShardingRules | None = None,
                    load_mtp: bool = True):
  """Returns (target module, MTP head or None, MTPSpec or None), parameters on `mesh`.
  `load_mtp=False` (a model loaded as another's draft): MTP tensors are checked, not read."""
  index = SafetensorsIndex(model_dir)
  names = index.names
  family = family_of(cfg)
  mtp_spec = W.detect_mtp(cfg, names)
  duplicates = frozenset()
  if mtp_spec is not None:
    mtp_spec, duplicates = _shared_with_target(cfg, mtp_spec, index)
  draft_rules = draft_rules or target_rules
  target_cfg, draft_cfg = sharded_configs(cfg, mesh, target_rules, draft_rules)
  abstract_target = nnx.eval_shape(lambda: family.model(target_cfg, dtype, nnx.Rngs(0)))
  abstract_mtp = None if mtp_spec is None else nnx.eval_shape(
      lambda: MTPHead(draft_cfg, mtp_spec, dtype, nnx.Rngs(0), family.model))
  rules = _with_fp8_scales(abstract_target, family.target_rules(cfg, names), cfg.fp8_block)
  mtp_rules = {} if mtp_spec is None else _with_fp8_scales(
      abstract_mtp, W.mtp_rules(cfg, mtp_spec, family.decoder_rules(cfg, names)),
      cfg.fp8_block)
  _validate_names(index, {**rules, **{("mtp",) + p: r for p, r in mtp_rules.items()}},
                  family.skipped_prefixes(cfg), duplicates)
  target = _materialize(abstract_target, rules, index, mesh, target_rules, dtype, "target")
  mtp = None
  if load_mtp and mtp_spec is not None:
    mtp = _materialize(abstract_mtp, mtp_rules, index, mesh, draft_rules, dtype, "MTP head")
  return target, mtp, (mtp_spec if load_mtp else None)


def _with_fp8_scales(abstract_module, rules: dict, block: tuple[int, int] | None) -> dict:
  """`rules` with each FP8 weight the module holds (jspec.models.linear.linear) read in the
  checkpoint's order, output axes first, and beside it the rule that reads its
  `weight_scale_inv` tensors (W.fp8_scale_rule) in the same order."""
  if block is None:
    return rules
  fp8 = {}
  flat = dict(nnx.to_flat_state(nnx.state(abstract_module)))
  for path, variable in flat.items():
    meta = variable.get_metadata()
    in_axes = meta.get("fp8_in_axes")
    if in_axes is not None:
      weight_path = path[:-1] + (path[-1].removesuffix("_scale"),)
      stored = tuple(flat[weight_path].get_value().shape)
      weight_rule = rules[weight_path]
      stored_rule = W.fp8_stored_rule(weight_rule, stored, in_axes, meta.get("fp8_lead", 0))
      fp8[path] = W.fp8_scale_rule(weight_rule, stored_rule, block, in_axes)
      fp8[weight_path] = stored_rule
  return {**rules, **fp8}


def _shared_with_target(cfg: ModelConfig, spec: MTPSpec, index: SafetensorsIndex):
  """(spec, duplicates): a DeepSeek-layout MTP layer's `embed_tokens` / `shared_head.head` are
  loaded only where they differ from the target's embedding / head (byte for byte); equal
  copies are the `duplicates`, read for the comparison and never loaded."""
  duplicates, own = set(), {}
  for kind, (target_name, copies) in W.mtp_copies(cfg, spec).items():
    present = [c for c in copies if c in index.names]
    differing = [c for c in present if not index.same_bytes(c, target_name)]
    own[kind] = bool(differing)
    if not differing:
      duplicates.update(present)
    elif len(present) < len(copies):
      raise ValueError(f"MTP tensor {differing[0]!r} differs from {target_name!r}, but "
                       f"{sorted(set(copies) - set(present))} are missing: every MTP layer "
                       "needs its own copy then")
  if not own:
    return spec, frozenset()
  return (dataclasses.replace(spec, has_own_embed=own["embed"], has_own_head=own["head"]),
          frozenset(duplicates))


def init_random_module(make: Callable, mesh: Mesh, sharding_rules: ShardingRules, seed: int,
                       stream: int, generators: dict | None = None):
  """The module `make` builds, its weights drawn on device in their final sharding: each
  parameter by a small jitted generator with `out_shardings` from the rules (one compile per
  distinct shape, so 36 identical layers cost one; `generators` shares them between modules),
  scaled as the module's initialiser says (`init_scale` metadata; None = ones)."""
  generators = {} if generators is None else generators

  def generator(shape, true_shape, dtype_, sharding, scale):
    key = (shape, true_shape, dtype_, sharding, scale)
    if key not in generators:
      def draw(rng):
        if scale is None:
          return jnp.ones(shape, dtype_)
        # Only the true shape is drawn (the same weights on every mesh); padding is zeros.
        value = (scale * jax.random.normal(rng, true_shape, jnp.float32)).astype(dtype_)
        return jnp.pad(value, [(0, n - t) for n, t in zip(shape, true_shape)])
      generators[key] = jax.jit(draw, out_shardings=sharding)
    return generators[key]

  graphdef, abstract_state = nnx.split(nnx.eval_shape(make))
  flat = nnx.to_flat_state(abstract_state)
  base = jax.random.fold_in(jax.random.key(seed), stream)
  for index, (path, variable) in enumerate(progress(list(flat), "initialising")):
    meta = variable.get_metadata()
    abstract = variable.get_value()
    sharding = sharding_rules.sharding(mesh, meta["logical_axes"])
    draw = generator(abstract.shape, unpadded_shape(variable), abstract.dtype, sharding,
                     meta["init_scale"])
    variable.set_value(draw(jax.random.fold_in(base, index)))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def init_random(cfg: ModelConfig, mtp_spec: MTPSpec | None, dtype, mesh: Mesh,
                target_rules: ShardingRules, draft_rules: ShardingRules | None, seed: int):
  """Random target (and MTP head) weights born sharded (`init_random_module`)."""
  generators = {}

  def build(make: Callable, sharding_rules: ShardingRules, stream: int):
    return init_random_module(make, mesh, sharding_rules, seed, stream, generators)

  draft_rules = draft_rules or target_rules
  target_cfg, draft_cfg = sharded_configs(cfg, mesh, target_rules, draft_rules)
  model = family_of(cfg).model
  target = build(lambda: model(target_cfg, dtype, nnx.Rngs(seed)), target_rules, 0)
  mtp = None
  if mtp_spec is not None:
    mtp = build(lambda: MTPHead(draft_cfg, mtp_spec, dtype, nnx.Rngs(seed), model),
                draft_rules, 1)
  return target, mtp


def load_eagle3(model_dir: str, target_cfg: ModelConfig, dtype, mesh: Mesh,
                draft_rules: ShardingRules):
  """An EAGLE-3 head (jspec.models.eagle3) for a target of `target_cfg`, on `mesh`."""
  from transformers import AutoConfig
  index = SafetensorsIndex(model_dir)
  ecfg = eagle3.read_eagle3_config(AutoConfig.from_pretrained(model_dir, local_files_only=True),
                                   target_cfg, index.names)
  rules = eagle3.eagle3_rules(ecfg)
  ints = {"d2t", "t2d"}
  _validate_names(index, rules, duplicates=frozenset(ints & index.names))
  layer_cfg = sharded_configs(ecfg.layer, mesh, draft_rules, draft_rules)[0]
  ecfg = dataclasses.replace(ecfg, layer=layer_cfg)
  abstract = nnx.eval_shape(lambda: eagle3.Eagle3Head(ecfg, dtype, nnx.Rngs(0)))
  head = _materialize(abstract, rules, index, mesh, draft_rules, dtype, "EAGLE-3 head")
  d2t = index.read("d2t") if "d2t" in index.names else None
  head.set_target_ids(eagle3.draft_to_target_ids(d2t, ecfg.draft_vocab_size,
                                                 target_cfg.vocab_size),
                      draft_rules.sharding(mesh, (None,)))
  return head

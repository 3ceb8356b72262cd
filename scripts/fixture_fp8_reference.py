"""transformers' float32 reference for the FP8 fixtures of scripts/fixture_fp8.py (its
dequantizing load, the greedy continuations, prompts chosen far from ties), and the FP8 pieces
both halves use. Needs torch and transformers; never imported by the test suite."""

from __future__ import annotations

import math
import re

import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig

PROMPTS = ([5, 6, 7, 8, 9], [1, 2, 3], [100, 3, 44, 44, 44, 44])
NEW_TOKENS = 8
PROMPT_TRIES = 50  # seeded random prompts tried in place of one whose margins are too small
MIN_MARGIN = 2e-3  # top-1 minus top-2 logit at each greedy step: 20x the test's 1e-4
MIN_ROUTER_GAP = {"softmax": 1e-4, "sigmoid": 2e-5}  # k-th minus (k+1)-th router logit / score

SCALE_SUFFIX = "_scale_inv"
PER_EXPERT = re.compile(r"^(.*\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class FixtureError(Exception):
  """A check of one fixture failed: reported, and the next fixture is made."""


def fp8_config(**kwargs):
  cls = getattr(transformers, "FineGrainedFP8Config", None)
  if cls is None:
    raise FixtureError(f"transformers {transformers.__version__} has no FineGrainedFP8Config")
  return cls(**kwargs)


def dequantize(w8: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
  full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
  return w8.float() * full[:w8.shape[0], :w8.shape[1]]


# ---- the reference ------------------------------------------------------------------------------

def eager(model):
  """The plain per-expert loop, as the other fixtures' references (grouped_mm differs by ~1e-5)."""
  if model._can_set_experts_implementation():
    model.set_experts_implementation("eager")
  return model.eval()


def load_dequantized(model_dir: str, tensors: dict, block: int):
  model, info = AutoModelForCausalLM.from_pretrained(
      model_dir, quantization_config=fp8_config(dequantize=True), dtype=torch.float32,
      device_map="cpu", attn_implementation="eager", output_loading_info=True)
  mtp_prefix = _mtp_prefixes(model.config)
  unexpected = [k for k in info["unexpected_keys"] if not k.startswith(mtp_prefix)]
  if info["missing_keys"] or info["mismatched_keys"] or unexpected:
    raise FixtureError(f"transformers' dequantizing load: missing "
                       f"{sorted(info['missing_keys'])[:4]}, mismatched "
                       f"{info['mismatched_keys'][:2]}, unexpected {unexpected[:4]}")
  params = model.state_dict()
  for name, w8 in tensors.items():
    if w8.dtype == torch.float8_e4m3fn and not name.startswith(mtp_prefix):
      got = _parameter(params, name)
      if got.dtype != torch.float32 or not torch.equal(
          got, dequantize(w8, tensors[name + SCALE_SUFFIX], block)):
        raise FixtureError(f"{name}: transformers' dequantized parameter is not e4m3 x scale")
  return eager(model)


def _mtp_prefixes(config) -> tuple[str, ...]:
  first = getattr(config, "num_hidden_layers")
  extra = getattr(config, "num_nextn_predict_layers", 0) or 0
  return ("mtp.",) + tuple(f"model.layers.{first + m}." for m in range(extra))


def _parameter(params: dict, name: str) -> torch.Tensor:
  """The model's parameter (or its slice) that a checkpoint weight becomes: fused experts hold
  gate rows, then up rows ([E, 2F, D]), and down_proj [E, D, F]."""
  if name in params:
    return params[name]
  match = PER_EXPERT.match(name)
  if not match:
    raise FixtureError(f"{name}: no such parameter in the dequantized model")
  prefix, e, which = match.groups()
  if which == "down_proj":
    return params[prefix + "down_proj"][int(e)]
  gate_up = params[prefix + "gate_up_proj"][int(e)]
  half = gate_up.shape[0] // 2
  return gate_up[:half] if which == "gate_proj" else gate_up[half:]


class RouterAudit:
  """The smallest gap, over every token the hooked forwards route, between the k-th and the
  (k+1)-th choice of each router (`*.mlp.gate`): router logits for softmax routing; for
  DeepSeek's sigmoid routing the biased scores inside the kept groups, and the group scores."""

  def __init__(self, model):
    self.gap = {"softmax": math.inf, "sigmoid": math.inf}
    self.config = model.config
    self.handles = [module.register_forward_hook(self._hook)
                    for name, module in model.named_modules()
                    if name.endswith("mlp.gate") and getattr(module, "weight", None) is not None]

  def _hook(self, module, inputs, _):
    x = inputs[0].reshape(-1, module.weight.shape[1]).float()
    logits = x @ module.weight.float().T
    k = self.config.num_experts_per_tok
    bias = getattr(module, "e_score_correction_bias", None)
    if bias is None:
      top = logits.topk(k + 1, dim=-1).values
      self.gap["softmax"] = min(self.gap["softmax"], float((top[:, k - 1] - top[:, k]).min()))
      return
    scores = logits.sigmoid() + bias.float()
    groups, kept = self.config.n_group, self.config.topk_group
    grouped = scores.reshape(len(scores), groups, -1)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1).sort(-1, descending=True).values
    chosen = grouped.topk(2, dim=-1).values.sum(-1).topk(kept, dim=-1).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
    inside = grouped.masked_fill(~mask[..., None], -math.inf).reshape(len(scores), -1)
    top = inside.topk(k + 1, dim=-1).values
    self.gap["sigmoid"] = min(self.gap["sigmoid"],
                              float((top[:, k - 1] - top[:, k]).min()),
                              float((group_scores[:, kept - 1] - group_scores[:, kept]).min()))

  def close(self):
    for handle in self.handles:
      handle.remove()


def top2_margin(logits: torch.Tensor) -> float:
  top = logits.topk(2, dim=-1).values
  return float((top[..., 0] - top[..., 1]).min())


def greedy_reference(model, prompt: list[int]):
  """(continuation, logits of prompt + continuation [n + NEW_TOKENS, V], min greedy margin,
  min router gaps)."""
  ids = torch.tensor(prompt)
  for _ in range(NEW_TOKENS):  # a cache-free re-forward loop
    step = model(ids[None], use_cache=False).logits[0, -1]
    ids = torch.cat([ids, step.argmax()[None]])
  audit = RouterAudit(model)
  try:
    logits = model(ids[None], use_cache=False).logits[0]
  finally:
    audit.close()
  steps = logits[len(prompt) - 1:-1]
  if not torch.equal(steps.argmax(-1), ids[len(prompt):]):
    raise FixtureError(f"prompt {prompt}: the full forward's argmax differs from the greedy loop")
  cached = generate_without_eos(model, ids[:len(prompt)])
  if not torch.equal(cached, ids[len(prompt):]):
    raise FixtureError(f"prompt {prompt}: generate() gives {cached.tolist()}, the cache-free "
                       f"loop {ids[len(prompt):].tolist()}")
  return ids[len(prompt):], logits, top2_margin(steps), audit.gap


def generate_without_eos(model, prompt: torch.Tensor) -> torch.Tensor:
  """generate()'s greedy continuation with EOS impossible: generate() fills the fields a
  GenerationConfig leaves unset from the model's, so its EOS is blanked for the call (jspec's
  test ignores EOS)."""
  configs = (model.config.get_text_config(), model.generation_config)
  saved = [c.eos_token_id for c in configs]
  for c in configs:
    c.eos_token_id = None
  try:
    settings = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None,
                                pad_token_id=0)
    out = model.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]),
                         generation_config=settings)
    return out[0, len(prompt):]
  finally:
    for c, eos in zip(configs, saved):
      c.eos_token_id = eos


def robust(margin: float, gaps: dict) -> bool:
  return margin > MIN_MARGIN and all(gaps[kind] > MIN_ROUTER_GAP[kind] for kind in gaps)


def choose_prompts(model, vocab: int):
  """PROMPTS, each replaced by a seeded random prompt of its length while it is not robust."""
  rng = torch.Generator().manual_seed(8)
  chosen = []
  for i, prompt in enumerate(PROMPTS):
    for attempt in range(PROMPT_TRIES):
      result = greedy_reference(model, prompt)
      if robust(result[2], result[3]):
        chosen.append((prompt, attempt) + result)
        break
      prompt = torch.randint(0, vocab, (len(PROMPTS[i]),), generator=rng).tolist()
    else:
      raise FixtureError(f"no robust prompt of length {len(PROMPTS[i])} in {PROMPT_TRIES} tries")
  return chosen

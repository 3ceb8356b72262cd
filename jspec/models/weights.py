"""Hugging Face tensor names -> jspec parameter paths, and the checks around them.

jspec stores projections input-major and split by head ([D, N, H] for q, [N, H, D] for o),
so that each dimension has one logical axis; HF `nn.Linear` weights are [out, in]. Each
`TensorRule` says which HF tensors make one jspec parameter and how.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

import numpy as np

from jspec.config import ModelConfig
from jspec.models.mtp import MTPSpec

Path = tuple


@dataclasses.dataclass(frozen=True)
class TensorRule:
  names: tuple[str, ...]                  # HF tensor names read, in order
  hf_shapes: tuple[tuple[int, ...], ...]  # the shape each must have
  build: Callable[..., np.ndarray]        # HF arrays -> the jspec parameter
  # jspec parameter -> HF arrays, for rules that read several tensors into one parameter; the
  # saver derives the inverse of single-tensor rules from their shapes.
  split: Callable[[np.ndarray], list[np.ndarray]] | None = None


def fp8_stored_rule(rule: TensorRule, stored: tuple[int, ...], in_axes: int,
                    lead: int = 0) -> TensorRule:
  """`rule` with the input axes of what it builds (after `lead` batch axes) moved to the end,
  reshaped to `stored`: an FP8 weight (or its full-size scales) in the checkpoint's [out, in]
  order (jspec.models.quantization.stored_shape). Saving FP8 weights back to Hugging Face
  tensors is not supported (no `split`)."""
  def build(*arrays):
    moved = np.moveaxis(rule.build(*arrays), range(lead, lead + in_axes), range(-in_axes, 0))
    return np.ascontiguousarray(moved).reshape(stored)

  return TensorRule(rule.names, rule.hf_shapes, build)


def fp8_scale_rule(weight: TensorRule, stored_rule: TensorRule, block: tuple[int, int],
                   in_axes: int) -> TensorRule:
  """The block scales of an FP8 weight: each `{name}_scale_inv` [ceil(out / b_out), ceil(in /
  b_in)] repeated to the weight's [out, in], laid out as `stored_rule` lays the weight out,
  then one value per block kept (the stored weight's last output and last input axis step by
  their block). Any layout the weight rule makes (head split, gate/up stack, expert stack) so
  carries over to the scales."""
  out_block, in_block = block
  names = tuple(name.removesuffix("weight") + "weight_scale_inv" for name in weight.names)
  hf_shapes = tuple((-(-out // out_block), -(-in_ // in_block)) for out, in_ in weight.hf_shapes)

  def build(*scales):
    full = [np.repeat(np.repeat(s.astype(np.float32), out_block, 0), in_block, 1)[:out, :in_]
            for s, (out, in_) in zip(scales, weight.hf_shapes)]
    laid_out = stored_rule.build(*full)
    index = [slice(None)] * laid_out.ndim
    index[-in_axes - 1] = slice(None, None, out_block)
    index[-1] = slice(None, None, in_block)
    return np.ascontiguousarray(laid_out[tuple(index)])

  return TensorRule(names, hf_shapes, build)


def _copy(shape):
  return lambda a: a.reshape(shape)


def _linear_t(shape):
  """HF [out, in] -> jspec [in, ...out split] (or [...in split, out] for o_proj)."""
  return lambda a: np.ascontiguousarray(a.T).reshape(shape)


def _stack_t(shape):
  return lambda *experts: np.stack([np.ascontiguousarray(e.T) for e in experts]).reshape(shape)


def _rule(name, hf_shape, build) -> TensorRule:
  return TensorRule((name,), (tuple(hf_shape),), build)


def norm_rule(name: str, dim: int) -> TensorRule:
  return _rule(name, (dim,), _copy((dim,)))


def attention_rules(cfg: ModelConfig, p: str, gated: bool = False) -> dict:
  """`{p}self_attn.*` -> an Attention (or GatedAttention: q_proj rows are per head [q | gate]),
  with q/k norms where `cfg.use_qk_norm`, q/k/v biases where `cfg.attention_bias` and an
  o_proj bias where `cfg.o_proj_bias`."""
  d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  q_rows, q_shape = (2 * n * h, (d, n, 2, h)) if gated else (n * h, (d, n, h))
  a = p + "self_attn."
  rules = {
      ("q_proj",): _rule(a + "q_proj.weight", (q_rows, d), _linear_t(q_shape)),
      ("k_proj",): _rule(a + "k_proj.weight", (k * h, d), _linear_t((d, k, h))),
      ("v_proj",): _rule(a + "v_proj.weight", (k * h, d), _linear_t((d, k, h))),
      ("o_proj",): _rule(a + "o_proj.weight", (d, n * h), _linear_t((n, h, d))),
  }
  if cfg.use_qk_norm:
    rules[("q_norm", "scale")] = norm_rule(a + "q_norm.weight", h)
    rules[("k_norm", "scale")] = norm_rule(a + "k_norm.weight", h)
  if cfg.attention_bias:
    for ours, theirs, heads in (("q_bias", "q_proj", n), ("k_bias", "k_proj", k),
                                ("v_bias", "v_proj", k)):
      rules[(ours,)] = _rule(a + theirs + ".bias", (heads * h,), _copy((heads, h)))
  if cfg.o_proj_bias:
    rules[("o_bias",)] = _rule(a + "o_proj.bias", (d,), _copy((d,)))
  return rules


def dense_mlp_rules(p: str, d: int, f: int) -> dict:
  """`{p}{gate,up,down}_proj.weight` -> an MLP, gate and up as one [D, 2, F] matrix
  (jspec.models.mlp.MLP says why)."""
  return {
      ("gate_up_proj",): TensorRule(
          (p + "gate_proj.weight", p + "up_proj.weight"), ((f, d), (f, d)),
          lambda gate, up: np.ascontiguousarray(np.stack([gate.T, up.T], axis=1)),
          split=lambda gate_up: [np.ascontiguousarray(gate_up[:, i].T) for i in range(2)]),
      ("down_proj",): _rule(p + "down_proj.weight", (d, f), _linear_t((f, d))),
  }


def expert_rules(cfg: ModelConfig, p: str, names: set[str], block: str = "mlp.",
                 expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
                 ) -> dict:
  """`{p}mlp.gate` and `{p}mlp.experts.*` -> a MoE block's router and stacked experts, from
  per-expert keys (`experts.{e}.gate_proj.weight`, the Qwen3-MoE / Qwen3-Next Hub layout) or
  fused 3-D keys (`experts.gate_up_proj` [E, 2F, D], gate rows first, and `experts.down_proj`
  [E, D, F]: transformers >= 5 and Qwen3.5-MoE), whichever this layer has. `block` and
  `expert_names` (gate, up, down) name another per-expert layout: Mixtral's
  `block_sparse_moe.experts.{e}.{w1, w3, w2}`."""
  d, e, f = cfg.hidden_size, cfg.moe.num_experts, cfg.moe.intermediate_size
  p_block = p + block
  rules = {("router",): _rule(p_block + "gate.weight", (e, d), _linear_t((d, e)))}
  gate_up = p_block + "experts.gate_up_proj"
  if gate_up in names:
    rules[("w_gate",)] = _rule(gate_up, (e, 2 * f, d),
                               lambda a: np.ascontiguousarray(a[:, :f].transpose(0, 2, 1)))
    rules[("w_up",)] = _rule(gate_up, (e, 2 * f, d),
                             lambda a: np.ascontiguousarray(a[:, f:].transpose(0, 2, 1)))
    rules[("w_down",)] = _rule(p_block + "experts.down_proj", (e, d, f),
                               lambda a: np.ascontiguousarray(a.transpose(0, 2, 1)))
    return rules
  gate, up, down = expert_names
  for ours, theirs, hf_shape, shape in (("w_gate", gate, (f, d), (e, d, f)),
                                        ("w_up", up, (f, d), (e, d, f)),
                                        ("w_down", down, (d, f), (e, f, d))):
    per_expert = tuple(f"{p_block}experts.{i}.{theirs}.weight" for i in range(e))
    rules[(ours,)] = TensorRule(per_expert, (hf_shape,) * e, _stack_t(shape))
  return rules


def sigmoid_moe_rules(cfg: ModelConfig, p: str, names: set[str]) -> dict:
  """A DeepSeek-V3 / GLM-4.5 MoE block (jspec.models.moe.MoE with sigmoid routing): the router
  `{p}mlp.gate.weight` and its `e_score_correction_bias`, the routed experts (per-expert or
  fused keys, as `expert_rules`), and the ungated `{p}mlp.shared_experts.*`."""
  rules = expert_rules(cfg, p, names)
  e = cfg.moe.num_experts
  if cfg.moe.router_correction_bias:
    rules[("correction_bias",)] = _rule(p + "mlp.gate.e_score_correction_bias", (e,),
                                        _copy((e,)))
  if cfg.moe.num_shared_experts:
    rules.update(prefixed(("shared_experts",), dense_mlp_rules(
        p + "mlp.shared_experts.", cfg.hidden_size,
        cfg.moe.intermediate_size * cfg.moe.num_shared_experts)))
  return rules


def prefixed(prefix: Path, rules: dict) -> dict:
  return {prefix + path: rule for path, rule in rules.items()}


def embedding_rules(cfg: ModelConfig, final_norm: str) -> dict:
  """Embedding, final norm and (untied) lm_head of a causal LM at `cfg.weight_prefix`."""
  d, v, p = cfg.hidden_size, cfg.vocab_size, cfg.weight_prefix
  rules = {("embed",): _rule(p + "embed_tokens.weight", (v, d), _copy((v, d))),
           ("final_norm", "scale"): norm_rule(p + final_norm, d)}
  if not cfg.tie_word_embeddings:
    rules[("lm_head",)] = _rule("lm_head.weight", (v, d), _linear_t((d, v)))
  return rules


def mtp_rules(cfg: ModelConfig, spec: MTPSpec, decoder_rules: Callable) -> dict:
  """The MTP head's rules; `decoder_rules(prefix, is_moe)` is the family's full-attention
  decoder layer (the MTP layer is one)."""
  d, v = cfg.hidden_size, cfg.vocab_size
  rules = {}
  for j in range(spec.num_layers):
    if spec.layout == "qwen3_next":
      norms = ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight")
      proj, decoder_prefix = "mtp.fc.weight", f"mtp.layers.{j}."
    else:
      q = f"{cfg.weight_prefix}layers.{cfg.num_layers + j}."
      norms = (q + "enorm.weight", q + "hnorm.weight", q + "shared_head.norm.weight")
      proj, decoder_prefix = q + "eh_proj.weight", q
      if spec.has_own_head:
        rules[("layers", j, "head")] = _rule(q + "shared_head.head.weight", (v, d),
                                             _linear_t((d, v)))
      if spec.has_own_embed:
        rules[("layers", j, "embed")] = _rule(q + "embed_tokens.weight", (v, d), _copy((v, d)))
    for ours, name in zip(("embed_norm", "hidden_norm", "final_norm"), norms):
      rules[("layers", j, ours, "scale")] = norm_rule(name, d)
    rules[("layers", j, "proj")] = _rule(proj, (d, 2 * d), _linear_t((2 * d, d)))
    rules.update(prefixed(("layers", j, "decoder"), decoder_rules(decoder_prefix, spec.is_moe)))
  return rules


# Names a checkpoint may carry that jspec has no use for. (A DeepSeek-layout MTP layer's copies
# of the embedding and head are not among them: loading compares them with the target's.)
_IGNORED = (re.compile(r".*rotary_emb\.inv_freq$"),)


def ignorable(name: str) -> bool:
  return any(p.match(name) for p in _IGNORED)


def detect_mtp(cfg: ModelConfig, names: set[str]) -> MTPSpec | None:
  """Finds the MTP layout and layer count from tensor names; None if the checkpoint has none."""
  qwen_layers = {int(m.group(1)) for n in names if (m := re.match(r"^mtp\.layers\.(\d+)\.", n))}
  ds_pattern = "^" + re.escape(cfg.weight_prefix) + r"layers\.(\d+)\.eh_proj\.weight$"
  ds_layers = {int(m.group(1)) - cfg.num_layers for n in names if (m := re.match(ds_pattern, n))}
  if qwen_layers and ds_layers:
    raise ValueError("checkpoint has MTP weights in both the Qwen3-Next and DeepSeek-V3 layouts")
  if not qwen_layers and not ds_layers:
    return None
  layout = "qwen3_next" if qwen_layers else "deepseek_v3"
  found = qwen_layers or ds_layers
  if found != set(range(len(found))):
    raise ValueError(f"MTP layers {sorted(found)} are not numbered 0..{len(found) - 1}")
  if cfg.mtp is not None and cfg.mtp.num_layers != len(found):
    raise ValueError(f"config declares {cfg.mtp.num_layers} MTP layers but the weights hold "
                     f"{len(found)}")
  first = ("mtp.layers.0." if layout == "qwen3_next"
           else f"{cfg.weight_prefix}layers.{cfg.num_layers}.")
  is_moe = first + "mlp.gate.weight" in names
  if is_moe and not cfg.is_moe:
    raise ValueError("MTP layer is MoE but the model config declares no experts")
  # Where the layer carries its own embedding / head, assume it is its own; loading keeps the
  # target's instead where the copies are byte-equal to it (`mtp_copies`).
  has = lambda suffix: layout == "deepseek_v3" and any(
      f"{cfg.weight_prefix}layers.{cfg.num_layers + j}.{suffix}" in names for j in found)
  return MTPSpec(layout=layout, num_layers=len(found), is_moe=is_moe,
                 has_own_head=has("shared_head.head.weight"),
                 has_own_embed=has("embed_tokens.weight"))


def mtp_copies(cfg: ModelConfig, spec: MTPSpec) -> dict[str, tuple[str, tuple[str, ...]]]:
  """DeepSeek layout: what each MTP layer's `embed_tokens` / `shared_head.head` may duplicate,
  as {"embed" | "head": (the target's tensor, the MTP layers' names of their copies)}."""
  if spec.layout != "deepseek_v3":
    return {}
  p = cfg.weight_prefix
  layers = [f"{p}layers.{cfg.num_layers + j}." for j in range(spec.num_layers)]
  head = p + "embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
  return {"embed": (p + "embed_tokens.weight", tuple(q + "embed_tokens.weight" for q in layers)),
          "head": (head, tuple(q + "shared_head.head.weight" for q in layers))}


"""Tiny Llama-3 / Mistral / Mixtral / Qwen2 checkpoints (llama3, llama3_tied, mistral, mixtral, qwen2)
with torch reference outputs from transformers' own classes.

Driven by scripts/make_fixtures.py (`--only llama3 ...`, `--check`); same requirements (torch +
transformers 5.17, CPU).  See tests/fixtures/README.md ("Llama / Mistral / Mixtral / Qwen2 fixtures").

Conventions shared with the other fixtures: weights from a seeded torch.Generator, float32, eager attention,
eager (per-expert loop) experts, a seed search until every reference position has a top-1 / top-2 logit margin
> 2e-3 (and, for Mixtral, every router decision a gap > 1e-4 between the 2nd and 3rd router logit),
reference.npz + reference.json, EOS chosen so that gen_1 stops at step 9-16.

What these add:
  - llama3: Llama-3.1's rope_type "llama3" with original_max_position_embeddings 64, so that at head_dim 32 the
    frequencies fall in all three bands (kept, interpolated, divided by `factor`); the config in the published
    Llama-3.1 spelling (`rope_theta` + `rope_scaling`); untied head.
  - llama3_tied: Llama-3.2-1B style tied embedding with llama3 rope (factor 32), odd vocabulary (381), and
    `attention_bias` (biases on q/k/v AND o_proj, LlamaAttention).
  - mistral: head_dim 32 != hidden / heads, sliding_window 80: every reference position is inside it (the
    build asserts so), so full attention is exact; jspec refuses max_model_len > 80.
  - mixtral: 4 experts top-2 (softmax, top-2 renormalised), published per-expert keys
    block_sparse_moe.experts.{e}.w1/w2/w3 (what save_pretrained writes back from transformers' fused
    experts.gate_up_proj / down_proj: checked), odd vocabulary (255).
  - qwen2: q/k/v biases, YaRN (factor 4 over 32 positions) in the published Qwen2.5 spelling
    (`rope_scaling: {"type": "yarn", ...}`), `use_sliding_window: false` next to `sliding_window: 32` and
    `max_window_layers: 1` (the window is unused: the references attend over up to 64 positions).
Each build measures how far the logits move when the scaled RoPE, the o_proj bias or Mixtral's top-2
renormalisation is switched off (reference.json "sensitivity"), and asserts it is far beyond the test tolerance.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil

import numpy as np
import safetensors
import torch
import transformers
from safetensors import safe_open
from transformers import (AutoConfig, AutoModelForCausalLM, GenerationConfig, LlamaConfig, MistralConfig,
                          MixtralConfig, Qwen2Config)
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

from fixture_deepseek_models import patched
from fixture_hybrid import generate, greedy_manual, margin, tensor_np
from fixture_hybrid_models import eager_experts

LOGITS_LENGTHS = (1, 13, 48)
PROMPT_LENGTHS = (3, 9, 40)
MAX_NEW_TOKENS = 24
MIN_MARGIN = 2e-3
MIN_ROUTER_GAP = 1e-4  # 2nd minus 3rd router logit (the top-2 boundary), as the hybrid fixtures bound it
MIN_SENSITIVITY = 0.05  # a switched-off feature must move some logit by more than this
CHECK_TOL = 1e-4  # a reloaded model takes other CPU BLAS paths (see fixture_hybrid.py)
INIT_STD, HEAD_STD = 0.15, 0.4
NORM_STD = 0.1  # RMSNorm weights: 1 + N(0, NORM_STD^2)
BIAS_STD = 0.1  # attention biases

torch.set_grad_enabled(False)

_COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               hidden_act="silu", rms_norm_eps=1e-5, initializer_range=0.15,  # informational: see reinit_
               bos_token_id=None, eos_token_id=None, pad_token_id=None)


# ----------------------------------------------------------------------------------------------
# fixture specifications
# ----------------------------------------------------------------------------------------------

def spec_llama3():
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    cfg = LlamaConfig(**_COMMON, vocab_size=320, intermediate_size=96, head_dim=32, max_position_embeddings=512,
                      tie_word_embeddings=False, attention_bias=False, mlp_bias=False, rope_parameters=rope,
                      architectures=["LlamaForCausalLM"])
    return dict(name="llama3", config=cfg, seed=71001, published_rope=True, drop_keys=())


def spec_llama3_tied():
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    cfg = LlamaConfig(**_COMMON, vocab_size=381, intermediate_size=128, max_position_embeddings=256,
                      tie_word_embeddings=True, attention_bias=True, mlp_bias=False, rope_parameters=rope,
                      architectures=["LlamaForCausalLM"])
    return dict(name="llama3_tied", config=cfg, seed=72001, published_rope=False, drop_keys=())


def spec_mistral():
    cfg = MistralConfig(**_COMMON, vocab_size=288, intermediate_size=128, head_dim=32, max_position_embeddings=160,
                        sliding_window=80, tie_word_embeddings=False,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                        architectures=["MistralForCausalLM"])
    return dict(name="mistral", config=cfg, seed=73001, published_rope=True, drop_keys=())


def spec_mixtral():
    # intermediate_size 32 per expert: the Pallas backend pads it to its 64-column tile (tp shards too)
    cfg = MixtralConfig(**_COMMON, vocab_size=255, intermediate_size=32, num_local_experts=4,
                        num_experts_per_tok=2, max_position_embeddings=256, sliding_window=None,
                        router_jitter_noise=0.0, tie_word_embeddings=False,
                        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                        architectures=["MixtralForCausalLM"])
    return dict(name="mixtral", config=cfg, seed=74001, published_rope=True, drop_keys=())


def spec_qwen2():
    rope = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32}
    cfg = Qwen2Config(**_COMMON, vocab_size=352, intermediate_size=96, max_position_embeddings=128,
                      use_sliding_window=False, sliding_window=32, max_window_layers=1, tie_word_embeddings=False,
                      rope_parameters=rope, architectures=["Qwen2ForCausalLM"])
    # published Qwen2 configs carry no layer_types (transformers derives them) and keep the window's size
    return dict(name="qwen2", config=cfg, seed=75001, published_rope=True, drop_keys=("layer_types",),
                extra_config={"sliding_window": 32})


LLAMA_SPECS = [spec_llama3, spec_llama3_tied, spec_mistral, spec_mixtral, spec_qwen2]
LLAMA_NAMES = [s()["name"] for s in LLAMA_SPECS]


class NearTie(Exception):
    pass


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------

def reinit_(model, gen):
    """Deterministic re-initialisation by sorted parameter name (transformers' init may change)."""
    tied = model.config.tie_word_embeddings
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        randn = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if name == "lm_head.weight" or (tied and name.endswith("embed_tokens.weight")):
            p.copy_(HEAD_STD * randn)
        elif name.endswith("norm.weight"):
            p.copy_(1.0 + NORM_STD * randn)
        elif name.endswith(".bias"):
            p.copy_(BIAS_STD * randn)
        elif p.dim() >= 2:
            p.copy_(INIT_STD * randn)
        else:
            raise AssertionError(f"no init rule for {name} {tuple(p.shape)}")


def forward_logits(model, ids):
    return model(ids[None], use_cache=False).logits[0]


class RouterGaps:
    """min over every routed token of (2nd - 3rd router logit): the top-2 choice is robust to fp32 error."""

    def __init__(self, model):
        self.min_gap, self.rows = math.inf, 0
        self.handles = [m.register_forward_hook(self._hook) for m in model.modules()
                        if isinstance(m, MixtralTopKRouter)]

    def _hook(self, mod, inputs, outputs):
        top = torch.topk(outputs[0].float(), mod.top_k + 1, dim=-1).values
        self.min_gap = min(self.min_gap, float((top[..., mod.top_k - 1] - top[..., mod.top_k]).min()))
        self.rows += top.shape[0]

    def remove(self):
        for h in self.handles:
            h.remove()


def _router_without_renormalising(self, hidden_states):
    """MixtralTopKRouter.forward with the top-2 weights left as softmax probabilities."""
    router_logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
    probs = torch.nn.functional.softmax(router_logits.float(), dim=-1)
    top_value, top_index = torch.topk(probs, self.top_k, dim=-1)
    return router_logits, top_value, top_index


def sensitivity(model, seq):
    """Largest logit change on seq when the scaled RoPE, Llama's o_proj bias or Mixtral's top-2
    renormalisation is switched off."""
    base = forward_logits(model, seq)
    rot, out = model.model.rotary_emb, {}
    params = model.config.rope_parameters
    if params["rope_type"] != "default":
        dim = 2 * rot.inv_freq.shape[0]
        plain = 1.0 / params["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim)
        with patched([rot], inv_freq=lambda f: plain, attention_scaling=1.0):
            out[f"plain_rope_instead_of_{params['rope_type']}"] = float((forward_logits(model, seq) - base).abs().max())
    o_projs = [m.self_attn.o_proj for m in model.model.layers if m.self_attn.o_proj.bias is not None]
    if o_projs:
        with patched(o_projs, bias=torch.zeros_like):
            out["no_o_proj_bias"] = float((forward_logits(model, seq) - base).abs().max())
    if any(isinstance(m, MixtralTopKRouter) for m in model.modules()):
        original = MixtralTopKRouter.forward
        MixtralTopKRouter.forward = _router_without_renormalising
        try:
            out["top2_not_renormalised"] = float((forward_logits(model, seq) - base).abs().max())
        finally:
            MixtralTopKRouter.forward = original
    torch.testing.assert_close(forward_logits(model, seq), base, rtol=0, atol=0)  # restored
    return out


def rope_record(model):
    rot = model.model.rotary_emb
    params = {k: v for k, v in model.config.rope_parameters.items() if k != "type"}
    return {"rope_parameters": params, "inv_freq": rot.inv_freq.tolist(),
            "cos_sin_attention_factor": rot.attention_scaling}


def verify_layout(names, cfg):
    """The published names: Llama-style attention (o_proj bias only with Llama's attention_bias, q/k/v biases
    for Qwen2), a dense `mlp.*` or Mixtral's per-expert `block_sparse_moe.experts.{e}.w1/w2/w3`, lm_head
    absent when tied, no rotary buffers."""
    names = set(names)
    arch = cfg.architectures[0]
    assert ("lm_head.weight" in names) == (not cfg.tie_word_embeddings)
    assert {"model.embed_tokens.weight", "model.norm.weight"} <= names
    assert not any("rotary_emb" in n for n in names)
    for l in range(cfg.num_hidden_layers):
        a = f"model.layers.{l}.self_attn."
        qkv_bias = arch == "Qwen2ForCausalLM" or getattr(cfg, "attention_bias", False)
        for p in ("q_proj", "k_proj", "v_proj"):
            assert f"{a}{p}.weight" in names and (f"{a}{p}.bias" in names) == qkv_bias, (a, p)
        assert (f"{a}o_proj.bias" in names) == bool(getattr(cfg, "attention_bias", False)), a
        m = f"model.layers.{l}.block_sparse_moe."
        if arch == "MixtralForCausalLM":
            want = {f"{m}gate.weight"} | {f"{m}experts.{e}.{w}.weight" for e in range(cfg.num_local_experts)
                                          for w in ("w1", "w2", "w3")}
            assert want <= names, sorted(want - names)
            assert not any(n.startswith(f"model.layers.{l}.mlp.") for n in names)
        else:
            assert {f"model.layers.{l}.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")} <= names
    assert not any("bias" in n and "mlp" in n for n in names)


# ----------------------------------------------------------------------------------------------
# build
# ----------------------------------------------------------------------------------------------

def build_llama(spec: dict, root: str):
    name, seed = spec["name"], spec["seed"]
    print(f"=== {name} (seed {seed})")
    gen = torch.Generator().manual_seed(seed)
    cfg = copy.deepcopy(spec["config"])
    model = eager_experts(AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                                            dtype=torch.float32).eval())
    cfg = model.config
    V, H = cfg.vocab_size, cfg.hidden_size
    reinit_(model, gen)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    dgen = torch.Generator().manual_seed(seed + 1)
    seqs = [torch.randint(0, V, (n,), generator=dgen) for n in LOGITS_LENGTHS]
    prompts = [torch.randint(0, V, (n,), generator=dgen) for n in PROMPT_LENGTHS]
    window = getattr(cfg, "sliding_window", None)
    if window is not None:  # Mistral: the references must stay where a sliding window changes nothing
        assert max(LOGITS_LENGTHS + tuple(n + MAX_NEW_TOKENS for n in PROMPT_LENGTHS)) <= window, (name, window)
    arrays, desc, min_margins = {}, {}, {}
    gaps = RouterGaps(model)

    for i, s in enumerate(seqs):
        lg = forward_logits(model, s)
        hid = model.model(s[None], use_cache=False).last_hidden_state[0]
        torch.testing.assert_close(model.lm_head(hid), lg, rtol=1e-5, atol=1e-5)
        arrays[f"seq_{i}"] = s.numpy().astype(np.int32)
        arrays[f"logits_{i}"] = tensor_np(lg)
        arrays[f"hidden_{i}"] = tensor_np(hid)
        desc[f"seq_{i}"] = f"int32 [{len(s)}] random token ids (torch.randint, generator seed {seed + 1})"
        desc[f"logits_{i}"] = f"float32 [{len(s)}, {V}] target logits for seq_{i} (full forward, no cache)"
        desc[f"hidden_{i}"] = (f"float32 [{len(s)}, {H}] target final hidden states for seq_{i}, AFTER the final "
                               "norm (model.model(...).last_hidden_state)")
        min_margins[f"logits_{i}"] = float(margin(lg).min())

    noeos = []
    for i, p in enumerate(prompts):
        g = generate(model, p, None)
        m_ids, m_margins = greedy_manual(model, p, MAX_NEW_TOKENS)
        if not torch.equal(g, m_ids):
            if min(m_margins) > MIN_MARGIN:
                raise AssertionError(f"{name}: generate() != cache-free greedy without a near-tie (prompt {i})")
            raise NearTie(f"{name}: generate() != cache-free greedy for prompt {i}")
        noeos.append(g)
        min_margins[f"greedy_prompt_{i}"] = min(m_margins)
    cont = noeos[1].tolist()
    eos = next((cont[j] for j in range(8, 16) if cont[j] not in cont[:j]), None)
    if eos is None:
        raise NearTie(f"{name}: no fresh token in steps 8-15 of prompt_1's continuation to use as EOS")
    cfg.eos_token_id = eos
    model.generation_config = GenerationConfig(eos_token_id=eos, do_sample=False)
    print(f"  eos_token_id = {eos}")
    for i, p in enumerate(prompts):
        g = generate(model, p, eos)
        full = noeos[i].tolist()
        assert g.tolist() == (full[: full.index(eos) + 1] if eos in full else full), (name, i)
        arrays[f"prompt_{i}"] = p.numpy().astype(np.int32)
        arrays[f"gen_{i}"] = g.numpy().astype(np.int32)
        arrays[f"gen_noeos_{i}"] = noeos[i].numpy().astype(np.int32)
        arrays[f"gen_stopped_on_eos_{i}"] = np.array(bool(int(g[-1]) == eos))
        desc[f"prompt_{i}"] = f"int32 [{len(p)}] random prompt ids (generator seed {seed + 1}, after the seq_* draws)"
        desc[f"gen_{i}"] = (f"int32 new tokens of model.generate(prompt_{i}[None], do_sample=False, "
                            f"max_new_tokens={MAX_NEW_TOKENS}, eos_token_id={eos}); includes the EOS token when it "
                            "stopped on EOS")
        desc[f"gen_noeos_{i}"] = (f"int32 [{MAX_NEW_TOKENS}] same greedy run with eos_token_id=None (always full "
                                  "length); equal to a cache-free re-forward greedy loop")
        desc[f"gen_stopped_on_eos_{i}"] = f"bool scalar: gen_{i} ended because EOS was generated"
    assert arrays["gen_stopped_on_eos_1"] and 9 <= len(arrays["gen_1"]) <= 16
    router = {"min_gap_2nd_3rd_logit": gaps.min_gap, "routed_token_rows": gaps.rows} if gaps.handles else None
    gaps.remove()

    for k, v in min_margins.items():
        if not v > MIN_MARGIN:
            raise NearTie(f"{name}: near-tie in {k} (margin {v:.2e})")
    if router is not None and not router["min_gap_2nd_3rd_logit"] > MIN_ROUTER_GAP:
        raise NearTie(f"{name}: router gap {router['min_gap_2nd_3rd_logit']:.2e}")
    sens = sensitivity(model, seqs[2])
    for k, v in sens.items():
        assert v > MIN_SENSITIVITY, (name, k, v)
    print("  min margins:", {k: round(v, 4) for k, v in min_margins.items()})
    print("  router:", router, " sensitivity:", {k: round(v, 3) for k, v in sens.items()})

    # ---- write: save_pretrained, which writes the published names (Mixtral: per-expert w1/w2/w3)
    d = os.path.join(root, name)
    if os.path.isdir(d):
        shutil.rmtree(d)
    model.save_pretrained(d)
    weights = os.path.join(d, "model.safetensors")
    with safe_open(weights, "pt") as f:
        names = list(f.keys())
        assert all(f.get_slice(k).get_dtype() == "F32" for k in names)
    verify_layout(names, cfg)
    os.chmod(weights, 0o644)
    cfg_path = os.path.join(d, "config.json")
    cj = json.load(open(cfg_path))
    for k in spec["drop_keys"]:
        cj.pop(k)
    cj.update(spec.get("extra_config", {}))
    if spec["published_rope"]:  # the published spelling: top-level rope_theta, rope_scaling
        rp = dict(cj.pop("rope_parameters"))
        cj["rope_theta"] = rp.pop("rope_theta")
        rope_type = rp.pop("rope_type")
        cj["rope_scaling"] = None if rope_type == "default" else (
            {"type": rope_type, **rp} if rope_type == "yarn" else {"rope_type": rope_type, **rp})
    json.dump(cj, open(cfg_path, "w"), indent=2, sort_keys=True)
    np.savez_compressed(os.path.join(d, "reference.npz"), **arrays)

    ref = {
        "fixture": name,
        "generated_by": "scripts/make_fixtures.py (scripts/fixture_llama.py)",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "safetensors": safetensors.__version__, "numpy": np.__version__},
        "architecture": cj["architectures"][0],
        "attn_implementation": "eager",
        "experts_implementation": "eager" if router is not None else None,
        "dtype": "float32",
        "weight_seed": seed,
        "data_seed": seed + 1,
        "init": {"matrices": f"N(0, {INIT_STD}^2) (router and experts included)",
                 "output_heads": f"N(0, {HEAD_STD}^2) (lm_head; embed_tokens when tied)",
                 "rmsnorm_weights": f"1 + N(0, {NORM_STD}^2)",
                 "attention_biases": f"N(0, {BIAS_STD}^2)"},
        "eos_token_id": eos,
        "max_new_tokens": MAX_NEW_TOKENS,
        "saved_with": "model.save_pretrained (transformers' own key layout on disk)",
        "expert_layout": ("per-expert: model.layers.{l}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight "
                          "(gate [I,H], up [I,H], down [H,I]); router block_sparse_moe.gate.weight"
                          if router is not None else None),
        "sliding_window": window,
        "max_position_used": max(LOGITS_LENGTHS + tuple(n + MAX_NEW_TOKENS for n in PROMPT_LENGTHS)) - 1,
        "rope": rope_record(model),
        "min_top1_top2_margin": min_margins,
        "router": router,
        "sensitivity_max_abs_dlogit": sens,
        "arrays": desc,
        "values": {k: v.tolist() for k, v in arrays.items() if v.dtype in (np.int32, np.bool_)},
    }
    json.dump(ref, open(os.path.join(d, "reference.json"), "w"), indent=2)
    return d


# ----------------------------------------------------------------------------------------------
# verification of what is on disk
# ----------------------------------------------------------------------------------------------

def check_llama(d: str):
    name = os.path.basename(d)
    ref = np.load(os.path.join(d, "reference.npz"))
    meta = json.load(open(os.path.join(d, "reference.json")))
    config = AutoConfig.from_pretrained(d)
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        verify_layout(list(f.keys()), config)
    model, info = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager", dtype=torch.float32,
                                                       output_loading_info=True)
    model = eager_experts(model).eval()
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert rope_record(model) == meta["rope"], (rope_record(model), meta["rope"])
    assert getattr(config, "sliding_window", None) == meta["sliding_window"], name
    if config.architectures[0] == "Qwen2ForCausalLM":  # use_sliding_window false: no layer slides
        assert config.sliding_window is None and set(config.layer_types) == {"full_attention"}
    worst = [0.0]

    def close(t, want):
        got = tensor_np(t)
        np.testing.assert_allclose(got, want, rtol=CHECK_TOL, atol=CHECK_TOL)
        worst[0] = max(worst[0], float(np.abs(got - want).max()))

    for i in range(len(LOGITS_LENGTHS)):
        s = torch.from_numpy(ref[f"seq_{i}"]).long()
        close(forward_logits(model, s), ref[f"logits_{i}"])
        close(model.model(s[None], use_cache=False).last_hidden_state[0], ref[f"hidden_{i}"])
    for i in range(len(PROMPT_LENGTHS)):
        p = torch.from_numpy(ref[f"prompt_{i}"]).long()
        assert generate(model, p, meta["eos_token_id"]).tolist() == ref[f"gen_{i}"].tolist(), (name, i)
        assert generate(model, p, None).tolist() == ref[f"gen_noeos_{i}"].tolist(), (name, i)
    assert model.generation_config.eos_token_id == meta["eos_token_id"]
    kib = os.path.getsize(os.path.join(d, "model.safetensors")) // 1024
    print(f"  {name}: reload OK ({kib} KiB weights, max |diff| to the saved arrays {worst[0]:.1e})")

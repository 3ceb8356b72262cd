"""Tiny DeepSeek-V3 / GLM-4.5 family checkpoints (glm4_moe, deepseek_v3, glm4_moe_lite) with torch
reference outputs from transformers' own classes, and NextN (MTP) references as vLLM computes them.

Driven by scripts/make_fixtures.py (`--only glm4_moe ...`, `--check`); same requirements (torch +
transformers 5.17, CPU).  See tests/fixtures/README.md ("DeepSeek-V3 / GLM-4.5 fixtures").

Conventions shared with the other fixtures: weights from a seeded torch.Generator, float32, eager
attention, eager (per-expert loop) experts, a seed search until every reference position has a top-1 /
top-2 logit margin > 2e-3 and every router decision has a gap > 2e-5 (between the kept and the first
dropped group score, and between the k-th and (k+1)-th biased expert score inside the kept groups),
reference.npz + reference.json, EOS chosen so that gen_1 stops at step 9-16.

What these add: sigmoid routing with a non-zero e_score_correction_bias, group-limited top-k and
routed_scaling_factor != 1 (the build counts the tokens where the group limit and the bias change the
chosen experts, and asserts there are some); MLA with and without q_lora_rank; YaRN with both mscales
!= 1 and interleaved RoPE (deepseek_v3); NextN layers under model.layers.{L + m}.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import safetensors
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from fixture_hybrid import generate, greedy_manual, margin, tensor_np
from fixture_hybrid_models import eager_experts
from fixture_mtp import split_experts
from fixture_deepseek_models import (  # noqa: F401  (DEEPSEEK_NAMES: re-exported to make_fixtures.py)
    DEEPSEEK_NAMES, DEEPSEEK_SPECS, FAMILY, NextNLayer, RouterAudit, build_model, mtp_crosscheck_model,
    mtp_crosscheck_transformers, mtp_forward, nextn_from_disk, nextn_state_dict, rope_record, sensitivity)

LOGITS_LENGTHS = (1, 13, 48)  # 48 > 32 = deepseek_v3's original_max_position_embeddings
PROMPT_LENGTHS = (3, 9, 40)
MAX_NEW_TOKENS = 24
MIN_MARGIN = 2e-3
MIN_ROUTER_GAP = 2e-5  # on sigmoid(+bias) scores, ~1e-4 in router logits (the hybrid fixtures' bound)
MIN_CHANGED_ROWS = 5  # the group limit / the bias must change the expert set of at least this many rows
CHECK_TOL = 1e-4  # a reloaded model takes other CPU BLAS paths (see fixture_hybrid.py)
INIT_STD, HEAD_STD = 0.15, 0.4
NORM_STD = 0.1  # plain-w RMSNorms: 1 + N(0, NORM_STD^2)
BIAS_STD = 0.1  # attention q/k/v biases (glm4_moe)
CORRECTION_STD = 0.1  # e_score_correction_bias: comparable to the spread of the sigmoid scores

torch.set_grad_enabled(False)


class NearTie(Exception):
    pass


def reinit_(module, gen, family, head_std):
    """Deterministic re-initialisation by sorted parameter name, by the module that owns it."""
    owner = {f"{m}.{p}" if m else p: mod for m, mod in module.named_modules()
             for p, _ in mod.named_parameters(recurse=False)}
    for name, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
        randn = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if name.endswith(("lm_head.weight", "shared_head.head.weight")):
            p.copy_(head_std * randn)
        elif isinstance(owner[name], FAMILY[family]["norm"]):
            p.copy_(1.0 + NORM_STD * randn)
        elif name.endswith(".bias"):
            p.copy_(BIAS_STD * randn)
        elif p.dim() >= 2:
            p.copy_(INIT_STD * randn)
        else:
            raise AssertionError(f"no init rule for {name} {tuple(p.shape)}")
    for name, b in sorted(module.named_buffers(), key=lambda kv: kv[0]):
        if name.endswith("e_score_correction_bias"):
            b.copy_(CORRECTION_STD * torch.randn(b.shape, generator=gen, dtype=torch.float32))


def forward_logits(model, ids):
    return model(ids[None], use_cache=False).logits[0]


# ----------------------------------------------------------------------------------------------
# build
# ----------------------------------------------------------------------------------------------

def build_deepseek(spec: dict, root: str):
    name, seed, family = spec["name"], spec["seed"], spec["family"]
    print(f"=== {name} (seed {seed})")
    gen = torch.Generator().manual_seed(seed)
    model = build_model(spec)
    cfg = model.config
    V, H, L = cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers
    reinit_(model, gen, family, HEAD_STD)
    nextn = []
    for _ in range(spec["mtp_layers"]):
        layer = NextNLayer(family, cfg).eval()
        reinit_(layer, gen, family, HEAD_STD)
        if spec["mtp_embed"] == "copy":
            layer.embed_tokens.weight.copy_(model.model.embed_tokens.weight)
        if spec["mtp_head"] == "copy":
            layer.shared_head.head.weight.copy_(model.lm_head.weight)
        nextn.append(layer)

    dgen = torch.Generator().manual_seed(seed + 1)
    seqs = [torch.randint(0, V, (n,), generator=dgen) for n in LOGITS_LENGTHS]
    prompts = [torch.randint(0, V, (n,), generator=dgen) for n in PROMPT_LENGTHS]
    arrays, desc, min_margins = {}, {}, {}

    # the tokens of the reference sequences and prompts: how often the group limit and the bias matter
    audit = RouterAudit(model, family)
    for s in seqs + prompts:
        forward_logits(model, s)
    routing = {"target": audit.summary()}
    audit.remove()
    gaps = RouterAudit(model, family)  # every forward below, generate() included

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
        stopped = bool(int(g[-1]) == eos)
        arrays[f"prompt_{i}"] = p.numpy().astype(np.int32)
        arrays[f"gen_{i}"] = g.numpy().astype(np.int32)
        arrays[f"gen_noeos_{i}"] = noeos[i].numpy().astype(np.int32)
        arrays[f"gen_stopped_on_eos_{i}"] = np.array(stopped)
        desc[f"prompt_{i}"] = f"int32 [{len(p)}] random prompt ids (generator seed {seed + 1}, after the seq_* draws)"
        desc[f"gen_{i}"] = (f"int32 new tokens of model.generate(prompt_{i}[None], do_sample=False, "
                            f"max_new_tokens={MAX_NEW_TOKENS}, eos_token_id={eos}); includes the EOS token when it "
                            "stopped on EOS")
        desc[f"gen_noeos_{i}"] = (f"int32 [{MAX_NEW_TOKENS}] same greedy run with eos_token_id=None (always full "
                                  "length); equal to a cache-free re-forward greedy loop")
        desc[f"gen_stopped_on_eos_{i}"] = f"bool scalar: gen_{i} ended because EOS was generated"
    assert arrays["gen_stopped_on_eos_1"] and 9 <= len(arrays["gen_1"]) <= 16

    maudit = RouterAudit(torch.nn.ModuleList(nextn), family)
    zeroing = 0.0
    for m, layer in enumerate(nextn):
        pre = "mtp" if m == 0 else f"mtp{m}"
        for i in (1, 2):
            s, hid = seqs[i], torch.from_numpy(arrays[f"hidden_{i}"])[:-1]
            lg, y = mtp_forward(model, layer, s, hid)
            lg2, y2 = mtp_crosscheck_model(model, layer, s, hid)
            lg3, normed = mtp_crosscheck_transformers(model, family, layer, s, hid)
            for a, b in ((lg, lg2), (y, y2), (lg, lg3), (layer.shared_head.norm(y), normed)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            n = s.shape[0] - 1
            arrays[f"{pre}_logits_{i}"] = tensor_np(lg)
            arrays[f"{pre}_hidden_{i}"] = tensor_np(y)
            desc[f"{pre}_logits_{i}"] = (
                f"float32 [{n}, {V}] logits of NextN layer {m} (model.layers.{L + m}); row j pairs hidden_{i}[j] with "
                f"embed(seq_{i}[j+1]) at RoPE position j (the embedding of row 0 zeroed, as vLLM does) and predicts "
                f"seq_{i}[j+2]; logits = shared_head.head(shared_head.norm(mtp{'' if m == 0 else m}_hidden))")
            desc[f"{pre}_hidden_{i}"] = (f"float32 [{n}, {H}] NextN layer {m}'s output y (the residual stream, BEFORE "
                                         "shared_head.norm; the hidden state fed back for later draft steps)")
            min_margins[f"{pre}_logits_{i}"] = float(margin(lg).min())
    routing["mtp"] = maudit.summary()
    maudit.remove()
    for m, layer in enumerate(nextn):  # what forgetting vLLM's position-0 zeroing would change
        key = "mtp" if m == 0 else f"mtp{m}"
        for i in (1, 2):
            lg = mtp_forward(model, layer, seqs[i], torch.from_numpy(arrays[f"hidden_{i}"])[:-1], zero_first=False)[0]
            zeroing = max(zeroing, float(np.abs(tensor_np(lg) - arrays[f"{key}_logits_{i}"]).max()))
    routing["target_gaps_all_forwards"] = gaps.summary()
    gaps.remove()

    for k, v in min_margins.items():
        if not v > MIN_MARGIN:
            raise NearTie(f"{name}: near-tie in {k} (margin {v:.2e})")
    for where in ("target_gaps_all_forwards", "mtp"):
        for k in ("min_group_gap", "min_expert_gap"):
            if not routing[where][k] > MIN_ROUTER_GAP:
                raise NearTie(f"{name}: {where} {k} {routing[where][k]:.2e}")
    for where in ("target", "mtp"):
        for k in ("group_limit_changes_choice", "correction_bias_changes_choice"):
            assert routing[where][k] >= MIN_CHANGED_ROWS, (name, where, k, routing[where])
    sens = sensitivity(model, family, seqs[2])
    sens["mtp_position0_not_zeroed"] = zeroing
    for k, v in sens.items():
        assert v > 0.05, (name, k, v)  # each feature moves the logits far beyond the test tolerance
    print("  min margins:", {k: round(v, 4) for k, v in min_margins.items()})
    print("  routing:", routing)
    print("  sensitivity:", {k: round(v, 3) for k, v in sens.items()})

    # ---- write
    d = os.path.join(root, name)
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    model.config.save_pretrained(d)
    model.generation_config.save_pretrained(d)
    cj = json.load(open(os.path.join(d, "config.json")))
    cj.update(spec["extra_config"])
    if spec["published_rope"]:  # the spelling of the published DeepSeek-V3 config
        rp = dict(cj.pop("rope_parameters"))
        cj["rope_theta"] = rp.pop("rope_theta")
        cj["rope_scaling"] = {"type": rp.pop("rope_type"), **rp}
        for k in ("head_dim", "qk_head_dim"):  # derived by DeepseekV3Config, absent from published configs
            cj.pop(k)
    json.dump(cj, open(os.path.join(d, "config.json"), "w"), indent=2, sort_keys=True)

    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    sd.update({k: v.detach().clone().contiguous() for k, v in nextn_state_dict(nextn, L).items()})
    sd = dict(sorted(split_experts(sd, cfg.moe_intermediate_size).items()))
    verify_layout(sd.keys(), spec, cfg)
    save_file(sd, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    os.chmod(os.path.join(d, "model.safetensors"), 0o644)
    np.savez_compressed(os.path.join(d, "reference.npz"), **arrays)

    equal = {"copy": "equal to (a stored copy of) {}", "own": "its own tensor, different from {}"}
    ref = {
        "fixture": name,
        "generated_by": "scripts/make_fixtures.py (scripts/fixture_deepseek.py)",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "safetensors": safetensors.__version__, "numpy": np.__version__},
        "architecture": cj["architectures"][0],
        "attn_implementation": "eager",
        "experts_implementation": "eager",
        "dtype": "float32",
        "weight_seed": seed,
        "data_seed": seed + 1,
        "init": {"matrices": f"N(0, {INIT_STD}^2) (router, experts, embed_tokens included)",
                 "output_heads": f"N(0, {HEAD_STD}^2) (lm_head, own shared_head.head)",
                 "rmsnorm_weights": f"1 + N(0, {NORM_STD}^2) (plain w: w * x / rms(x))",
                 "attention_biases": f"N(0, {BIAS_STD}^2)",
                 "e_score_correction_bias": f"N(0, {CORRECTION_STD}^2) (float32 buffer, saved)"},
        "eos_token_id": eos,
        "max_new_tokens": MAX_NEW_TOKENS,
        "mtp_layout": "deepseek_v3",
        "mtp_layers": [f"model.layers.{L + m}." for m in range(len(nextn))],
        "mtp_embed_tokens": equal[spec["mtp_embed"]].format("model.embed_tokens"),
        "mtp_shared_head_head": equal[spec["mtp_head"]].format("lm_head"),
        "mtp_position0": "the embedding at position 0 is zeroed before enorm (vLLM deepseek_mtp.py)",
        "expert_layout": "per-expert: model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight ([I,H],[I,H],[H,I])",
        "rope": rope_record(model),
        "min_top1_top2_margin": min_margins,
        "routing": routing,
        "sensitivity_max_abs_dlogit": sens,
        "arrays": desc,
        "values": {k: v.tolist() for k, v in arrays.items() if v.dtype in (np.int32, np.bool_)},
    }
    json.dump(ref, open(os.path.join(d, "reference.json"), "w"), indent=2)
    return d


def verify_layout(names, spec, cfg):
    """Published DeepSeek-V3 / GLM-4.5 names: per-expert experts, router bias, NextN layers after the target."""
    names, L = set(names), cfg.num_hidden_layers
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= names
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in names)
    for l in range(L + spec["mtp_layers"]):
        pre = f"model.layers.{l}."
        sparse = l >= 1
        assert (f"{pre}mlp.gate.e_score_correction_bias" in names) == sparse, pre
        assert (f"{pre}mlp.experts.15.down_proj.weight" in names) == sparse, pre
        assert (f"{pre}mlp.shared_experts.gate_proj.weight" in names) == sparse, pre
        assert (f"{pre}mlp.gate_proj.weight" in names) == (not sparse), pre
        nextn = {f"{pre}{k}" for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                                       "shared_head.head.weight", "embed_tokens.weight")}
        assert nextn <= names if l >= L else not nextn & names, pre
    assert not any(k.startswith(f"model.layers.{L + spec['mtp_layers']}.") for k in names)
    attn = "model.layers.0.self_attn."
    if getattr(cfg, "kv_lora_rank", None):  # MLA; q_proj only without q_lora_rank
        lora = cfg.q_lora_rank is not None
        assert f"{attn}kv_a_proj_with_mqa.weight" in names and f"{attn}kv_a_layernorm.weight" in names
        assert (f"{attn}q_a_proj.weight" in names) == (f"{attn}q_a_layernorm.weight" in names) == lora
        assert (f"{attn}q_proj.weight" in names) == (not lora)
    else:  # GQA with q/k/v biases and per-head q/k norms
        assert {f"{attn}{p}.{w}" for p in ("q_proj", "k_proj", "v_proj") for w in ("weight", "bias")} <= names
        assert f"{attn}q_norm.weight" in names and f"{attn}o_proj.bias" not in names


# ----------------------------------------------------------------------------------------------
# verification of what is on disk
# ----------------------------------------------------------------------------------------------

def check_deepseek(d: str):
    name = os.path.basename(d)
    spec = next(s() for s in DEEPSEEK_SPECS if s()["name"] == name)
    family = spec["family"]
    ref = np.load(os.path.join(d, "reference.npz"))
    meta = json.load(open(os.path.join(d, "reference.json")))
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        names = list(f.keys())
        assert all(f.get_slice(k).get_dtype() == "F32" for k in names)
    config = AutoConfig.from_pretrained(d)
    verify_layout(names, spec, config)
    rope = {k: v for k, v in config.rope_parameters.items() if k != "type"}
    assert rope == spec["config"].rope_parameters, (config.rope_parameters,)
    assert config.num_local_experts == 16 and config.n_group == 4 and config.topk_group == 2
    model, info = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager", dtype=torch.float32,
                                                       output_loading_info=True)
    model = eager_experts(model).eval()
    L = config.num_hidden_layers
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert all(k.startswith(tuple(meta["mtp_layers"])) for k in info["unexpected_keys"]), info["unexpected_keys"]
    assert rope_record(model) == meta["rope"], (rope_record(model), meta["rope"])
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
    p = torch.from_numpy(ref["prompt_2"]).long()
    assert greedy_manual(model, p, MAX_NEW_TOKENS)[0].tolist() == ref["gen_noeos_2"].tolist()

    audit = RouterAudit(model, family)  # also checks transformers' choice against route() again
    for s in [ref[f"seq_{i}"] for i in range(3)] + [ref[f"prompt_{i}"] for i in range(3)]:
        forward_logits(model, torch.from_numpy(s).long())
    got = audit.summary()
    audit.remove()
    for k in ("routed_token_rows", "group_limit_changes_choice", "correction_bias_changes_choice"):
        assert got[k] == meta["routing"]["target"][k], (k, got[k], meta["routing"]["target"])

    sd = load_file(os.path.join(d, "model.safetensors"))
    for m in range(spec["mtp_layers"]):
        layer = nextn_from_disk(sd, family, config, L, m)
        pre = f"model.layers.{L + m}."
        same_embed = torch.equal(sd[pre + "embed_tokens.weight"], sd["model.embed_tokens.weight"])
        same_head = torch.equal(sd[pre + "shared_head.head.weight"], sd["lm_head.weight"])
        assert same_embed == (spec["mtp_embed"] == "copy") and same_head == (spec["mtp_head"] == "copy")
        key = "mtp" if m == 0 else f"mtp{m}"
        for i in (1, 2):
            s = torch.from_numpy(ref[f"seq_{i}"]).long()
            hid = torch.from_numpy(ref[f"hidden_{i}"])[:-1]
            for fn in (mtp_forward, mtp_crosscheck_model):
                lg, y = fn(model, layer, s, hid)
                close(lg, ref[f"{key}_logits_{i}"])
                close(y, ref[f"{key}_hidden_{i}"])
            lg, _ = mtp_crosscheck_transformers(model, family, layer, s, hid)
            close(lg, ref[f"{key}_logits_{i}"])
    kib = os.path.getsize(os.path.join(d, "model.safetensors")) // 1024
    print(f"  {name}: reload OK ({kib} KiB weights, max |diff| to the saved arrays {worst[0]:.1e})")

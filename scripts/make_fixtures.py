#!/usr/bin/env python
"""Regenerate the tiny Hugging Face test checkpoints and their torch reference outputs.

HOW TO RUN (needs torch and transformers 5.17; NOT the jspec environment -- CI has no torch):

    python -m venv /tmp/torchenv
    /tmp/torchenv/bin/pip install torch==2.13.0 transformers==5.17.0 safetensors numpy tokenizers
    /tmp/torchenv/bin/python scripts/make_fixtures.py            # writes tests/fixtures/*
    /tmp/torchenv/bin/python scripts/make_fixtures.py --check    # only re-verify the saved fixtures
    /tmp/torchenv/bin/python scripts/make_fixtures.py --only qwen3_5_moe qwen3_next   # rebuild some

The hybrid Qwen3.5 / Qwen3-Next fixtures (qwen3_5_dense, qwen3_5_moe, qwen3_5_text, qwen3_5_moe_text,
qwen3_next) are specified, built and checked in scripts/fixture_hybrid.py, the DeepSeek-V3 / GLM-4.5 family
fixtures (glm4_moe, deepseek_v3, glm4_moe_lite) in scripts/fixture_deepseek.py, the Llama / Mistral / Mixtral /
Qwen2 fixtures (llama3, llama3_tied, mistral, mixtral, qwen2) in scripts/fixture_llama.py; this file dispatches
to them.

Every fixture directory under tests/fixtures/ gets:
    config.json, generation_config.json, model.safetensors   (a loadable HF checkpoint, float32)
    reference.npz                                             (reference arrays, see reference.json)
    reference.json                                            (versions, seeds, description of arrays)

Weights are drawn from a seeded torch.Generator (not transformers' own init, which may change
between versions): matrices ~ N(0, init_std), RMSNorm weights ~ 1 + N(0, 0.1) so that a missing or
misplaced norm is visible.  init_std is large (0.15-0.2) so that logits are peaked and greedy argmax
is robust; the script asserts a minimum top-1/top-2 logit margin at every greedy position and
every logits position.

MTP heads (not part of any transformers model class) are written as extra tensors in
model.safetensors; their reference outputs are computed from transformers' own building blocks
(decoder layer, RMSNorm, rotary embedding, nn.Linear), and cross-checked against a second path
(a 1-layer transformers model fed with inputs_embeds).  See tests/fixtures/README.md for the math.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys

import numpy as np
import torch
from torch import nn

import safetensors
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fixture_mtp import (DeepSeekMTPLayer, QwenNextMTP, mtp_forward,  # noqa: E402
                         mtp_forward_crosscheck, mtp_state_dict, split_experts)
from fixture_hybrid import HYBRID_NAMES, HYBRID_SPECS, build_hybrid, check_hybrid  # noqa: E402
from fixture_hybrid import NearTie as HybridNearTie  # noqa: E402
from fixture_deepseek import DEEPSEEK_NAMES, DEEPSEEK_SPECS, build_deepseek, check_deepseek  # noqa: E402
from fixture_deepseek import NearTie as DeepSeekNearTie  # noqa: E402
from fixture_llama import LLAMA_NAMES, LLAMA_SPECS, build_llama, check_llama  # noqa: E402
from fixture_llama import NearTie as LlamaNearTie  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_ROOT = os.path.join(REPO, "tests", "fixtures")

LOGITS_LENGTHS = (1, 7, 13)
PROMPT_LENGTHS = (3, 5, 9)
MAX_NEW_TOKENS = 24
MIN_MARGIN = 2e-3  # required top-1 minus top-2 logit gap at every reference position (fp32 error is ~1e-5)
NORM_JITTER = 0.1

torch.set_grad_enabled(False)


# ----------------------------------------------------------------------------------------------
# fixture specifications
# ----------------------------------------------------------------------------------------------

def spec_qwen3_dense():
    cfg = Qwen3Config(
        vocab_size=448,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # != hidden_size / num_attention_heads (= 16)
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 25000.0},
        initializer_range=0.15,
        bos_token_id=None,
        eos_token_id=None,  # chosen below from the greedy continuations
        architectures=["Qwen3ForCausalLM"],
    )
    return dict(name="qwen3_dense", config=cfg, seed=1234, init_std=0.15, head_std=0.6, mtp="qwen3_next",
                legacy_rope=False)


def spec_qwen3_dense_tied_legacy():
    cfg = Qwen3Config(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        initializer_range=0.2,
        eos_token_id=None,
        architectures=["Qwen3ForCausalLM"],
    )
    return dict(name="qwen3_dense_tied_legacy", config=cfg, seed=2345, init_std=0.2, head_std=0.6, mtp=None,
                legacy_rope=True)


def spec_qwen3_moe():
    cfg = Qwen3MoeConfig(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,  # used by the dense (mlp_only) layer
        moe_intermediate_size=64,  # a multiple of 64: the Pallas kernels run on it too
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[0],  # layer 0 is a dense MLP, layers 1 and 2 are sparse MoE
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        initializer_range=0.15,
        eos_token_id=None,
        architectures=["Qwen3MoeForCausalLM"],
    )
    return dict(name="qwen3_moe", config=cfg, seed=3456, init_std=0.15, head_std=0.6, mtp="deepseek_v3",
                legacy_rope=False)


SPECS = [spec_qwen3_dense, spec_qwen3_dense_tied_legacy, spec_qwen3_moe]


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------

class NearTie(Exception):
    pass


HEAD_NAMES = ("lm_head.weight", "shared_head.head.weight")


def reinit_(module: nn.Module, gen: torch.Generator, std: float, head_std: float, tied: bool = False):
    """Deterministic re-initialisation, independent of transformers' _init_weights.
    Output heads (and the embedding when tied) get head_std so that logits are peaked."""
    for name, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
        if name.endswith(HEAD_NAMES) or (tied and name.endswith("embed_tokens.weight")):
            p.copy_(head_std * torch.randn(p.shape, generator=gen, dtype=torch.float32))
        elif p.dim() == 1:  # RMSNorm weights (there are no biases in these configs)
            assert "norm" in name, name
            p.copy_(1.0 + NORM_JITTER * torch.randn(p.shape, generator=gen, dtype=torch.float32))
        elif p.dim() >= 2:
            p.copy_(std * torch.randn(p.shape, generator=gen, dtype=torch.float32))
        else:
            raise AssertionError(name)


def margin(logits: torch.Tensor) -> torch.Tensor:
    top2 = torch.topk(logits, 2, dim=-1).values
    return top2[..., 0] - top2[..., 1]


def tensor_np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().to(torch.float32).numpy()


def greedy_manual(model, prompt: torch.Tensor, steps: int):
    """Greedy decoding by full re-forward (no KV cache); returns ids and per-step top1-top2 margins."""
    ids = prompt.clone()
    margins = []
    for _ in range(steps):
        lg = model(ids[None]).logits[0, -1]
        margins.append(float(margin(lg)))
        ids = torch.cat([ids, lg.argmax()[None]])
    return ids[prompt.shape[0]:], margins


def generate(model, prompt: torch.Tensor, eos):
    """Greedy model.generate.  eos=None: EOS impossible (the model's own eos settings are blanked
    for the call, since generate() fills unset fields from model.generation_config)."""
    saved = (model.config.eos_token_id, model.generation_config.eos_token_id)
    if eos is None:
        model.config.eos_token_id = None
        model.generation_config.eos_token_id = None
    try:
        return _generate(model, prompt, eos)
    finally:
        model.config.eos_token_id, model.generation_config.eos_token_id = saved


def _generate(model, prompt: torch.Tensor, eos):
    gc = GenerationConfig(do_sample=False, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=eos,
                          pad_token_id=eos if eos is not None else 0)
    out = model.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]), generation_config=gc)
    return out[0, prompt.shape[0]:]


# ----------------------------------------------------------------------------------------------
# build one fixture
# ----------------------------------------------------------------------------------------------

def build(spec: dict, root: str):
    name, seed, std, kind = spec["name"], spec["seed"], spec["init_std"], spec["mtp"]
    cfg = copy.deepcopy(spec["config"])
    V, H, L = cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers
    print(f"=== {name} (seed {seed})")
    gen = torch.Generator().manual_seed(seed)

    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    reinit_(model, gen, std, spec["head_std"], tied=cfg.tie_word_embeddings)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    mtp = None
    if kind == "qwen3_next":
        mtp = QwenNextMTP(model.config).eval()
        reinit_(mtp, gen, std, spec["head_std"])
    elif kind == "deepseek_v3":
        mtp = DeepSeekMTPLayer(model.config, layer_idx=L).eval()
        reinit_(mtp, gen, std, spec["head_std"])

    # token data (separate generator so the weights do not depend on data choices)
    dgen = torch.Generator().manual_seed(seed + 1)
    seqs = [torch.randint(0, V, (n,), generator=dgen) for n in LOGITS_LENGTHS]
    prompts = [torch.randint(0, V, (n,), generator=dgen) for n in PROMPT_LENGTHS]

    arrays, desc = {}, {}
    min_margins = {}

    # logits + hidden
    for i, s in enumerate(seqs):
        out = model(s[None])
        lg = out.logits[0]
        hid = model.model(s[None]).last_hidden_state[0]
        arrays[f"seq_{i}"] = s.numpy().astype(np.int32)
        arrays[f"logits_{i}"] = tensor_np(lg)
        arrays[f"hidden_{i}"] = tensor_np(hid)
        desc[f"seq_{i}"] = f"int32 [{len(s)}] random token ids (torch.randint, generator seed {seed + 1})"
        desc[f"logits_{i}"] = f"float32 [{len(s)}, {V}] target logits for seq_{i} (full forward, no cache)"
        desc[f"hidden_{i}"] = (f"float32 [{len(s)}, {H}] target final hidden states for seq_{i}, AFTER the "
                               "final norm (model.model(...).last_hidden_state)")
        min_margins[f"logits_{i}"] = float(margin(lg).min())

    # greedy without EOS, then pick an EOS id that occurs mid-way in prompt_1's continuation
    noeos = []
    for i, p in enumerate(prompts):
        g = generate(model, p, None)
        m_ids, m_margins = greedy_manual(model, p, MAX_NEW_TOKENS)
        assert g.shape[0] == MAX_NEW_TOKENS, (name, i, g.shape)
        assert torch.equal(g, m_ids), f"{name}: generate() != manual greedy for prompt {i}"
        noeos.append(g)
        min_margins[f"greedy_prompt_{i}"] = min(m_margins)
    eos = None
    for c in (1, 2, 0):  # prefer stopping prompt_1 around step 8..15
        cont = noeos[c].tolist()
        for j in range(8, 16):
            if cont[j] not in cont[:j]:
                eos = cont[j]
                break
        if eos is not None:
            break
    if eos is None:
        raise NearTie(f"{name}: no fresh token to use as EOS with seed {seed}")
    model.config.eos_token_id = eos
    model.generation_config = GenerationConfig(eos_token_id=eos, do_sample=False)
    print(f"  eos_token_id = {eos}")

    for i, p in enumerate(prompts):
        g = generate(model, p, eos)
        stopped = bool(g.shape[0] > 0 and int(g[-1]) == eos and eos in g.tolist())
        # consistency with the EOS-free run: identical prefix, truncated after the first EOS
        full = noeos[i].tolist()
        exp = full[: full.index(eos) + 1] if eos in full else full
        assert g.tolist() == exp, (name, i, g.tolist(), exp)
        arrays[f"prompt_{i}"] = p.numpy().astype(np.int32)
        arrays[f"gen_{i}"] = g.numpy().astype(np.int32)
        arrays[f"gen_noeos_{i}"] = noeos[i].numpy().astype(np.int32)
        arrays[f"gen_stopped_on_eos_{i}"] = np.array(stopped)
        desc[f"prompt_{i}"] = f"int32 [{len(p)}] random prompt ids (generator seed {seed + 1}, after the seq_* draws)"
        desc[f"gen_{i}"] = (f"int32 new tokens of model.generate(prompt_{i}[None], do_sample=False, "
                            f"max_new_tokens={MAX_NEW_TOKENS}, eos_token_id={eos}); includes the EOS token "
                            "when it stopped on EOS")
        desc[f"gen_noeos_{i}"] = (f"int32 [{MAX_NEW_TOKENS}] same greedy run with eos_token_id=None (always full "
                                  "length); also equal to a cache-free re-forward greedy loop")
        desc[f"gen_stopped_on_eos_{i}"] = "bool scalar: gen_{i} ended because EOS was generated"

    # MTP
    if mtp is not None:
        for i in (1, 2):
            s = seqs[i]
            hid = torch.from_numpy(arrays[f"hidden_{i}"])[:-1]  # h_0..h_{n-1}
            lg, ho = mtp_forward(model, mtp, kind, s, hid)
            lg2, ho2 = mtp_forward_crosscheck(model, mtp, kind, s, hid)
            torch.testing.assert_close(lg, lg2, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ho, ho2, rtol=1e-5, atol=1e-5)
            n = s.shape[0] - 1
            arrays[f"mtp_logits_{i}"] = tensor_np(lg)
            arrays[f"mtp_hidden_{i}"] = tensor_np(ho)
            which = "AFTER mtp.norm" if kind == "qwen3_next" else "BEFORE shared_head.norm (decoder-layer output)"
            desc[f"mtp_logits_{i}"] = (f"float32 [{n}, {V}] MTP-head logits; row j uses embed(seq_{i}[j+1]) and "
                                       f"hidden_{i}[j] at RoPE position j and predicts seq_{i}[j+2]")
            desc[f"mtp_hidden_{i}"] = f"float32 [{n}, {H}] MTP-head output hidden state, {which}"
            min_margins[f"mtp_logits_{i}"] = float(margin(lg).min())

    for k, v in min_margins.items():
        if not v > MIN_MARGIN:
            raise NearTie(f"{name}: near-tie in {k} (margin {v:.2e}) with seed {seed}")
    print("  min top1-top2 margins:", {k: round(v, 4) for k, v in min_margins.items()})

    # ---- write the checkpoint
    d = os.path.join(root, name)
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    model.config.save_pretrained(d)
    model.generation_config.save_pretrained(d)
    cfg_path = os.path.join(d, "config.json")
    cj = json.load(open(cfg_path))
    if kind == "qwen3_next":
        cj["mtp_num_hidden_layers"] = 1
    elif kind == "deepseek_v3":
        cj["num_nextn_predict_layers"] = 1
    if spec["legacy_rope"]:
        rp = cj.pop("rope_parameters")
        assert rp.get("rope_type", "default") == "default"
        cj["rope_theta"] = rp["rope_theta"]
        cj["rope_scaling"] = None
    json.dump(cj, open(cfg_path, "w"), indent=2, sort_keys=True)

    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight")
    if kind == "deepseek_v3" or isinstance(cfg, Qwen3MoeConfig):
        sd = split_experts(sd, cfg.moe_intermediate_size)
    if mtp is not None:
        msd = {k: v.detach().clone().contiguous() for k, v in mtp_state_dict(mtp, kind, L).items()}
        if kind == "deepseek_v3":
            msd = split_experts(msd, cfg.moe_intermediate_size)
        assert not set(msd) & set(sd)
        sd.update(msd)
    save_file(dict(sorted(sd.items())), os.path.join(d, "model.safetensors"), metadata={"format": "pt"})

    np.savez_compressed(os.path.join(d, "reference.npz"), **arrays)
    ref = {
        "fixture": name,
        "generated_by": "scripts/make_fixtures.py",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "safetensors": safetensors.__version__, "numpy": np.__version__},
        "architecture": cj["architectures"][0],
        "attn_implementation": "eager",
        "dtype": "float32",
        "weight_seed": seed,
        "data_seed": seed + 1,
        "init": {"matrices": f"N(0, {std}^2)", "rmsnorm_weights": f"1 + N(0, {NORM_JITTER}^2)",
                 "output_heads": f"N(0, {spec['head_std']}^2) (lm_head / shared_head.head; embed_tokens when tied)"},
        "eos_token_id": eos,
        "max_new_tokens": MAX_NEW_TOKENS,
        "mtp_layout": kind,
        "expert_layout": ("per-expert: model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight"
                          if isinstance(cfg, Qwen3MoeConfig) else None),
        "min_top1_top2_margin": min_margins,
        "arrays": desc,
        "values": {k: v.tolist() for k, v in arrays.items() if v.dtype in (np.int32, np.bool_)},
    }
    json.dump(ref, open(os.path.join(d, "reference.json"), "w"), indent=2)
    return d


# ----------------------------------------------------------------------------------------------
# verification of what is on disk
# ----------------------------------------------------------------------------------------------

def check(d: str):
    name = os.path.basename(d)
    ref = np.load(os.path.join(d, "reference.npz"))
    meta = json.load(open(os.path.join(d, "reference.json")))
    cj = json.load(open(os.path.join(d, "config.json")))
    config = AutoConfig.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager", dtype=torch.float32).eval()
    theta = config.rope_parameters["rope_theta"]
    want_theta = cj["rope_theta"] if "rope_theta" in cj else cj["rope_parameters"]["rope_theta"]
    assert theta == want_theta, (name, theta, want_theta)
    if "Moe" in cj["architectures"][0]:
        want_e = cj.get("num_local_experts", cj.get("num_experts"))
        assert config.num_experts == want_e == config.num_local_experts, (name, want_e)
    for i in range(len(LOGITS_LENGTHS)):
        s = torch.from_numpy(ref[f"seq_{i}"]).long()
        lg = model(s[None]).logits[0]
        np.testing.assert_allclose(tensor_np(lg), ref[f"logits_{i}"], rtol=1e-5, atol=1e-5)
        hid = model.model(s[None]).last_hidden_state[0]
        np.testing.assert_allclose(tensor_np(hid), ref[f"hidden_{i}"], rtol=1e-5, atol=1e-5)
    for i in range(len(PROMPT_LENGTHS)):
        p = torch.from_numpy(ref[f"prompt_{i}"]).long()
        g = generate(model, p, meta["eos_token_id"])
        assert g.numpy().tolist() == ref[f"gen_{i}"].tolist(), (name, i)
        g = generate(model, p, None)
        assert g.numpy().tolist() == ref[f"gen_noeos_{i}"].tolist(), (name, i)
    # MTP weights: rebuild the head from the file and recompute
    kind = meta["mtp_layout"]
    if kind is not None:
        sd = load_file(os.path.join(d, "model.safetensors"))
        L = config.num_hidden_layers
        if kind == "qwen3_next":
            mtp = QwenNextMTP(model.config).eval()
            msd = {k[len("mtp."):]: v for k, v in sd.items() if k.startswith("mtp.")}
        else:
            mtp = DeepSeekMTPLayer(model.config, layer_idx=L).eval()
            pre = f"model.layers.{L}."
            msd = {}
            E = config.num_experts
            raw = {k[len(pre):]: v for k, v in sd.items() if k.startswith(pre)}
            gu = torch.stack([torch.cat([raw.pop(f"mlp.experts.{e}.gate_proj.weight"),
                                         raw.pop(f"mlp.experts.{e}.up_proj.weight")]) for e in range(E)])
            dn = torch.stack([raw.pop(f"mlp.experts.{e}.down_proj.weight") for e in range(E)])
            raw["mlp.experts.gate_up_proj"], raw["mlp.experts.down_proj"] = gu, dn
            for k, v in raw.items():
                top = k.split(".")[0]
                msd[k if top in ("enorm", "hnorm", "eh_proj", "shared_head") else "decoder." + k] = v
        mtp.load_state_dict(msd, strict=True)
        for i in (1, 2):
            s = torch.from_numpy(ref[f"seq_{i}"]).long()
            hid = torch.from_numpy(ref[f"hidden_{i}"])[:-1]
            lg, ho = mtp_forward(model, mtp, kind, s, hid)
            np.testing.assert_allclose(tensor_np(lg), ref[f"mtp_logits_{i}"], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(tensor_np(ho), ref[f"mtp_hidden_{i}"], rtol=1e-5, atol=1e-5)
    print(f"  {name}: reload OK ({os.path.getsize(os.path.join(d, 'model.safetensors')) // 1024} KiB weights)")


def make_moe_legacy(root: str):
    """qwen3_moe_legacy: the qwen3_moe checkpoint with the config in the spelling of the original
    Qwen3-MoE Hub checkpoints (`num_experts`, top-level `rope_theta`, `rope_scaling: null`) instead of
    what transformers 5.17 writes (`num_local_experts`, `rope_parameters`).  Weights and reference
    outputs are symlinks to ../qwen3_moe (identical model)."""
    src, d = os.path.join(root, "qwen3_moe"), os.path.join(root, "qwen3_moe_legacy")
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    cj = json.load(open(os.path.join(src, "config.json")))
    cj["num_experts"] = cj.pop("num_local_experts")
    rp = cj.pop("rope_parameters")
    assert rp.get("rope_type", "default") == "default"
    cj["rope_theta"] = rp["rope_theta"]
    cj["rope_scaling"] = None
    json.dump(cj, open(os.path.join(d, "config.json"), "w"), indent=2, sort_keys=True)
    shutil.copy(os.path.join(src, "generation_config.json"), d)
    for f in ("model.safetensors", "reference.npz", "reference.json"):
        os.symlink(os.path.join("..", "qwen3_moe", f), os.path.join(d, f))
    config = AutoConfig.from_pretrained(d)
    assert config.num_experts == cj["num_experts"] and config.num_local_experts == cj["num_experts"]
    return d


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=OUT_ROOT)
    ap.add_argument("--check", action="store_true", help="only verify the fixtures already on disk")
    ap.add_argument("--only", nargs="*", help="fixture names to (re)build")
    args = ap.parse_args()
    if not transformers.__version__.startswith("5.17"):
        print(f"warning: fixtures were made with transformers 5.17, this is {transformers.__version__}",
              file=sys.stderr)
    known = [s()["name"] for s in SPECS] + ["qwen3_moe_legacy"] + HYBRID_NAMES + DEEPSEEK_NAMES + LLAMA_NAMES
    unknown = sorted(set(args.only or []) - set(known))
    if unknown:
        raise SystemExit(f"unknown fixture(s) {unknown}; known: {known}")
    # Qwen3 fixtures (this file) and the hybrid Qwen3.5 / Qwen3-Next fixtures (fixture_hybrid.py)
    specs = [(s(), build, check) for s in SPECS] + [(s(), build_hybrid, check_hybrid) for s in HYBRID_SPECS]
    specs += [(s(), build_deepseek, check_deepseek) for s in DEEPSEEK_SPECS]
    specs += [(s(), build_llama, check_llama) for s in LLAMA_SPECS]
    if args.only:
        specs = [t for t in specs if t[0]["name"] in args.only]
    os.makedirs(args.out, exist_ok=True)
    for s, build_fn, check_fn in specs:
        d = os.path.join(args.out, s["name"])
        if not args.check:
            # deterministic seed search: the first seed without near-ties wins (recorded in reference.json)
            base = s["seed"]
            for attempt in range(20):
                s["seed"] = base + 100 * attempt
                try:
                    build_fn(s, args.out)
                    break
                except (NearTie, HybridNearTie, DeepSeekNearTie, LlamaNearTie) as e:
                    print(f"  {e}; trying next seed")
            else:
                raise SystemExit(f"{s['name']}: no seed without near-ties")
        check_fn(d)
    if not args.only or "qwen3_moe" in args.only or "qwen3_moe_legacy" in args.only:
        d = os.path.join(args.out, "qwen3_moe_legacy")
        if not args.check:
            make_moe_legacy(args.out)
        check(d)


if __name__ == "__main__":
    main()

"""Tiny hybrid (Gated DeltaNet + gated attention) checkpoints: Qwen3.5 (dense / MoE, multimodal and
text layouts) and Qwen3-Next, with torch reference outputs from transformers' own classes.

Driven by scripts/make_fixtures.py (`--only qwen3_5_dense ...`, `--check`); same requirements
(torch + transformers 5.17, CPU).  See tests/fixtures/README.md ("Hybrid fixtures") for what is in
each directory and for the MTP math.

Conventions shared with make_fixtures.py: weights from a seeded torch.Generator (independent of
transformers' _init_weights), float32, eager attention, a deterministic seed search (seed, seed+100,
...) until every reference position has a top-1/top-2 logit margin > 2e-3 (here also: every MoE
router has a gap > 1e-4 between its k-th and (k+1)-th logit at every token of every reference
forward, so the expert choice is robust), reference.npz + reference.json, and an EOS token chosen so
that gen_1 stops on EOS at step 8-15.

Differences from the Qwen3 fixtures:
  * the (1 + w) RMSNorms of these families (Qwen3_5RMSNorm / Qwen3_5MoeRMSNorm / Qwen3NextRMSNorm:
    layer norms, q/k norms, final norm, all MTP norms) get w ~ N(0, 0.1^2), centred on 0;
    the gated norm inside linear attention (RMSNormGated, plain w) gets 1 + N(0, 0.1^2);
  * A_log = log(A), A log-uniform over [0.02, 1] (stratified over the value heads of each layer, so
    every layer has mild and strong decays), dt_bias ~ N(0, 0.5^2), conv1d ~ N(0, 0.3^2);
  * sequences of length 1, 13, 100 (100 crosses the 64-token chunk of the chunked delta rule),
    prompts of length 3, 9, 70;
  * the recurrent state is shown to matter: reference.json records how much the logits change when
    the linear-attention state is dropped at the 64-token boundary and during decode.
"""

from __future__ import annotations

import json
import math
import os
import shutil

import numpy as np
import safetensors
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from fixture_mtp import split_experts
from fixture_hybrid_models import (  # noqa: F401  (HYBRID_NAMES: re-exported to make_fixtures.py)
    FAMILY, HYBRID_NAMES, HYBRID_SPECS, HybridMTP, build_model, check_zero_centred_norm,
    eager_experts, mtp_forward, mtp_forward_crosscheck, rope_position_ids, text_config, text_model)

LOGITS_LENGTHS = (1, 13, 100)
PROMPT_LENGTHS = (3, 9, 70)
MAX_NEW_TOKENS = 24
MIN_MARGIN = 2e-3  # top-1 minus top-2 logit gap at every reference position (fp32 error ~1e-5)
MIN_ROUTER_GAP = 1e-4  # gap between the k-th and (k+1)-th router logit (top-k boundary)
# --check compares a model reloaded from disk with the saved arrays.  Same weights, same code, but not
# bit-identical: CPU BLAS takes other paths for the (mmapped, differently aligned) loaded tensors, and the
# ~1e-7 relative differences grow to ~1.5e-5 in logits of magnitude ~10 through the MoE + recurrent layers.
CHECK_TOL = 1e-4
NORM_STD = 0.1  # (1 + w) norms: w ~ N(0, NORM_STD^2); RMSNormGated: 1 + N(0, NORM_STD^2)
A_RANGE = (0.02, 1.0)  # A = exp(A_log), log-uniform, stratified per layer
DT_BIAS_STD = 0.5
CONV_STD = 0.3
VISION_BIAS_STD = 0.02
CHUNK = 64  # transformers' chunk_size of torch_chunk_gated_delta_rule

torch.set_grad_enabled(False)


class NearTie(Exception):
    pass


# ----------------------------------------------------------------------------------------------
# initialisation
# ----------------------------------------------------------------------------------------------

def reinit_(model: nn.Module, gen: torch.Generator, family: str, std: float, head_std: float, tied: bool):
    """Deterministic re-initialisation by parameter name (sorted), by the module that owns it."""
    fam = FAMILY[family]
    owner = {}
    for mname, mod in model.named_modules():
        for pname, _ in mod.named_parameters(recurse=False):
            owner[f"{mname}.{pname}" if mname else pname] = mod
    seen = set()
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if id(p) in seen:
            continue
        seen.add(id(p))
        mod = owner[name]
        leaf = name.rsplit(".", 1)[-1]

        def randn(shape=p.shape):
            return torch.randn(shape, generator=gen, dtype=torch.float32)

        if name.endswith("lm_head.weight") or (tied and name.endswith("embed_tokens.weight")):
            p.copy_(head_std * randn())
        elif isinstance(mod, fam["norm"]):
            p.copy_(NORM_STD * randn())  # (1 + w): centred on 0
        elif isinstance(mod, fam["gated"]):
            p.copy_(1.0 + NORM_STD * randn())  # plain w
        elif isinstance(mod, fam["gdn"]) and leaf == "A_log":
            nv = p.shape[0]
            lo, hi = math.log(A_RANGE[0]), math.log(A_RANGE[1])
            u = (torch.arange(nv, dtype=torch.float32) + torch.rand(nv, generator=gen)) / nv  # stratified
            u = u[torch.randperm(nv, generator=gen)]
            p.copy_(lo + (hi - lo) * u)  # log A
        elif isinstance(mod, fam["gdn"]) and leaf == "dt_bias":
            p.copy_(DT_BIAS_STD * randn())
        elif isinstance(mod, nn.Conv1d):
            p.copy_(CONV_STD * randn())
        elif ".visual." in f".{name}" and isinstance(mod, nn.LayerNorm) and leaf == "weight":
            p.copy_(1.0 + NORM_STD * randn())
        elif ".visual." in f".{name}" and p.dim() == 1:
            p.copy_(VISION_BIAS_STD * randn())  # vision biases / LayerNorm biases
        elif p.dim() >= 2:
            p.copy_(std * randn())
        else:
            raise AssertionError(f"no init rule for {name} {tuple(p.shape)} ({type(mod).__name__})")


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------

def margin(logits):
    top2 = torch.topk(logits, 2, dim=-1).values
    return top2[..., 0] - top2[..., 1]


def tensor_np(t):
    return t.detach().cpu().to(torch.float32).numpy()


class RouterGapRecorder:
    """Records min over tokens of (k-th - (k+1)-th router logit) for every router call."""

    def __init__(self, model, family):
        self.min_gap = math.inf
        self.handles = []
        rcls = FAMILY[family]["router"]
        if rcls is None:
            return
        for mod in model.modules():
            if isinstance(mod, rcls):
                self.handles.append(mod.register_forward_hook(self._hook))

    def _hook(self, mod, inputs, outputs):
        logits = outputs[0]
        k = mod.top_k
        top = torch.topk(logits.float(), k + 1, dim=-1).values
        self.min_gap = min(self.min_gap, float((top[..., k - 1] - top[..., k]).min()))

    def remove(self):
        for h in self.handles:
            h.remove()


def greedy_manual(model, prompt, steps):
    """Greedy decoding by full re-forward without any cache; returns ids and per-step margins."""
    ids = prompt.clone()
    margins = []
    for _ in range(steps):
        lg = model(ids[None], use_cache=False).logits[0, -1]
        margins.append(float(margin(lg)))
        ids = torch.cat([ids, lg.argmax()[None]])
    return ids[prompt.shape[0]:], margins


def generate(model, prompt, eos):
    """Greedy model.generate (recurrent decode path with cache).  eos=None: EOS impossible."""
    tc = text_config(model.config)
    saved = (tc.eos_token_id, model.generation_config.eos_token_id)
    if eos is None:
        tc.eos_token_id = None
        model.generation_config.eos_token_id = None
    try:
        gc = GenerationConfig(do_sample=False, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=eos,
                              pad_token_id=eos if eos is not None else 0)
        out = model.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]), generation_config=gc)
        return out[0, prompt.shape[0]:]
    finally:
        tc.eos_token_id, model.generation_config.eos_token_id = saved


def forward_logits(model, ids):
    return model(ids[None], use_cache=False).logits[0]


def forward_hidden(model, ids):
    return text_model(model)(input_ids=ids[None], use_cache=False).last_hidden_state[0]


def _linear_cache_layers(cache):
    return [l for l in cache.layers if isinstance(l, LinearAttentionCacheLayerMixin)]


def state_sensitivity(model, seq, prompt, gen_noeos):
    """How much the recurrent state matters (recorded in reference.json; asserted to be large):
    (a) seq[:64] prefilled with cache, then seq[64:] with the cache -> equals the full forward (checked);
        the same with every linear-attention recurrent state zeroed at the boundary -> max |dlogit|;
    (b) prompt prefilled, then the first decode steps of gen_noeos fed one by one -> equals the full
        forward (checked); the same with the recurrent states zeroed after prefill -> max |dlogit|."""
    out = {}
    full = forward_logits(model, seq)
    for drop in (False, True):
        r = model(seq[None, :CHUNK], use_cache=True)
        if drop:
            for l in _linear_cache_layers(r.past_key_values):
                l.recurrent_states[0].zero_()
        r2 = model(seq[None, CHUNK:], past_key_values=r.past_key_values, use_cache=True)
        lg = torch.cat([r.logits[0], r2.logits[0]])
        if drop:
            out["chunk_boundary_state_dropped_max_abs_dlogit"] = float((lg[CHUNK:] - full[CHUNK:]).abs().max())
        else:
            torch.testing.assert_close(lg, full, rtol=1e-4, atol=1e-4)
    steps = 8
    ids = torch.cat([prompt, gen_noeos[:steps]])
    full = forward_logits(model, ids)[prompt.shape[0] - 1:]
    for drop in (False, True):
        r = model(prompt[None], use_cache=True)
        cache = r.past_key_values
        if drop:
            for l in _linear_cache_layers(cache):
                l.recurrent_states[0].zero_()
        lgs = [r.logits[0, -1]]
        for t in gen_noeos[:steps]:
            r = model(t.view(1, 1), past_key_values=cache, use_cache=True)
            lgs.append(r.logits[0, -1])
        lg = torch.stack(lgs)
        if drop:
            out["decode_state_dropped_max_abs_dlogit"] = float((lg[1:] - full[1:]).abs().max())
        else:
            torch.testing.assert_close(lg, full, rtol=1e-4, atol=1e-4)
    return out


def check_rope_is_plain(model, family):
    """With 1-D text positions, the model's rotary embedding (M-RoPE for Qwen3.5) is plain RoPE over
    the first head_dim * partial_rotary_factor dims, theta from rope_parameters."""
    tc = text_config(model.config)
    rp = tc.rope_parameters
    rot = int(tc.head_dim * rp["partial_rotary_factor"])
    n = 300
    x = torch.zeros(1, n, tc.hidden_size)
    tm = text_model(model)
    cos, sin = tm.rotary_emb(x, rope_position_ids(family, n))
    inv = 1.0 / (rp["rope_theta"] ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None]
    ang = torch.cat([ang, ang], -1)
    assert cos.shape[-1] == rot, (cos.shape, rot)
    torch.testing.assert_close(cos[0].double(), ang.cos(), rtol=0, atol=2e-5)
    torch.testing.assert_close(sin[0].double(), ang.sin(), rtol=0, atol=2e-5)
    return rot


# ----------------------------------------------------------------------------------------------
# state dict on disk
# ----------------------------------------------------------------------------------------------

def disk_state_dict(model, mtp, spec):
    cfg = text_config(model.config)
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight")
    sd.update({f"mtp.{k}": v.detach().clone().contiguous() for k, v in mtp.state_dict().items()})
    if spec["expert_layout"] == "per_expert":
        sd = split_experts(sd, cfg.moe_intermediate_size)
    return dict(sorted(sd.items()))


def verify_layout(names, spec):
    """The tensor names are exactly the published layout of this fixture."""
    cfg = text_config(spec["config"])
    pre = "model.language_model." if spec["layout"] == "multimodal" else "model."
    names = set(names)
    assert f"{pre}embed_tokens.weight" in names and f"{pre}norm.weight" in names
    assert ("lm_head.weight" in names) == (not cfg.tie_word_embeddings)
    assert any(k.startswith("model.visual.") for k in names) == (spec["layout"] == "multimodal")
    for k in names:
        assert k.startswith((pre, "model.visual.", "mtp.", "lm_head.")), k
    fused = [k for k in names if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    per = [k for k in names if ".experts." in k and k.endswith(("gate_proj.weight", "up_proj.weight",
                                                                  "down_proj.weight"))]
    if spec["expert_layout"] == "fused":
        assert fused and not per
    elif spec["expert_layout"] == "per_expert":
        assert per and not fused
    else:
        assert not fused and not per
    for k in ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
              "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight"):
        assert k in names, k
    if spec["family"] == "qwen3_next":
        assert any("linear_attn.in_proj_qkvz" in k for k in names)
    else:
        assert any("linear_attn.in_proj_qkv.weight" in k for k in names)


def mtp_from_disk(sd, family, tcfg):
    mtp = HybridMTP(family, tcfg).eval()
    msd = {k[len("mtp."):]: v for k, v in sd.items() if k.startswith("mtp.")}
    pre = "layers.0.mlp.experts."
    if f"{pre}0.gate_proj.weight" in msd:  # per-expert on disk -> fused in memory
        E = tcfg.num_experts
        gu = torch.stack([torch.cat([msd.pop(f"{pre}{e}.gate_proj.weight"), msd.pop(f"{pre}{e}.up_proj.weight")])
                          for e in range(E)])
        dn = torch.stack([msd.pop(f"{pre}{e}.down_proj.weight") for e in range(E)])
        msd[f"{pre}gate_up_proj"], msd[f"{pre}down_proj"] = gu, dn
    mtp.load_state_dict(msd, strict=True)
    return mtp


# ----------------------------------------------------------------------------------------------
# build one fixture
# ----------------------------------------------------------------------------------------------

def build_hybrid(spec: dict, root: str, init_std=0.15, head_std=0.4):
    name, seed, family = spec["name"], spec["seed"], spec["family"]
    fam = FAMILY[family]
    print(f"=== {name} (seed {seed})")
    check_zero_centred_norm(fam["norm"])
    gen = torch.Generator().manual_seed(seed)
    model = build_model(spec)
    tcfg = text_config(model.config)
    V, H = tcfg.vocab_size, tcfg.hidden_size
    reinit_(model, gen, family, init_std, head_std, tied=tcfg.tie_word_embeddings)
    if tcfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == text_model(model).embed_tokens.weight.data_ptr()
    mtp = HybridMTP(family, tcfg).eval()
    reinit_(mtp, gen, family, init_std, head_std, tied=False)
    rot = check_rope_is_plain(model, family)

    dgen = torch.Generator().manual_seed(seed + 1)
    # Text only: never the top 4 ids (image, video, vision start/end placeholders).
    seqs = [torch.randint(0, V - 4, (n,), generator=dgen) for n in LOGITS_LENGTHS]
    prompts = [torch.randint(0, V - 4, (n,), generator=dgen) for n in PROMPT_LENGTHS]

    arrays, desc, min_margins = {}, {}, {}
    router = RouterGapRecorder(model, family)

    for i, s in enumerate(seqs):
        lg = forward_logits(model, s)
        hid = forward_hidden(model, s)
        torch.testing.assert_close(model.lm_head(hid), lg, rtol=1e-5, atol=1e-5)
        arrays[f"seq_{i}"] = s.numpy().astype(np.int32)
        arrays[f"logits_{i}"] = tensor_np(lg)
        arrays[f"hidden_{i}"] = tensor_np(hid)
        desc[f"seq_{i}"] = f"int32 [{len(s)}] random token ids (torch.randint, generator seed {seed + 1})"
        desc[f"logits_{i}"] = f"float32 [{len(s)}, {V}] target logits for seq_{i} (full forward, no cache)"
        desc[f"hidden_{i}"] = (f"float32 [{len(s)}, {H}] final hidden states of the text model for seq_{i}, AFTER "
                               "the final norm (text model's last_hidden_state)")
        min_margins[f"logits_{i}"] = float(margin(lg).min())

    noeos = []
    for i, p in enumerate(prompts):
        g = generate(model, p, None)
        m_ids, m_margins = greedy_manual(model, p, MAX_NEW_TOKENS)
        assert g.shape[0] == MAX_NEW_TOKENS, (name, i, g.shape)
        if not torch.equal(g, m_ids):
            msg = f"{name}: generate() != cache-free greedy for prompt {i}: {g.tolist()} {m_ids.tolist()}"
            if min(m_margins) > MIN_MARGIN:
                raise AssertionError(msg + " without a near-tie: the cached decode path disagrees")
            raise NearTie(msg)
        noeos.append(g)
        min_margins[f"greedy_prompt_{i}"] = min(m_margins)
    eos = None
    for c in (1, 2, 0):
        cont = noeos[c].tolist()
        for j in range(8, 16):
            if cont[j] not in cont[:j]:
                eos = cont[j]
                break
        if eos is not None:
            break
    if eos is None:
        raise NearTie(f"{name}: no fresh token to use as EOS with seed {seed}")
    tcfg.eos_token_id = eos
    model.generation_config = GenerationConfig(eos_token_id=eos, do_sample=False)
    print(f"  eos_token_id = {eos}")

    for i, p in enumerate(prompts):
        g = generate(model, p, eos)
        stopped = bool(g.shape[0] > 0 and int(g[-1]) == eos)
        full = noeos[i].tolist()
        exp = full[: full.index(eos) + 1] if eos in full else full
        assert g.tolist() == exp, (name, i, g.tolist(), exp)
        if i == 1:
            assert stopped and 9 <= len(g) <= 16, (name, g.tolist())
        arrays[f"prompt_{i}"] = p.numpy().astype(np.int32)
        arrays[f"gen_{i}"] = g.numpy().astype(np.int32)
        arrays[f"gen_noeos_{i}"] = noeos[i].numpy().astype(np.int32)
        arrays[f"gen_stopped_on_eos_{i}"] = np.array(stopped)
        desc[f"prompt_{i}"] = f"int32 [{len(p)}] random prompt ids (generator seed {seed + 1}, after the seq_* draws)"
        desc[f"gen_{i}"] = (f"int32 new tokens of model.generate(prompt_{i}[None], do_sample=False, "
                            f"max_new_tokens={MAX_NEW_TOKENS}, eos_token_id={eos}) (cached recurrent decode); "
                            "includes the EOS token when it stopped on EOS")
        desc[f"gen_noeos_{i}"] = (f"int32 [{MAX_NEW_TOKENS}] same greedy run with eos_token_id=None (always full "
                                  "length); equal to a cache-free re-forward greedy loop")
        desc[f"gen_stopped_on_eos_{i}"] = f"bool scalar: gen_{i} ended because EOS was generated"

    for i in (1, 2):
        s = seqs[i]
        hid = torch.from_numpy(arrays[f"hidden_{i}"])[:-1]
        lg, ho = mtp_forward(model, mtp, family, s, hid)
        lg2, ho2 = mtp_forward_crosscheck(model, mtp, family, s, hid)
        torch.testing.assert_close(lg, lg2, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ho, ho2, rtol=1e-5, atol=1e-5)
        n = s.shape[0] - 1
        arrays[f"mtp_logits_{i}"] = tensor_np(lg)
        arrays[f"mtp_hidden_{i}"] = tensor_np(ho)
        desc[f"mtp_logits_{i}"] = (f"float32 [{n}, {V}] MTP-head logits; row j uses embed(seq_{i}[j+1]) and "
                                   f"hidden_{i}[j] at RoPE position j and predicts seq_{i}[j+2]")
        desc[f"mtp_hidden_{i}"] = f"float32 [{n}, {H}] MTP-head output hidden state, AFTER mtp.norm"
        min_margins[f"mtp_logits_{i}"] = float(margin(lg).min())

    router_gap = router.min_gap
    router.remove()
    # the MTP layer's router (MoE families) sees the MTP forwards only
    mrouter = RouterGapRecorder(mtp, family)
    for i in (1, 2):
        mtp_forward(model, mtp, family, seqs[i], torch.from_numpy(arrays[f"hidden_{i}"])[:-1])
    mtp_router_gap = mrouter.min_gap
    mrouter.remove()

    for k, v in min_margins.items():
        if not v > MIN_MARGIN:
            raise NearTie(f"{name}: near-tie in {k} (margin {v:.2e}) with seed {seed}")
    if spec["moe"]:
        for k, v in (("router", router_gap), ("mtp_router", mtp_router_gap)):
            if not v > MIN_ROUTER_GAP:
                raise NearTie(f"{name}: {k} top-k boundary near-tie ({v:.2e}) with seed {seed}")
    print("  min top1-top2 margins:", {k: round(v, 4) for k, v in min_margins.items()})
    if spec["moe"]:
        print(f"  min router top-k gap: {router_gap:.2e} (target), {mtp_router_gap:.2e} (MTP)")

    sens = state_sensitivity(model, seqs[2], prompts[2], noeos[2])
    print("  state sensitivity:", {k: round(v, 3) for k, v in sens.items()})
    for k, v in sens.items():
        assert v > 0.5, (name, k, v)  # dropping the recurrent state must visibly change the logits

    # ---- write
    d = os.path.join(root, name)
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    model.config.save_pretrained(d)
    model.generation_config.save_pretrained(d)
    cfg_path = os.path.join(d, "config.json")
    cj = json.load(open(cfg_path))
    tj = cj["text_config"] if spec["layout"] == "multimodal" else cj
    tj["mtp_num_hidden_layers"] = 1
    tj["mtp_use_dedicated_embeddings"] = False  # as in the published Qwen3.5 configs: MTP shares embed_tokens
    assert tj["layer_types"] == text_config(spec["config"]).layer_types
    json.dump(cj, open(cfg_path, "w"), indent=2, sort_keys=True)

    sd = disk_state_dict(model, mtp, spec)
    verify_layout(sd.keys(), spec)
    save_file(sd, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    os.chmod(os.path.join(d, "model.safetensors"), 0o644)  # save_file creates it 0600
    np.savez_compressed(os.path.join(d, "reference.npz"), **arrays)

    fam_desc = {"qwen3_5": "Qwen3.5 dense", "qwen3_5_moe": "Qwen3.5-MoE", "qwen3_next": "Qwen3-Next"}[family]
    expert_desc = {
        None: None,
        "fused": (f"fused 3-D: {'model.language_model.' if spec['layout'] == 'multimodal' else 'model.'}"
                  "layers.{l}.mlp.experts.gate_up_proj [E, 2I, H] (gate rows first), ...mlp.experts.down_proj "
                  "[E, H, I]; same under mtp.layers.0.mlp.experts.*"),
        "per_expert": ("per-expert: model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight "
                       "([I,H],[I,H],[H,I]); same under mtp.layers.0.mlp.experts.{e}.*"),
    }[spec["expert_layout"]]
    ref = {
        "fixture": name,
        "generated_by": "scripts/make_fixtures.py (scripts/fixture_hybrid.py)",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "safetensors": safetensors.__version__, "numpy": np.__version__},
        "architecture": cj["architectures"][0],
        "family": fam_desc,
        "layout": spec["layout"],
        "text_prefix": "model.language_model." if spec["layout"] == "multimodal" else "model.",
        "attn_implementation": "eager",
        "dtype": "float32",
        "weight_seed": seed,
        "data_seed": seed + 1,
        "init": {"matrices": f"N(0, {init_std}^2) (incl. router, shared_expert_gate, fused experts, vision)",
                 "output_heads": f"N(0, {head_std}^2) (lm_head; embed_tokens when tied)",
                 "zero_centred_norms": f"w ~ N(0, {NORM_STD}^2), used as (1 + w): layer norms, q/k norms, final "
                                       "norm, all MTP norms",
                 "linear_attn.norm (RMSNormGated)": f"1 + N(0, {NORM_STD}^2), used as w",
                 "A_log": f"log A, A log-uniform in {list(A_RANGE)} (stratified over the value heads of a layer)",
                 "dt_bias": f"N(0, {DT_BIAS_STD}^2)", "conv1d": f"N(0, {CONV_STD}^2)",
                 "vision biases / LayerNorm": f"N(0, {VISION_BIAS_STD}^2) / 1 + N(0, {NORM_STD}^2)"},
        "layer_types": tj["layer_types"],
        "rotary_dim": rot,
        "eos_token_id": eos,
        "max_new_tokens": MAX_NEW_TOKENS,
        "mtp_layout": "qwen3_next",
        "expert_layout": expert_desc,
        "min_top1_top2_margin": min_margins,
        "min_router_topk_gap": ({"target": router_gap, "mtp": mtp_router_gap} if spec["moe"] else None),
        "state_sensitivity": sens,
        "arrays": desc,
        "values": {k: v.tolist() for k, v in arrays.items() if v.dtype in (np.int32, np.bool_)},
    }
    json.dump(ref, open(os.path.join(d, "reference.json"), "w"), indent=2)
    return d


# ----------------------------------------------------------------------------------------------
# verification of what is on disk
# ----------------------------------------------------------------------------------------------

def _load(cls, d):
    model, info = cls.from_pretrained(d, attn_implementation="eager", dtype=torch.float32,
                                      output_loading_info=True)
    model = eager_experts(model)
    assert not info["missing_keys"], (d, cls, sorted(info["missing_keys"])[:5])
    assert not info["mismatched_keys"], (d, cls, info["mismatched_keys"])
    bad = [k for k in info["unexpected_keys"] if not k.startswith(("mtp.", "model.visual."))]
    assert not bad, (d, cls, bad[:5])
    return model.eval()


def vision_smoke_test(model):
    """The vision tower in the file is a working one: one 8x8 image (2 frames of 2x2 patches ->
    4x4 patch grid -> 4 merged tokens) through the published class.  Not part of the reference."""
    cfg = model.config
    grid = torch.tensor([[1, 4, 4]])
    pix = torch.randn(16, cfg.vision_config.in_channels * cfg.vision_config.temporal_patch_size
                      * cfg.vision_config.patch_size ** 2, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[5, 7, cfg.vision_start_token_id] + [cfg.image_token_id] * 4 + [cfg.vision_end_token_id, 9]])
    mm = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 0, 0]])
    out = model(input_ids=ids, pixel_values=pix, image_grid_thw=grid, mm_token_type_ids=mm, use_cache=False)
    assert torch.isfinite(out.logits).all() and out.logits.shape[1] == ids.shape[1]
    model.model.rope_deltas = None  # stateful in transformers: do not leak M-RoPE deltas into later calls


def check_hybrid(d: str):
    name = os.path.basename(d)
    spec = next(s() for s in HYBRID_SPECS if s()["name"] == name)
    family = spec["family"]
    ref = np.load(os.path.join(d, "reference.npz"))
    meta = json.load(open(os.path.join(d, "reference.json")))
    cj = json.load(open(os.path.join(d, "config.json")))
    tj = cj["text_config"] if spec["layout"] == "multimodal" else cj
    assert tj["mtp_num_hidden_layers"] == 1 and tj["layer_types"] == meta["layer_types"]
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        names = list(f.keys())
        assert all(f.get_slice(k).get_dtype() == "F32" for k in names)
    verify_layout(names, spec)

    worst = [0.0]

    def close(t, want):
        got = tensor_np(t)
        np.testing.assert_allclose(got, want, rtol=CHECK_TOL, atol=CHECK_TOL)
        worst[0] = max(worst[0], float(np.abs(got - want).max()))

    models = [_load(AutoModelForCausalLM, d)]  # text class (Qwen3_5ForCausalLM for the multimodal layout)
    if spec["layout"] == "multimodal":
        models.insert(0, _load(FAMILY[family]["mm_cls"], d))  # the published class, vision tower loaded
        vis = {k: v for k, v in models[0].state_dict().items() if k.startswith("model.visual.")}
        sd = load_file(os.path.join(d, "model.safetensors"))
        assert vis and all(torch.equal(v, sd[k]) for k, v in vis.items())
    for model in models:
        tcfg = text_config(model.config)
        assert tcfg.layer_types == meta["layer_types"]
        assert tcfg.rope_parameters["partial_rotary_factor"] == 0.25
        check_rope_is_plain(model, family)
        for i in range(len(LOGITS_LENGTHS)):
            s = torch.from_numpy(ref[f"seq_{i}"]).long()
            close(forward_logits(model, s), ref[f"logits_{i}"])
            close(forward_hidden(model, s), ref[f"hidden_{i}"])
        for i in range(len(PROMPT_LENGTHS)):
            p = torch.from_numpy(ref[f"prompt_{i}"]).long()
            assert generate(model, p, meta["eos_token_id"]).tolist() == ref[f"gen_{i}"].tolist(), (name, i)
            assert generate(model, p, None).tolist() == ref[f"gen_noeos_{i}"].tolist(), (name, i)
            assert bool(ref[f"gen_stopped_on_eos_{i}"]) == (ref[f"gen_{i}"][-1] == meta["eos_token_id"])
        assert model.generation_config.eos_token_id == meta["eos_token_id"]
    # cache-free greedy loop agrees too (first model only; slow)
    p = torch.from_numpy(ref["prompt_2"]).long()
    assert greedy_manual(models[0], p, MAX_NEW_TOKENS)[0].tolist() == ref["gen_noeos_2"].tolist()

    model = models[0]
    sd = load_file(os.path.join(d, "model.safetensors"))
    mtp = mtp_from_disk(sd, family, text_config(model.config))
    for i in (1, 2):
        s = torch.from_numpy(ref[f"seq_{i}"]).long()
        hid = torch.from_numpy(ref[f"hidden_{i}"])[:-1]
        for fn in (mtp_forward, mtp_forward_crosscheck):
            lg, ho = fn(model, mtp, family, s, hid)
            close(lg, ref[f"mtp_logits_{i}"])
            close(ho, ref[f"mtp_hidden_{i}"])
    if spec["layout"] == "multimodal":
        vision_smoke_test(models[0])
    kib = os.path.getsize(os.path.join(d, "model.safetensors")) // 1024
    print(f"  {name}: reload OK via {', '.join(type(m).__name__ for m in models)} ({kib} KiB weights, "
          f"max |diff| to the saved arrays {worst[0]:.1e})")

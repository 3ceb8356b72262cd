"""The DeepSeek-V3 / GLM-4.5 family fixtures' specifications (configs, seeds, MTP layouts) and the
torch modules their references are computed with: the NextN (MTP) layer under
model.layers.{L + m}, its forward as vLLM `deepseek_mtp.py` computes it, two cross-check paths, and
an audit of the sigmoid group-limited router.  Used by fixture_deepseek.py.
"""

from __future__ import annotations

import contextlib
import copy
import math

import torch
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.modeling_layers import MtpLayer
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as mds
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
from transformers.models.glm4_moe import modeling_glm4_moe as mglm
from transformers.models.glm4_moe.configuration_glm4_moe import Glm4MoeConfig
from transformers.models.glm4_moe_lite import modeling_glm4_moe_lite as mlite
from transformers.models.glm4_moe_lite.configuration_glm4_moe_lite import Glm4MoeLiteConfig

from fixture_hybrid_models import causal_mask, eager_experts

# ----------------------------------------------------------------------------------------------
# fixture specifications
# ----------------------------------------------------------------------------------------------

# 16 routed experts in 4 groups of 4; top-4 experts from the best 2 groups (group score = sum of
# its 2 best biased scores); one shared expert.  moe_intermediate_size 16 keeps each file near 1.5 MB
# (16 experts x 3 x 16 x 64 floats = 196 KiB per MoE layer).
_MOE = dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
            moe_intermediate_size=16, norm_topk_prob=True)
_MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
_COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
               hidden_act="silu", initializer_range=0.15,  # informational: weights come from reinit_
               tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def spec_glm4_moe():
    cfg = Glm4MoeConfig(**_COMMON, **_MOE, vocab_size=256, num_key_value_heads=2, attention_bias=True,
                        use_qk_norm=True, first_k_dense_replace=1, routed_scaling_factor=2.5,
                        num_nextn_predict_layers=1, rms_norm_eps=1e-5, max_position_embeddings=512,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                         "partial_rotary_factor": 0.5},
                        architectures=["Glm4MoeForCausalLM"])
    # GLM-4.5 style NextN layer: its own shared_head.head, embed_tokens a copy of the target's
    return dict(name="glm4_moe", family="glm4_moe", config=cfg, seed=61001, mtp_layers=1,
                mtp_embed="copy", mtp_head="own", published_rope=False, extra_config={})


def spec_deepseek_v3():
    # YaRN: factor 4 over original 32 positions (references run to 64).  rope_theta 500 puts the
    # 4 rotary frequencies of qk_rope_head_dim 8 on both sides of the beta_fast/beta_slow ramp
    # (truncated to [0, 2]): one kept, one blended half/half, two divided by 4.  mscale != mscale_all_dim
    # so that both the cos/sin factor mscale(1.0)/mscale(0.8) = 1.025 and the softmax factor
    # mscale(0.8)^2 = 1.234 differ from 1.
    rope = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 32,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}
    cfg = DeepseekV3Config(**_COMMON, **_MOE, **_MLA, vocab_size=192, num_key_value_heads=4, q_lora_rank=32,
                           first_k_dense_replace=1, routed_scaling_factor=2.5, num_nextn_predict_layers=2,
                           rms_norm_eps=1e-6, max_position_embeddings=128, rope_parameters=rope,
                           rope_interleave=True, attention_bias=False, architectures=["DeepseekV3ForCausalLM"])
    # published DeepSeek-V3: every NextN layer repeats the target's embed_tokens and lm_head
    return dict(name="deepseek_v3", family="deepseek_v3", config=cfg, seed=63001, mtp_layers=2,
                mtp_embed="copy", mtp_head="copy", published_rope=True,
                extra_config={"topk_method": "noaux_tc", "scoring_func": "sigmoid"})


def spec_glm4_moe_lite():
    # q_lora_rank None: a plain q_proj.  rms_norm_eps 1e-6: transformers builds kv_a_layernorm with
    # its default eps 1e-6 whatever the config says (vLLM uses rms_norm_eps); equal here on purpose.
    cfg = Glm4MoeLiteConfig(**_COMMON, **_MOE, **_MLA, vocab_size=224, num_key_value_heads=4, q_lora_rank=None,
                            mlp_layer_types=["dense", "sparse", "sparse"], routed_scaling_factor=1.8,
                            rms_norm_eps=1e-6, max_position_embeddings=512,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                            rope_interleave=True, attention_bias=False, architectures=["Glm4MoeLiteForCausalLM"])
    # the other combination: the NextN layer's own embed_tokens, shared_head.head a copy of lm_head
    return dict(name="glm4_moe_lite", family="glm4_moe_lite", config=cfg, seed=65001, mtp_layers=1,
                mtp_embed="own", mtp_head="copy", published_rope=False,
                extra_config={"num_nextn_predict_layers": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid"})


DEEPSEEK_SPECS = [spec_glm4_moe, spec_deepseek_v3, spec_glm4_moe_lite]
DEEPSEEK_NAMES = [s()["name"] for s in DEEPSEEK_SPECS]

FAMILY = {
    "glm4_moe": dict(layer=mglm.Glm4MoeDecoderLayer, norm=mglm.Glm4MoeRMSNorm, router=mglm.Glm4MoeTopkRouter,
                     attn=mglm.Glm4MoeAttention),
    "deepseek_v3": dict(layer=mds.DeepseekV3DecoderLayer, norm=mds.DeepseekV3RMSNorm,
                        router=mds.DeepseekV3TopkRouter, attn=mds.DeepseekV3Attention),
    "glm4_moe_lite": dict(layer=mlite.Glm4MoeLiteDecoderLayer, norm=mlite.Glm4MoeLiteRMSNorm,
                          router=mlite.Glm4MoeLiteTopkRouter, attn=mlite.Glm4MoeLiteAttention),
}

NEXTN_OWN = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")  # the rest is the decoder layer


def build_model(spec):
    cfg = copy.deepcopy(spec["config"])
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    return eager_experts(model)


# ----------------------------------------------------------------------------------------------
# the NextN (MTP) layer
# ----------------------------------------------------------------------------------------------

def nextn_layer_config(cfg):
    """Config of a lone sparse decoder layer (the NextN layer is MoE, as in get_mtp_config)."""
    c = copy.deepcopy(cfg)
    c.num_hidden_layers = 1
    if hasattr(c, "first_k_dense_replace"):
        c.first_k_dense_replace = 0
    if getattr(c, "mlp_layer_types", None) is not None:
        c.mlp_layer_types = ["sparse"]
    c._attn_implementation = "eager"
    c._experts_implementation = "eager"
    return c


class NextNLayer(nn.Module):
    """model.layers.{L+m}: enorm, hnorm, eh_proj [H, 2H], shared_head.{norm, head}, embed_tokens, plus one
    sparse decoder layer of the family whose tensors sit at the same prefix (`decoder.` is dropped on disk)."""

    def __init__(self, family: str, cfg):
        super().__init__()
        norm, H = FAMILY[family]["norm"], cfg.hidden_size
        self.enorm = norm(H, eps=cfg.rms_norm_eps)
        self.hnorm = norm(H, eps=cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = norm(H, eps=cfg.rms_norm_eps)
        self.shared_head.head = nn.Linear(H, cfg.vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.decoder = FAMILY[family]["layer"](nextn_layer_config(cfg), layer_idx=0)
        assert hasattr(self.decoder.mlp, "gate"), "the NextN decoder layer must be sparse"
        eager_experts_module(self)


def eager_experts_module(module):
    for mod in module.modules():
        if type(mod).__name__.endswith("Experts"):
            assert mod.config._experts_implementation == "eager", type(mod).__name__


def nextn_inputs(layer, tokens, hidden, zero_first=True):
    """x = eh_proj(cat[enorm(e), hnorm(h)]), e = embed_tokens(tokens[1:]) with row 0 (position 0) zeroed
    as vLLM does (`inputs_embeds[positions == 0] = 0`)."""
    emb = layer.embed_tokens(tokens[1:])[None].clone()
    if zero_first:
        emb[:, 0] = 0
    return emb, layer.eh_proj(torch.cat([layer.enorm(emb), layer.hnorm(hidden[None])], -1))


def mtp_forward(model, layer, tokens, hidden, zero_first=True):
    """tokens [n+1], hidden [n, H] (target post-norm hidden of tokens[:n]) -> (logits [n, V], y [n, H]).
    Row i: embed(tokens[i+1]) with h_i at RoPE position i; y is the decoder layer's output (the residual
    stream, BEFORE shared_head.norm); logits = shared_head.head(shared_head.norm(y)) predict tokens[i+2]."""
    n = tokens.shape[0] - 1
    _, x = nextn_inputs(layer, tokens, hidden, zero_first)
    pos = torch.arange(n)[None]
    pe = model.model.rotary_emb(x, pos)
    y = layer.decoder(x, attention_mask=causal_mask(n), position_ids=pos, position_embeddings=pe)
    if isinstance(y, tuple):
        raise RuntimeError("decoder layer returned a tuple; update mtp_forward")
    return layer.shared_head.head(layer.shared_head.norm(y))[0], y[0]


def mtp_crosscheck_model(model, layer, tokens, hidden):
    """Second path for y: a 1-layer model of the family (its own mask, positions, rotary embedding) fed
    with inputs_embeds = x, final norm removed."""
    aux = AutoModelForCausalLM.from_config(nextn_layer_config(model.config), attn_implementation="eager",
                                           dtype=torch.float32).eval()
    aux = eager_experts(aux)
    aux.model.layers[0].load_state_dict(layer.decoder.state_dict())
    aux.model.norm = nn.Identity()
    _, x = nextn_inputs(layer, tokens, hidden)
    y = aux.model(inputs_embeds=x, use_cache=False).last_hidden_state
    return layer.shared_head.head(layer.shared_head.norm(y))[0], y[0]


def mtp_crosscheck_transformers(model, family, layer, tokens, hidden):
    """Third path, for the inputs and the normed output: transformers' own MtpLayer (enorm / hnorm /
    eh_proj concat order, post_norm = shared_head.norm) with the same weights.  Returns (logits,
    shared_head.norm(y)).  transformers' MtpModel itself cannot be the reference: it ties the head to
    lm_head, runs at the token's position (i + 1, not i), zeroes nothing, and finds the NextN tensors only
    at the published layer numbers (_keys_to_ignore_on_load_unexpected)."""
    fam = FAMILY[family]
    tl = MtpLayer(nextn_layer_config(model.config), fam["layer"], fam["norm"], 0, use_post_norm=True).eval()
    eager_experts_module(tl)
    tl.enorm.load_state_dict(layer.enorm.state_dict())
    tl.hnorm.load_state_dict(layer.hnorm.state_dict())
    tl.eh_proj.load_state_dict(layer.eh_proj.state_dict())
    tl.post_norm.load_state_dict(layer.shared_head.norm.state_dict())
    tl.mtp_block.load_state_dict(layer.decoder.state_dict())
    n = tokens.shape[0] - 1
    emb = layer.embed_tokens(tokens[1:])[None] * (torch.arange(n) > 0)[None, :, None]
    pos = torch.arange(n)[None]
    out = tl(emb, hidden[None], position_embeddings=model.model.rotary_emb(emb, pos),
             attention_mask=causal_mask(n), position_ids=pos, past_key_values=None)
    return layer.shared_head.head(out)[0], out[0]


def nextn_state_dict(layers, L):
    out = {}
    for m, layer in enumerate(layers):
        for k, v in layer.state_dict().items():
            out[f"model.layers.{L + m}.{k[len('decoder.'):] if k.startswith('decoder.') else k}"] = v
    return out


def nextn_from_disk(sd, family, cfg, L, m):
    """Rebuild NextN layer m from the tensors of model.layers.{L+m}.* (per-expert on disk)."""
    pre = f"model.layers.{L + m}."
    raw = {k[len(pre):]: v for k, v in sd.items() if k.startswith(pre)}
    E = cfg.n_routed_experts
    ex = "mlp.experts."
    raw[ex + "gate_up_proj"] = torch.stack([torch.cat([raw.pop(f"{ex}{e}.gate_proj.weight"),
                                                       raw.pop(f"{ex}{e}.up_proj.weight")]) for e in range(E)])
    raw[ex + "down_proj"] = torch.stack([raw.pop(f"{ex}{e}.down_proj.weight") for e in range(E)])
    layer = NextNLayer(family, cfg).eval()
    layer.load_state_dict({(k if k.split(".")[0] in NEXTN_OWN else "decoder." + k): v for k, v in raw.items()},
                          strict=True)
    return layer


# ----------------------------------------------------------------------------------------------
# router audit
# ----------------------------------------------------------------------------------------------

def route(scores, bias, n_group, topk_group, k):
    """Sigmoid group-limited top-k (DeepSeek-V3 noaux_tc), written out independently of transformers:
    choice on scores + bias; group score = sum of the group's 2 best biased scores; the best topk_group
    groups survive.  Returns (expert sets [T, k] sorted, group gap, expert gap)."""
    T, E = scores.shape
    sfc = scores + bias
    grp = sfc.view(T, n_group, E // n_group).topk(2, dim=-1).values.sum(-1)
    gs = grp.sort(dim=-1, descending=True).values
    group_gap = (gs[:, topk_group - 1] - gs[:, topk_group]) if topk_group < n_group else torch.full((T,), math.inf)
    keep = torch.zeros_like(grp, dtype=torch.bool).scatter_(1, grp.topk(topk_group, dim=-1).indices, True)
    masked = sfc.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), -math.inf)
    ms = masked.sort(dim=-1, descending=True)
    return ms.indices[:, :k].sort(dim=-1).values, group_gap, ms.values[:, k - 1] - ms.values[:, k]


class RouterAudit:
    """Forward hooks on every router of `module`: checks transformers' choice against `route`, records the
    smallest group / expert top-k gap, and counts tokens whose expert set differs (a) from plain top-k over
    the biased scores (what the group limit changes) and (b) from the same routing without the correction
    bias (what the bias changes)."""

    def __init__(self, module, family):
        self.handles, self.min_group_gap, self.min_expert_gap = [], math.inf, math.inf
        self.tokens = self.group_limit_changes = self.bias_changes = 0
        for mod in module.modules():
            if isinstance(mod, FAMILY[family]["router"]):
                self.handles.append(mod.register_forward_hook(self._hook))

    def _hook(self, mod, inputs, outputs):
        _, weights, idx = outputs
        x = inputs[0].reshape(-1, mod.hidden_dim).float()
        scores = (x @ mod.weight.float().T).sigmoid()
        bias = mod.e_score_correction_bias.float()
        chosen, ggap, egap = route(scores, bias, mod.num_group, mod.topk_group, mod.top_k)
        assert torch.equal(chosen, idx.sort(dim=-1).values), "transformers' router disagrees with route()"
        w = scores.gather(1, idx)
        w = w / w.sum(-1, keepdim=True) * mod.routed_scaling_factor
        torch.testing.assert_close(weights, w, rtol=1e-6, atol=1e-6)
        plain = (scores + bias).topk(mod.top_k, dim=-1).indices.sort(dim=-1).values
        nobias, _, _ = route(scores, torch.zeros_like(bias), mod.num_group, mod.topk_group, mod.top_k)
        self.tokens += x.shape[0]
        self.group_limit_changes += int((plain != chosen).any(-1).sum())
        self.bias_changes += int((nobias != chosen).any(-1).sum())
        self.min_group_gap = min(self.min_group_gap, float(ggap.min()))
        self.min_expert_gap = min(self.min_expert_gap, float(egap.min()))

    def summary(self):
        return {"routed_token_rows": self.tokens, "group_limit_changes_choice": self.group_limit_changes,
                "correction_bias_changes_choice": self.bias_changes,
                "min_group_gap": self.min_group_gap, "min_expert_gap": self.min_expert_gap}

    def remove(self):
        for h in self.handles:
            h.remove()


# ----------------------------------------------------------------------------------------------
# probes: what each feature changes, what the rotary embedding is
# ----------------------------------------------------------------------------------------------

def routers(module, family):
    return [m for m in module.modules() if isinstance(m, FAMILY[family]["router"])]


@contextlib.contextmanager
def patched(objs, **attrs):
    """Set attributes on every object, restore them afterwards (tensors are copied in place)."""
    saved = [{k: (getattr(o, k).clone() if torch.is_tensor(getattr(o, k)) else getattr(o, k)) for k in attrs}
             for o in objs]
    try:
        for o in objs:
            for k, v in attrs.items():
                getattr(o, k).copy_(v(getattr(o, k))) if torch.is_tensor(getattr(o, k)) else setattr(o, k, v)
        yield
    finally:
        for o, s in zip(objs, saved):
            for k, v in s.items():
                getattr(o, k).copy_(v) if torch.is_tensor(v) else setattr(o, k, v)


def sensitivity(model, family, seq):
    """Largest logit change on seq when one feature is switched off: each must be visible at test
    tolerance, or a model that forgets it would pass."""
    base = model(seq[None], use_cache=False).logits[0]
    rs = routers(model, family)
    attn = [m for m in model.modules() if isinstance(m, FAMILY[family]["attn"])]
    rot = model.model.rotary_emb
    variants = {"no_correction_bias": (rs, dict(e_score_correction_bias=torch.zeros_like)),
                "no_group_limit": (rs, dict(num_group=1, topk_group=1)),
                "routed_scaling_factor_1": (rs, dict(routed_scaling_factor=1.0))}
    if hasattr(model.config, "rope_interleave"):
        variants["rope_not_interleaved"] = ([model.config], dict(rope_interleave=False))
    if model.config.rope_parameters["rope_type"] == "yarn":
        head = model.config.qk_nope_head_dim + model.config.qk_rope_head_dim
        dim = 2 * rot.inv_freq.shape[0]
        plain = 1.0 / model.config.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim)
        variants["no_softmax_mscale"] = (attn, dict(scaling=head ** -0.5))
        variants["no_cos_sin_mscale"] = ([rot], dict(attention_scaling=1.0))
        variants["no_yarn_frequencies"] = ([rot], dict(inv_freq=lambda f: plain))
    out = {}
    for key, (objs, attrs) in variants.items():
        with patched(objs, **attrs):
            out[key] = float((model(seq[None], use_cache=False).logits[0] - base).abs().max())
    torch.testing.assert_close(model(seq[None], use_cache=False).logits[0], base, rtol=0, atol=0)  # restored
    return out


def rope_record(model):
    rot, cfg = model.model.rotary_emb, model.config
    attn = next(m for m in model.modules() if isinstance(m, tuple(f["attn"] for f in FAMILY.values())))
    # legacy "rope_scaling" configs keep their "type" key next to the normalised "rope_type"
    params = {k: v for k, v in cfg.rope_parameters.items() if k != "type"}
    return {"rope_parameters": params, "rotary_dim": 2 * rot.inv_freq.shape[0],
            "inv_freq": rot.inv_freq.tolist(), "cos_sin_attention_factor": rot.attention_scaling,
            "softmax_scale": attn.scaling, "rope_interleave": getattr(cfg, "rope_interleave", None)}

"""The hybrid fixtures' specifications (configs, seeds, layouts) and the torch modules their
references are computed with: model construction for both layouts and the MTP-head reference
built from transformers' own decoder layer, norm and rotary classes. Used by fixture_hybrid.py.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers.models.qwen3_5 import modeling_qwen3_5 as m35
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config, Qwen3_5TextConfig
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m35moe
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeConfig, Qwen3_5MoeTextConfig
from transformers.models.qwen3_next import modeling_qwen3_next as mnext
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig


CHUNK = 64  # transformers' chunk_size of torch_chunk_gated_delta_rule

# ----------------------------------------------------------------------------------------------
# fixture specifications
# ----------------------------------------------------------------------------------------------

_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
               linear_value_head_dim=24,  # != key head dim on purpose
               linear_conv_kernel_dim=4)
_ATTN = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             max_position_embeddings=512, rms_norm_eps=1e-6, hidden_act="silu",
             initializer_range=0.15)  # informational: the weights come from reinit_ below
_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96)
# rotary dim = head_dim * 0.25 = 8 -> 4 frequencies; mrope_section splits them T/H/W = 2/1/1 (sums to 4,
# as [11, 11, 10] sums to 32 for the real head_dim 256).  Text positions are 1-D (T = H = W), so this is
# plain RoPE over the first 8 dims of each head (checked in build()).
# a real (tiny) vision tower, present in the file under model.visual.* so that a text loader must skip it
_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=2, spatial_merge_size=2,
               temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16, in_channels=3,
               initializer_range=0.15)


def _rope(theta, mrope):
    r = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.25}
    if mrope:
        r.update(mrope_section=[2, 1, 1], mrope_interleaved=True)
    return r


def _mm_token_ids(V):
    # the real Qwen3.5 configs put these inside the vocabulary, near its end; text-only inputs never
    # reach the vision code, so any id works; keep them in range like the real ones
    return dict(image_token_id=V - 2, video_token_id=V - 1, vision_start_token_id=V - 4, vision_end_token_id=V - 3)


def spec_qwen3_5_dense():
    V = 320
    tc = dict(_ATTN, **_LINEAR, vocab_size=V, intermediate_size=128, num_hidden_layers=4,
              layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
              rope_parameters=_rope(10000.0, True), tie_word_embeddings=False)
    cfg = Qwen3_5Config(text_config=tc, vision_config=dict(_VISION), tie_word_embeddings=False,
                        architectures=["Qwen3_5ForConditionalGeneration"], **_mm_token_ids(V))
    return dict(name="qwen3_5_dense", family="qwen3_5", layout="multimodal", moe=False, config=cfg, seed=51001,
                expert_layout=None)


def spec_qwen3_5_moe():
    V = 256
    tc = dict(_ATTN, **_LINEAR, **_MOE, vocab_size=V, num_hidden_layers=4,
              layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
              rope_parameters=_rope(50000.0, True), tie_word_embeddings=False)
    cfg = Qwen3_5MoeConfig(text_config=tc, vision_config=dict(_VISION), tie_word_embeddings=False,
                           architectures=["Qwen3_5MoeForConditionalGeneration"], **_mm_token_ids(V))
    return dict(name="qwen3_5_moe", family="qwen3_5_moe", layout="multimodal", moe=True, config=cfg, seed=53001,
                expert_layout="fused")


def spec_qwen3_5_text():
    cfg = Qwen3_5TextConfig(**_ATTN, **_LINEAR, vocab_size=384, intermediate_size=128, num_hidden_layers=5,
                            layer_types=["linear_attention", "full_attention", "linear_attention",
                                         "linear_attention", "full_attention"],
                            rope_parameters=_rope(20000.0, True), tie_word_embeddings=True,
                            architectures=["Qwen3_5ForCausalLM"])
    return dict(name="qwen3_5_text", family="qwen3_5", layout="text", moe=False, config=cfg, seed=55001,
                expert_layout=None)


def spec_qwen3_5_moe_text():
    cfg = Qwen3_5MoeTextConfig(**_ATTN, **_LINEAR, **_MOE, vocab_size=288, num_hidden_layers=4,
                               layer_types=["full_attention", "linear_attention", "linear_attention",
                                            "full_attention"],
                               rope_parameters=_rope(10000.0, True), tie_word_embeddings=False,
                               architectures=["Qwen3_5MoeForCausalLM"])
    return dict(name="qwen3_5_moe_text", family="qwen3_5_moe", layout="text", moe=True, config=cfg, seed=57001,
                expert_layout="per_expert")


def spec_qwen3_next():
    cfg = Qwen3NextConfig(**_ATTN, **_LINEAR, **_MOE, vocab_size=352, intermediate_size=128, num_hidden_layers=4,
                          layer_types=["linear_attention", "full_attention", "linear_attention",
                                       "linear_attention"],
                          mlp_only_layers=[1], decoder_sparse_step=1, norm_topk_prob=True,
                          rope_parameters=_rope(100000.0, False), tie_word_embeddings=False,
                          architectures=["Qwen3NextForCausalLM"])
    return dict(name="qwen3_next", family="qwen3_next", layout="text", moe=True, config=cfg, seed=59001,
                expert_layout="per_expert")


HYBRID_SPECS = [spec_qwen3_5_dense, spec_qwen3_5_moe, spec_qwen3_5_text, spec_qwen3_5_moe_text, spec_qwen3_next]
HYBRID_NAMES = [s()["name"] for s in HYBRID_SPECS]

FAMILY = {
    "qwen3_5": dict(mod=m35, text_cls=m35.Qwen3_5ForCausalLM, mm_cls=m35.Qwen3_5ForConditionalGeneration,
                    layer=m35.Qwen3_5DecoderLayer, norm=m35.Qwen3_5RMSNorm, gated=m35.Qwen3_5RMSNormGated,
                    gdn=m35.Qwen3_5GatedDeltaNet, router=None, mrope=True),
    "qwen3_5_moe": dict(mod=m35moe, text_cls=m35moe.Qwen3_5MoeForCausalLM,
                        mm_cls=m35moe.Qwen3_5MoeForConditionalGeneration, layer=m35moe.Qwen3_5MoeDecoderLayer,
                        norm=m35moe.Qwen3_5MoeRMSNorm, gated=m35moe.Qwen3_5MoeRMSNormGated,
                        gdn=m35moe.Qwen3_5MoeGatedDeltaNet, router=m35moe.Qwen3_5MoeTopKRouter, mrope=True),
    "qwen3_next": dict(mod=mnext, text_cls=mnext.Qwen3NextForCausalLM, mm_cls=None,
                       layer=mnext.Qwen3NextDecoderLayer, norm=mnext.Qwen3NextRMSNorm,
                       gated=mnext.Qwen3NextRMSNormGated, gdn=mnext.Qwen3NextGatedDeltaNet,
                       router=mnext.Qwen3NextTopKRouter, mrope=False),
}


# ----------------------------------------------------------------------------------------------
# model plumbing (multimodal vs text layout)
# ----------------------------------------------------------------------------------------------

def text_config(cfg):
    return cfg.text_config if hasattr(cfg, "text_config") else cfg


def text_model(model):
    """The text decoder stack (embed_tokens, layers, norm, rotary_emb)."""
    return model.model.language_model if hasattr(model.model, "language_model") else model.model


def build_model(spec):
    fam = FAMILY[spec["family"]]
    cls = fam["mm_cls"] if spec["layout"] == "multimodal" else fam["text_cls"]
    cfg = copy.deepcopy(spec["config"])
    model = cls._from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    return eager_experts(model)


def eager_experts(model):
    """The reference runs the plain per-expert loop of the experts class ("eager").  transformers 5.17
    defaults to "grouped_mm", whose results on CPU differ by ~2e-5 in the logits between a freshly built
    and a reloaded model (same weights)."""
    if model._can_set_experts_implementation():
        model.set_experts_implementation("eager")
    for mod in model.modules():
        cfg = getattr(mod, "config", None)
        if type(mod).__name__.endswith("Experts"):
            assert cfg._experts_implementation == "eager", (type(mod).__name__, cfg._experts_implementation)
    return model


def check_zero_centred_norm(norm_cls):
    """The family norm is (1 + w) * x / rms(x): with w = 0 it is the plain normalisation."""
    n = norm_cls(8, eps=1e-6)
    n.weight.zero_()
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(n(x), want)


class HybridMTP(nn.Module):
    """Qwen3-Next / Qwen3.5 MTP head: mtp.{fc, pre_fc_norm_embedding, pre_fc_norm_hidden, layers.0, norm}.
    layers.0 is a full-attention decoder layer of the family (gated attention; MoE + shared expert for
    MoE families), all norms are the family's (1 + w) RMSNorm."""

    def __init__(self, family: str, tcfg):
        super().__init__()
        fam = FAMILY[family]
        H, eps = tcfg.hidden_size, tcfg.rms_norm_eps
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = fam["norm"](H, eps=eps)
        self.pre_fc_norm_hidden = fam["norm"](H, eps=eps)
        self.layers = nn.ModuleList([fam["layer"](mtp_layer_config(tcfg), layer_idx=0)])
        self.norm = fam["norm"](H, eps=eps)
        assert hasattr(self.layers[0], "self_attn") and not hasattr(self.layers[0], "linear_attn")
        for mod in self.modules():
            if type(mod).__name__.endswith("Experts"):
                assert mod.config._experts_implementation == "eager"


def mtp_layer_config(tcfg):
    c = copy.deepcopy(tcfg)
    c.num_hidden_layers = 1
    c.layer_types = ["full_attention"]
    if hasattr(c, "mlp_only_layers"):
        c.mlp_only_layers = []  # the Qwen3-Next MTP layer is sparse (MoE + shared expert)
    c._attn_implementation = "eager"
    c._experts_implementation = "eager"
    return c


def causal_mask(n: int) -> torch.Tensor:
    m = torch.full((n, n), torch.finfo(torch.float32).min)
    return torch.triu(m, diagonal=1)[None, None]


def rope_position_ids(family, n):
    pos = torch.arange(n)[None]  # [1, n]
    if FAMILY[family]["mrope"]:
        return pos[None].expand(3, 1, n)  # Qwen3_5TextRotaryEmbedding takes [3 (T, H, W), batch, n]
    return pos


def mtp_forward(model, mtp, family, tokens, hidden):
    """tokens [n+1], hidden [n, H] (target post-norm hidden states of tokens[:n]) -> logits [n, V],
    hidden after mtp.norm [n, H].  Built from the family's decoder layer / norm / rotary embedding."""
    tm = text_model(model)
    n = tokens.shape[0] - 1
    emb = tm.embed_tokens(tokens[1:])[None]
    x = mtp.fc(torch.cat([mtp.pre_fc_norm_embedding(emb), mtp.pre_fc_norm_hidden(hidden[None])], -1))
    pe = tm.rotary_emb(x, rope_position_ids(family, n))
    y = mtp.layers[0](x, position_embeddings=pe, attention_mask=causal_mask(n), position_ids=torch.arange(n)[None])
    if isinstance(y, tuple):
        raise RuntimeError("decoder layer returned a tuple; update mtp_forward")
    h = mtp.norm(y)
    return model.lm_head(h)[0], h[0]


def mtp_forward_crosscheck(model, mtp, family, tokens, hidden):
    """Second path: a 1-layer text model of the same family fed with inputs_embeds = x (its own mask,
    position ids and rotary embedding), mtp.norm as its final norm, the target's lm_head."""
    tcfg = mtp_layer_config(text_config(model.config))
    tcfg.tie_word_embeddings = False
    aux = FAMILY[family]["text_cls"]._from_config(tcfg, attn_implementation="eager", dtype=torch.float32).eval()
    aux = eager_experts(aux)
    aux.model.layers[0].load_state_dict(mtp.layers[0].state_dict())
    aux.model.norm.load_state_dict(mtp.norm.state_dict())
    aux.lm_head.weight.copy_(model.lm_head.weight)
    emb = text_model(model).embed_tokens(tokens[1:])[None]
    x = mtp.fc(torch.cat([mtp.pre_fc_norm_embedding(emb), mtp.pre_fc_norm_hidden(hidden[None])], -1))
    out = aux.model(inputs_embeds=x, use_cache=False).last_hidden_state
    return aux.lm_head(out)[0], out[0]



"""The torch reference for MTP heads, built from transformers' own blocks, and the
checkpoint-layout helpers used by make_fixtures.py (same requirements: torch + transformers).
"""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM
from torch import nn
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeDecoderLayer,
    Qwen3MoeRMSNorm,
    Qwen3MoeSparseMoeBlock,
)


def causal_mask(n: int) -> torch.Tensor:
    """Additive [1, 1, n, n] mask for eager attention."""
    m = torch.full((n, n), torch.finfo(torch.float32).min)
    return torch.triu(m, diagonal=1)[None, None]

class QwenNextMTP(nn.Module):
    """Qwen3-Next / Qwen3.5 layout: mtp.{fc, pre_fc_norm_embedding, pre_fc_norm_hidden, layers.0, norm}."""

    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        H = cfg.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = Qwen3RMSNorm(H, eps=cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3RMSNorm(H, eps=cfg.rms_norm_eps)
        # layer_idx 0: only used for KV-cache bookkeeping / layer_types lookup (full attention)
        self.layers = nn.ModuleList([Qwen3DecoderLayer(cfg, layer_idx=0)])
        self.norm = Qwen3RMSNorm(H, eps=cfg.rms_norm_eps)

    def inputs(self, emb_next, h):
        return self.fc(torch.cat([self.pre_fc_norm_embedding(emb_next), self.pre_fc_norm_hidden(h)], -1))


class DeepSeekMTPLayer(nn.Module):
    """DeepSeek-V3 / GLM-4.5 layout under model.layers.{L}: enorm, hnorm, eh_proj, shared_head.{norm, head}
    plus the decoder-layer weights (a Qwen3-MoE sparse layer) at the same prefix."""

    def __init__(self, cfg: Qwen3MoeConfig, layer_idx: int):
        super().__init__()
        H = cfg.hidden_size
        self.enorm = Qwen3MoeRMSNorm(H, eps=cfg.rms_norm_eps)
        self.hnorm = Qwen3MoeRMSNorm(H, eps=cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = Qwen3MoeRMSNorm(H, eps=cfg.rms_norm_eps)
        self.shared_head.head = nn.Linear(H, cfg.vocab_size, bias=False)
        self.decoder = Qwen3MoeDecoderLayer(cfg, layer_idx=layer_idx)
        assert isinstance(self.decoder.mlp, Qwen3MoeSparseMoeBlock), "MTP layer must be a sparse MoE layer"

    def inputs(self, emb_next, h):
        return self.eh_proj(torch.cat([self.enorm(emb_next), self.hnorm(h)], -1))


def deepseek_position0(emb_next, kind: str):
    """vLLM deepseek_mtp.py (`inputs_embeds[positions == 0] = 0`): the DeepSeek-layout MTP layer
    sees a zero embedding at position 0; the Qwen3-Next layout does not."""
    if kind != "deepseek_v3":
        return emb_next
    emb_next = emb_next.clone()
    emb_next[:, 0] = 0
    return emb_next


def mtp_forward(model, mtp, kind, tokens: torch.Tensor, hidden: torch.Tensor):
    """tokens: [n+1] ids, hidden: [n, H] target post-norm hidden states of tokens[:n].
    Returns (logits [n, V], hidden [n, H]); hidden is post-mtp.norm (qwen3_next) or pre-norm (deepseek_v3)."""
    n = tokens.shape[0] - 1
    emb_next = deepseek_position0(model.model.embed_tokens(tokens[1:])[None], kind)  # [1, n, H]
    x = mtp.inputs(emb_next, hidden[None])
    pos = torch.arange(n)[None]
    pe = model.model.rotary_emb(x, pos)
    mask = causal_mask(n)
    if kind == "qwen3_next":
        y = mtp.layers[0](x, attention_mask=mask, position_ids=pos, position_embeddings=pe)
        h_out = mtp.norm(y)
        logits = model.lm_head(h_out)
    else:
        y = mtp.decoder(x, attention_mask=mask, position_ids=pos, position_embeddings=pe)
        h_out = y
        logits = mtp.shared_head.head(mtp.shared_head.norm(y))
    if isinstance(y, tuple):
        raise RuntimeError("decoder layer returned a tuple; update mtp_forward")
    return logits[0], h_out[0]


def mtp_forward_crosscheck(model, mtp, kind, tokens, hidden):
    """Second path: a 1-layer transformers model (same class as the target) fed with inputs_embeds."""
    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = 1
    if kind == "deepseek_v3":
        cfg.mlp_only_layers = []
    if hasattr(cfg, "layer_types") and cfg.layer_types is not None:
        cfg.layer_types = cfg.layer_types[:1]
    aux = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    layer = mtp.layers[0] if kind == "qwen3_next" else mtp.decoder
    aux.model.layers[0].load_state_dict(layer.state_dict())
    if kind == "qwen3_next":
        aux.model.norm.load_state_dict(mtp.norm.state_dict())
        aux.lm_head.weight.copy_(model.lm_head.weight)
    else:
        aux.model.norm = nn.Identity()
    emb_next = deepseek_position0(model.model.embed_tokens(tokens[1:])[None], kind)
    x = mtp.inputs(emb_next, hidden[None])
    h_out = aux.model(inputs_embeds=x).last_hidden_state
    if kind == "qwen3_next":
        logits = aux.lm_head(h_out)
    else:
        logits = mtp.shared_head.head(mtp.shared_head.norm(h_out))
    return logits[0], h_out[0]


def mtp_state_dict(mtp, kind, L: int, moe_cfg=None) -> dict:
    out = {}
    if kind == "qwen3_next":
        for k, v in mtp.state_dict().items():
            out[f"mtp.{k}"] = v
    else:
        pre = f"model.layers.{L}."
        for k, v in mtp.state_dict().items():
            if k.startswith("decoder."):
                out[pre + k[len("decoder."):]] = v
            else:
                out[pre + k] = v
    return out


def split_experts(sd: dict, moe_intermediate: int) -> dict:
    """transformers 5.x keeps fused experts (mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj
    [E, H, I]); rewrite them in the per-expert layout of the original Qwen3-MoE Hub checkpoints:
    mlp.experts.{e}.gate_proj.weight [I, H], .up_proj.weight [I, H], .down_proj.weight [H, I]."""
    out = {}
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            pre = k[: -len("gate_up_proj")]
            assert v.shape[1] == 2 * moe_intermediate
            for e in range(v.shape[0]):
                # Qwen3MoeExperts.forward: gate, up = linear(x, gate_up_proj[e]).chunk(2, dim=-1)
                out[f"{pre}{e}.gate_proj.weight"] = v[e, :moe_intermediate].contiguous().clone()
                out[f"{pre}{e}.up_proj.weight"] = v[e, moe_intermediate:].contiguous().clone()
        elif k.endswith("mlp.experts.down_proj"):
            pre = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{pre}{e}.down_proj.weight"] = v[e].contiguous().clone()
        else:
            out[k] = v
    return out

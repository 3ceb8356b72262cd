"""Rotary position embeddings: plain RoPE (`rope`, the layers'), and beyond it YaRN and Llama-3
("llama3") frequencies, YaRN's softmax scale, and the interleaved pair layout of DeepSeek-V3 /
GLM-4.7-Flash.

YaRN follows transformers `_compute_yarn_parameters` (modeling_rope_utils.py) term by term:
  - the correction range [low, high] of rotary dims from `beta_fast` / `beta_slow` rotations
    over `original_max_position_embeddings` (floored / ceiled unless `truncate` is False);
  - inv_freq = interpolation * (1 - e) + extrapolation * e, with e = 1 - ramp(low, high) over
    the dim/2 frequencies, interpolation = extrapolation / factor;
  - `attention_factor` (cos and sin are multiplied by it): as given, else
    get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) when both are set, else
    get_mscale(factor).
Llama-3.1 / 3.2 ("llama3") follow transformers `_compute_llama3_parameters` in float32: with
wavelen = 2 pi / inv_freq, low = original / low_freq_factor and high = original / high_freq_factor,
wavelengths above `low` are divided by `factor`, those below `high` kept, and those in between
interpolated by s = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor):
(1 - s) * inv_freq / factor + s * inv_freq. cos and sin are not rescaled (attention factor 1).
DeepSeek-V3's attention also scales the softmax by get_mscale(factor, mscale_all_dim)^2 on top
of qk_head_dim^-0.5 (transformers `yarn_apply_mscale` in modeling_deepseek_v3.py):
`softmax_scale` below.

Interleaved rope (`rope_interleave`) rotates pairs (x0, x1), (x2, x3), ... by one frequency each;
transformers' `apply_rotary_pos_emb_interleave` returns them de-interleaved, [evens | odds],
which is what rotate-half RoPE gives after de-interleaving. Queries and keys are permuted the
same way, so their dot products are those of the interleaved rotation.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

ROPE_TYPES = ("default", "yarn")  # what latent attention (DeepSeek-V3, GLM-4.7-Flash) accepts
# rope_parameters keys jspec reads, per type (everything else there is refused by name).
_YARN_KEYS = ("factor", "original_max_position_embeddings", "attention_factor", "mscale",
              "mscale_all_dim", "beta_fast", "beta_slow", "truncate")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings")  # all required, as transformers reads them
_KEYS = {"yarn": _YARN_KEYS, "llama3": _LLAMA3_KEYS}
_ALWAYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")


def rope_scaling_items(rope_parameters: dict, max_position_embeddings: int,
                       rope_types: tuple[str, ...] = ROPE_TYPES,
                       where: str = "with latent attention") -> tuple:
  """A config's `rope_parameters` (after AutoConfig) as the sorted (key, value) items that
  `ModelConfig.rope_scaling` keeps: empty for plain RoPE, the YaRN or llama3 parameters
  otherwise. Refuses rope types outside `rope_types` and keys jspec does not implement, naming
  them; `where` completes the partial-rotary refusal (the caller's attention)."""
  params = dict(rope_parameters or {})
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type not in rope_types:
    raise ValueError(f"rope_type={rope_type!r} is not supported; jspec supports "
                     f"{list(rope_types)}")
  partial = params.get("partial_rotary_factor", 1.0)
  if partial not in (None, 1.0):
    raise ValueError(f"partial_rotary_factor={partial!r} is not supported {where}; jspec "
                     "supports 1.0")
  if rope_type == "default":
    return ()
  unknown = sorted(set(params) - set(_KEYS[rope_type]) - set(_ALWAYS))
  if unknown:
    raise ValueError(f"rope_parameters has keys {unknown} that jspec's {rope_type} RoPE does not "
                     f"read; it reads {list(_KEYS[rope_type])}")
  if rope_type == "llama3":
    missing = [k for k in _LLAMA3_KEYS if params.get(k) is None]
    if missing:
      raise ValueError(f"rope_type='llama3' needs rope_parameters {missing}")
    return tuple(sorted({"rope_type": "llama3", "factor": float(params["factor"]),
                         "low_freq_factor": float(params["low_freq_factor"]),
                         "high_freq_factor": float(params["high_freq_factor"]),
                         "original_max_position_embeddings":
                             int(params["original_max_position_embeddings"])}.items()))
  original = params.get("original_max_position_embeddings") or max_position_embeddings
  factor = params.get("factor")
  if factor is None:  # transformers: the ratio of the two lengths (DeepSeek-V3's convention)
    factor = max_position_embeddings / original
  items = {"rope_type": "yarn", "factor": float(factor),
           "original_max_position_embeddings": int(original)}
  for key in ("attention_factor", "mscale", "mscale_all_dim", "beta_fast", "beta_slow"):
    if params.get(key) is not None:
      items[key] = float(params[key])
  items["truncate"] = bool(params.get("truncate", True))
  return tuple(sorted(items.items()))


def get_mscale(scale: float, mscale: float = 1.0) -> float:
  """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
  if scale <= 1:
    return 1.0
  return 0.1 * mscale * math.log(scale) + 1.0


def inv_frequencies(dim: int, theta: float, scaling: tuple = ()) -> tuple[np.ndarray, float]:
  """(inv_freq [dim/2] float32, attention_factor) of RoPE over `dim` rotary dims."""
  exponents = np.arange(0, dim, 2).astype(np.float32) / np.float32(dim)
  pos_freqs = np.power(np.float32(theta), exponents, dtype=np.float32)
  extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
  params = dict(scaling)
  if params.get("rope_type", "default") == "default":
    return extrapolation, 1.0
  if params["rope_type"] == "llama3":
    return llama3_inv_frequencies(extrapolation, params), 1.0
  factor = params["factor"]
  original = params["original_max_position_embeddings"]
  mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
  attention_factor = params.get("attention_factor")
  if attention_factor is None:
    if mscale and mscale_all_dim:
      attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
    else:
      attention_factor = get_mscale(factor)
  beta_fast = params.get("beta_fast") or 32
  beta_slow = params.get("beta_slow") or 1

  def correction_dim(rotations):  # the rotary dim that turns `rotations` times over `original`
    return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

  low, high = correction_dim(beta_fast), correction_dim(beta_slow)
  if params.get("truncate", True):
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001  # transformers' guard against a zero-width ramp
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  extrapolation_weight = (1 - ramp).astype(np.float32)
  interpolation = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
  inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
  return inv_freq.astype(np.float32), float(attention_factor)


def llama3_inv_frequencies(inv_freq: np.ndarray, params: dict) -> np.ndarray:
  """transformers `_compute_llama3_parameters`, operation for operation in float32."""
  f32 = np.float32
  factor, original = f32(params["factor"]), params["original_max_position_embeddings"]
  low_factor, high_factor = params["low_freq_factor"], params["high_freq_factor"]
  low_freq_wavelen = f32(original / low_factor)
  high_freq_wavelen = f32(original / high_factor)
  wavelen = (f32(2 * math.pi) / inv_freq).astype(f32)
  scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq).astype(f32)
  smooth = ((f32(original) / wavelen - f32(low_factor)) / f32(high_factor - low_factor)).astype(f32)
  smoothed = ((f32(1) - smooth) * scaled / factor + smooth * scaled).astype(f32)
  is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
  return np.where(is_medium, smoothed, scaled).astype(f32)


def softmax_scale(qk_head_dim: int, scaling: tuple = ()) -> float:
  """DeepSeek-V3's attention scale: qk_head_dim^-0.5, times get_mscale(factor,
  mscale_all_dim)^2 under YaRN when mscale_all_dim is set (transformers `yarn_apply_mscale`)."""
  scale = qk_head_dim ** -0.5
  params = dict(scaling)
  if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
    mscale = get_mscale(params["factor"], params["mscale_all_dim"])
    scale = scale * mscale * mscale
  return scale


def deinterleave(x):
  """[..., x0, x1, x2, x3, ...] -> [..., x0, x2, ..., x1, x3, ...]: pairs to halves."""
  return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def apply_rope(x_BTNH, positions_BT, inv_freq_H2: np.ndarray, attention_factor: float = 1.0,
               interleave: bool = False):
  """Rotate-half RoPE over the whole last axis (2 * len(inv_freq) dims), cos and sin scaled
  by `attention_factor`; with `interleave`, the input's pairs are de-interleaved first
  (transformers `apply_rotary_pos_emb_interleave`). Computed in float32, cast back."""
  x32 = x_BTNH.astype(jnp.float32)
  if interleave:
    x32 = deinterleave(x32)
  angles_BTH2 = positions_BT[..., None].astype(jnp.float32) * jnp.asarray(inv_freq_H2)
  angles_BTH = jnp.concatenate([angles_BTH2, angles_BTH2], axis=-1)
  angles_BTH = angles_BTH.reshape(angles_BTH.shape[:2] + (1,) * (x32.ndim - 3)
                                  + angles_BTH.shape[-1:])
  cos = jnp.cos(angles_BTH) * attention_factor
  sin = jnp.sin(angles_BTH) * attention_factor
  half = x32.shape[-1] // 2
  rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
  return (x32 * cos + rotated * sin).astype(x_BTNH.dtype)


def rope(x_BTNH, positions_BT, theta: float, rotary_dim: int | None = None):
  """Rotary embedding in the rotate-half convention of Qwen3 (transformers `apply_rotary_pos_emb`),
  over the first `rotary_dim` dims of each head (partial RoPE, as Qwen3-Next / Qwen3.5, GLM-4.5's
  `Glm4MoeAttention` and bamba's `apply_rotary_pos_emb` do: the two halves of the rotated part,
  not interleaved pairs); the rest pass through. Frequencies are over rotary_dim."""
  head_dim = x_BTNH.shape[-1]
  dim = head_dim if rotary_dim is None else rotary_dim
  inv_freq_H2 = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  angles_BTH2 = positions_BT[..., None].astype(jnp.float32) * inv_freq_H2
  angles_BTH = jnp.concatenate([angles_BTH2, angles_BTH2], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(angles_BTH), jnp.sin(angles_BTH)
  x32 = x_BTNH.astype(jnp.float32)
  rot, rest = x32[..., :dim], x32[..., dim:]
  half = dim // 2
  rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
  out = jnp.concatenate([rot * cos + rotated * sin, rest], axis=-1)
  return out.astype(x_BTNH.dtype)

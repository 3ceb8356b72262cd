"""What the Pallas MoE kernel tests (test_pallas_moe.py, test_pallas_moe_decode.py) share: a
random expert problem, the chunked jnp reference, the relative error and its tolerances, and
the NaN poisoning that makes an unwritten row fail on the GPU (interpret mode fills every
kernel buffer with NaN by itself).

Imported as a top-level module, as helpers.py is: pytest puts tests/ on sys.path (rootdir
conftest, no package), in each xdist worker too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.models.moe_backends import experts_reference

ON_GPU = jax.devices()[0].platform == "gpu"
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a Hopper GPU")

# Relative L2 error allowed: bf16 operands round to ~4e-3; fp32 runs exact in interpret mode.
TOLERANCE = {jnp.bfloat16: 2e-2, jnp.float32: 1e-4}


def rel_err(got, want):
  got = np.asarray(got, np.float64)
  want = np.asarray(want, np.float64)
  assert np.all(np.isfinite(got)), "output holds NaN/inf: a row was left unwritten"
  return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def poison(shape, dtype):
  """Leaves a freed NaN buffer for the next allocation to reuse (GPU); no-op in interpret."""
  if ON_GPU:
    jnp.full(shape, jnp.nan, dtype).block_until_ready()


def expert_problem(seed, num_tokens, num_experts, top_k, dim, ffn, dtype, experts_used=None,
                   invalid_fraction=0.0, distinct=True):
  """(x, ids, weights, w_gate, w_up, w_down): ids drawn from `experts_used` (default all),
  distinct per token where `distinct` and the pool allows it (as a router's top-k gives), a
  share `invalid_fraction` of them -1."""
  keys = jax.random.split(jax.random.key(seed), 7)
  x = jax.random.normal(keys[0], (num_tokens, dim), jnp.float32).astype(dtype)
  w_gate = (jax.random.normal(keys[1], (num_experts, dim, ffn)) / np.sqrt(dim)).astype(dtype)
  w_up = (jax.random.normal(keys[2], (num_experts, dim, ffn)) / np.sqrt(dim)).astype(dtype)
  w_down = (jax.random.normal(keys[3], (num_experts, ffn, dim)) / np.sqrt(ffn)).astype(dtype)
  pool = np.arange(num_experts) if experts_used is None else np.asarray(experts_used)
  if distinct and top_k <= len(pool):
    picks = jnp.argsort(jax.random.uniform(keys[4], (num_tokens, len(pool))), axis=1)[:, :top_k]
  else:
    picks = jax.random.randint(keys[4], (num_tokens, top_k), 0, len(pool))
  ids = jnp.asarray(pool, jnp.int32)[picks]
  if invalid_fraction:
    drop = jax.random.uniform(keys[5], ids.shape) < invalid_fraction
    ids = jnp.where(drop, -1, ids)
  weights = jax.nn.softmax(jax.random.normal(keys[6], (num_tokens, top_k)), axis=-1)
  return x, ids, weights, w_gate, w_up, w_down


def chunked_reference(x, ids, weights, w_gate, w_up, w_down, chunk=16):
  """experts_reference over token chunks, where gathering every token's K experts' weights at
  once would not fit."""
  num_tokens, top_k = ids.shape
  if num_tokens <= chunk:
    return experts_reference(x, ids, weights, w_gate, w_up, w_down)
  pad = -num_tokens % chunk
  xs = jnp.pad(x, ((0, pad), (0, 0))).reshape(-1, chunk, x.shape[1])
  ids_c = jnp.pad(ids, ((0, pad), (0, 0)), constant_values=-1).reshape(-1, chunk, top_k)
  w_c = jnp.pad(weights, ((0, pad), (0, 0))).reshape(-1, chunk, top_k)
  # The weights are arguments, not closed-over constants: a DeepSeek-sized constant would be
  # embedded in (and hashed with) the program.
  ys = jax.jit(lambda xs, ids_c, w_c, w_gate, w_up, w_down: jax.lax.map(
      lambda a: experts_reference(a[0], a[1], a[2], w_gate, w_up, w_down), (xs, ids_c, w_c)))(
          xs, ids_c, w_c, w_gate, w_up, w_down)
  return ys.reshape(-1, x.shape[1])[:num_tokens]

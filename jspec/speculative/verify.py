"""Verification of draft tokens against one target forward: greedy and lossless sampling.

Shape letters: B batch, K draft tokens per sequence (static), K1 = K + 1 verify positions,
V vocabulary. Target position j predicts the token after draft j-1; position 0 follows the
last committed token, position K is the bonus position after the last draft.

Both functions return ``(accept_len_B, out_tokens_BK1)``: the step emits
``out_tokens[b, :accept_len[b] + 1]`` -- the accepted drafts, then one token drawn from the
target (the correction at the first rejection, or the bonus after a fully accepted run).
Entries after that are `PLACEHOLDER_TOKEN` (-1): they are never a valid token id, so a
caller that forgets to mask them fails loudly instead of emitting a plausible token.
Positions ``j >= draft_len[b]`` are never accepted, whatever the draft buffer holds there.

References: Leviathan, Kalman, Matias 2023, "Fast Inference from Transformers via
Speculative Decoding" (Algorithm 1); Chen et al. 2023, "Accelerating Large Language Model
Decoding with Speculative Sampling" (Algorithm 2, the modified rejection sampling).
vLLM's and tpu-inference's rejection samplers implement the same rule.
"""

import jax
import jax.numpy as jnp

from jspec.shapes.rows import row_items
from jspec.speculative.sampling import sample, vocab_argmax

PLACEHOLDER_TOKEN = -1

# Independent streams derived from one per-position key: the acceptance uniform uses the key
# itself, the correction/bonus draw uses it folded with this constant.
_RESAMPLE_FOLD = 1


def _emit(draft_BK, accept_len_B, next_token_B):
    """Drafts before accept_len, next_token at accept_len, placeholders after."""
    B, K = draft_BK.shape
    j_K1 = jnp.arange(K + 1, dtype=jnp.int32)[None, :]
    drafts_BK1 = jnp.pad(draft_BK.astype(jnp.int32), ((0, 0), (0, 1)))
    a_B1 = accept_len_B[:, None]
    return jnp.where(j_K1 < a_B1, drafts_BK1,
                     jnp.where(j_K1 == a_B1, next_token_B[:, None], PLACEHOLDER_TOKEN))


def _prefix_len(ok_BK, draft_len_B):
    """Length of the leading run of True among the first draft_len positions."""
    K = ok_BK.shape[1]
    valid_BK = jnp.arange(K)[None, :] < draft_len_B[:, None]
    run_BK = jnp.cumprod((ok_BK & valid_BK).astype(jnp.int32), axis=1)
    return jnp.sum(run_BK, axis=1).astype(jnp.int32)


def greedy_verify(draft_BK, draft_len_B, target_logits_BK1V, argmax=vocab_argmax):
    """Accept the longest prefix of drafts equal to the target's argmax, then the argmax.

    This is what makes greedy speculative output equal greedy vanilla output token for token:
    every emitted token is the target's argmax given the accepted prefix.

    Args:
      draft_BK: [B, K] int draft tokens (entries at j >= draft_len are ignored).
      draft_len_B: [B] int in [0, K].
      target_logits_BK1V: [B, K+1, V] target logits at the K+1 verify positions.
      argmax: vocab_argmax, or a function equal to it (LoopContext.vocab_argmax).
    Returns:
      accept_len_B: [B] int32 in [0, draft_len].
      out_tokens_BK1: [B, K+1] int32 (placeholders -1 after position accept_len).
    """
    B, K = draft_BK.shape
    target_argmax_BK1 = argmax(target_logits_BK1V).astype(jnp.int32)
    match_BK = draft_BK.astype(jnp.int32) == target_argmax_BK1[:, :K]
    accept_len_B = _prefix_len(match_BK, draft_len_B)
    next_B = jnp.take_along_axis(target_argmax_BK1, accept_len_B[:, None], axis=1)[:, 0]
    return accept_len_B, _emit(draft_BK, accept_len_B, next_B)


def _accept_draft(u_BK, p_draft_BK, q_draft_BK):
    """Accept with probability min(1, p/q): u < p/q, written without the division.

    u is in [0, 1), so p >= q always accepts, and p = 0 never does; for one-hot p this is
    exactly "draft == argmax".
    """
    return u_BK * q_draft_BK < p_draft_BK


def residual_probs(p_BV, q_BV):
    """norm(max(0, p - q)): the distribution to resample from after a rejection.

    The residual mass equals the rejection probability 1 - sum_x min(p, q), so it is zero only
    when p == q, where rejection cannot happen; the guard falls back to p so that rounding
    never yields a 0/0 row.
    """
    residual_BV = jnp.maximum(p_BV - q_BV, 0.0)
    mass_B1 = jnp.sum(residual_BV, axis=-1, keepdims=True)
    return jnp.where(mass_B1 > 0.0, residual_BV / jnp.where(mass_B1 > 0.0, mass_B1, 1.0), p_BV)


def rejection_verify(draft_BK, draft_len_B, draft_probs_BKV, target_probs_BK1V, keys_BK1):
    """Lossless speculative sampling: the emitted tokens are distributed exactly as the target.

    For j < draft_len, draft j is accepted with probability min(1, p_j(d_j) / q_j(d_j)),
    using u ~ U[0, 1) from ``keys[b, j]``. At the first rejection a the correction token is
    drawn from norm(max(0, p_a - q_a)); if all draft_len drafts are accepted the bonus is drawn
    from p_{draft_len}. Both draws use ``fold_in(keys[b, a], 1)``, independent of the uniforms.
    The two cases share one code path: q at positions j >= draft_len is taken as 0, so the
    residual there is p itself.

    With one-hot target rows (temperature 0 in `processed_probs`) this returns exactly
    `greedy_verify`'s result, whatever the draft distribution.

    Args:
      draft_BK: [B, K] int draft tokens, each drawn from its draft_probs row (or chosen
        deterministically when draft_probs is None).
      draft_len_B: [B] int in [0, K].
      draft_probs_BKV: [B, K, V] the processed distributions the drafts were sampled from
        (same temperature/top-k/top-p as the target), or None for a deterministic drafter
        (n-gram): q is then the point mass on each draft.
      target_probs_BK1V: [B, K+1, V] processed target distributions.
      keys_BK1: [B, K+1] keys (typed, or raw [B, K+1, 2]), e.g. from `position_keys`. They
        must be independent of the keys the drafter sampled with, or acceptance would be
        correlated with the draft and the output biased.
    Returns:
      accept_len_B: [B] int32 in [0, draft_len].
      out_tokens_BK1: [B, K+1] int32 (placeholders -1 after position accept_len).
    """
    K = draft_BK.shape[1]
    V = target_probs_BK1V.shape[-1]
    p_BK1V = target_probs_BK1V.astype(jnp.float32)
    # Drafts beyond draft_len may be any value; clip so the gathers stay in bounds.
    draft_BK = jnp.clip(draft_BK.astype(jnp.int32), 0, V - 1)
    if draft_probs_BKV is None:
        q_BKV = jax.nn.one_hot(draft_BK, V, dtype=jnp.float32)
    else:
        q_BKV = draft_probs_BKV.astype(jnp.float32)

    p_draft_BK = jnp.take_along_axis(p_BK1V[:, :K], draft_BK[..., None], axis=-1)[..., 0]
    q_draft_BK = jnp.take_along_axis(q_BKV, draft_BK[..., None], axis=-1)[..., 0]
    uniform = lambda key: jax.random.uniform(key, (), jnp.float32)
    u_BK = jax.vmap(jax.vmap(uniform))(keys_BK1[:, :K])
    accept_len_B = _prefix_len(_accept_draft(u_BK, p_draft_BK, q_draft_BK), draft_len_B)

    # Only row accept_len of each sequence is needed: gather it before resampling.
    p_BV = row_items(p_BK1V, accept_len_B)
    q_at_a_BV = row_items(jnp.pad(q_BKV, ((0, 0), (0, 1), (0, 0))), accept_len_B)
    q_BV = jnp.where((accept_len_B < draft_len_B)[:, None], q_at_a_BV, 0.0)
    resample_keys_B = jax.vmap(jax.random.fold_in, in_axes=(0, None))(
        row_items(keys_BK1, accept_len_B), _RESAMPLE_FOLD)
    next_B = sample(residual_probs(p_BV, q_BV), resample_keys_B)
    return accept_len_B, _emit(draft_BK, accept_len_B, next_B)

"""Per-request sampling distributions, categorical sampling and position-keyed randomness.

Shape letters: N rows (any flattening of batch x positions), V vocabulary, B batch,
T positions per sequence.

Why one function produces the distribution for both target and draft: lossless speculative
sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling")
preserves whatever distribution the target is sampled from, provided the acceptance ratio
p(x)/q(x) is computed on the *processed* distributions (after temperature, top-k and top-p)
of both models. Sharing `processed_probs` is what makes the two consistent.

Greedy decoding is not a special case anywhere downstream: a row with temperature 0 becomes
the one-hot of its argmax, and with one-hot target rows the rejection rule accepts a draft
exactly when it equals the argmax and otherwise emits the argmax (see `verify.py`). A batch
that mixes greedy and sampled requests therefore runs one code path.
"""

import jax
import jax.numpy as jnp
from jax import lax

from jspec.sharding.vocab import keyed_argmax, order_keys
from jspec.shapes.rows import set_row_items


def vocab_argmax(logits_NV, axis: int = -1):
    """jnp.argmax along `axis` (the lowest index among ties; a row holding NaN gives its first
    NaN, as jnp.argmax does), written as two single-operand integer reductions: the row's
    largest order key, then the lowest index that holds it. The keys are the values' float32
    bits, reordered so that integer order is float order (-0.0 made +0.0 first, so that the
    two zeros tie, and every NaN the largest key): XLA's float max need not propagate NaN.

    Why not jnp.argmax: with the vocabulary split over tp, XLA partitions jnp.argmax, a
    reduction over (value, index) pairs, into all-gathers of every shard's pair, which NCCL
    ran at about 45 µs a step on 2 H100s; a max and a min partition into all-reduces, which
    XLA runs with its own one-shot kernels (8-11 µs each in the same profile; BENCHMARKS.md,
    "Tensor parallelism at batch 1: ...").
    """
    return keyed_argmax(order_keys(logits_NV), axis)[1]


def processed_rows(logits_BWV, temperature_B, top_k_B, top_p_B, any_filtered: bool = True):
    """[B, W, V] -> [B, W, V]: `processed_probs` of W rows per sequence (a verify window, a
    tree's nodes), each with its own sequence's sampling settings."""
    batch, width, vocab = logits_BWV.shape
    repeat = lambda x_B: jnp.repeat(jnp.asarray(x_B), width)
    return processed_probs(logits_BWV.reshape(batch * width, vocab), repeat(temperature_B),
                           repeat(top_k_B), repeat(top_p_B), any_filtered
                           ).reshape(batch, width, vocab)


def processed_probs(logits_NV, temperature_N, top_k_N, top_p_N, any_filtered: bool = True):
    """The float32 distribution a request samples from, row by row.

    Order (as in Hugging Face's logits warpers and vLLM's sampler): divide by temperature,
    keep the top-k tokens (``top_k <= 0`` = off), renormalise, keep the smallest set of the
    highest-probability tokens whose mass reaches ``top_p`` (``top_p >= 1`` = off; the top
    token is always kept), renormalise.

    Tie rule: tokens are ranked by (logit descending, index ascending), so top-k keeps exactly
    k tokens and, among equal logits, the lower indices. Rows with ``temperature <= 0`` return
    the one-hot of ``jnp.argmax(logits)`` (lowest index among ties) so that greedy rows give
    bit-identical results to `verify.greedy_verify`.

    Rows with neither top-k nor top-p get a plain softmax in vocabulary order, never the
    sorted path, so their probabilities are bit-identical whatever the other rows ask for (a
    seeded request samples the same tokens in any batch). `any_filtered=False` (static: no row
    uses top-k or top-p) skips the sort altogether, which costs a sort of V per row.

    Args:
      logits_NV: [N, V] logits (any float dtype; computed in float32).
      temperature_N: [N] float; 0 means greedy.
      top_k_N: [N] int32; 0 means off.
      top_p_N: [N] float in (0, 1]; 1.0 means off.
      any_filtered: static; False promises every row has top_k <= 0 and top_p >= 1.
    Returns:
      probs_NV: [N, V] float32, each row sums to 1.
    """
    logits_NV = logits_NV.astype(jnp.float32)
    V = logits_NV.shape[-1]
    temperature_N = jnp.asarray(temperature_N, jnp.float32)
    top_k_N = jnp.asarray(top_k_N, jnp.int32)
    top_p_N = jnp.asarray(top_p_N, jnp.float32)

    greedy_N = temperature_N <= 0.0
    scaled_NV = logits_NV / jnp.where(greedy_N, 1.0, temperature_N)[:, None]
    onehot_NV = jax.nn.one_hot(vocab_argmax(logits_NV), V, dtype=jnp.float32)
    plain_NV = jax.nn.softmax(scaled_NV, axis=-1)
    if not any_filtered:
        return jnp.where(greedy_N[:, None], onehot_NV, plain_NV)
    filtered_N = (top_k_N > 0) | (top_p_N < 1.0)

    # One stable sort of the negated logits ranks by (logit desc, index asc); top-k and
    # top-p are both prefixes of that order, so they become one mask in sorted space.
    order_NV = jnp.argsort(-scaled_NV, axis=-1, stable=True)
    sorted_NV = jnp.take_along_axis(scaled_NV, order_NV, axis=-1)
    rank_V = jnp.arange(V, dtype=jnp.int32)
    k_N = jnp.where(top_k_N <= 0, V, jnp.minimum(top_k_N, V))
    in_top_k_NV = rank_V[None, :] < k_N[:, None]
    sorted_probs_NV = jax.nn.softmax(jnp.where(in_top_k_NV, sorted_NV, -jnp.inf), axis=-1)
    # A token is in the nucleus if the mass strictly before it is still short of top_p:
    # this is the smallest prefix with mass >= top_p, and always contains rank 0.
    mass_before_NV = jnp.cumsum(sorted_probs_NV, axis=-1) - sorted_probs_NV
    in_top_p_NV = (mass_before_NV < top_p_N[:, None]) | (top_p_N[:, None] >= 1.0)
    kept_NV = jnp.where(in_top_k_NV & in_top_p_NV, sorted_probs_NV, 0.0)
    kept_NV = kept_NV / jnp.sum(kept_NV, axis=-1, keepdims=True)
    probs_NV = set_row_items(jnp.zeros_like(kept_NV), order_NV, kept_NV)
    probs_NV = jnp.where(filtered_N[:, None], probs_NV, plain_NV)
    return jnp.where(greedy_N[:, None], onehot_NV, probs_NV)


def sample(probs_NV, keys_N):
    """One categorical draw per row, each with its own key.

    Gumbel-max on log-probabilities, as `jax.random.categorical` draws (the same Gumbel
    noise, so the same tokens: tests/test_vocab_argmax.py holds them equal), its argmax
    taken by vocab_argmax (which says why): zero-probability tokens get log 0 = -inf and can
    never win, so a one-hot row returns its index exactly, whatever the key. Keys may be
    typed (`jax.random.key`) or raw uint32 keys.

    Returns:
      tokens_N: [N] int32.
    """
    logp_NV = jnp.log(probs_NV.astype(jnp.float32))
    draw = lambda key, logp_V: vocab_argmax(
        jax.random.gumbel(key, logp_V.shape, logp_V.dtype) + logp_V)
    return jax.vmap(draw)(keys_N, logp_NV).astype(jnp.int32)


def position_keys(seed_keys_B, positions_BT):
    """Per-token keys: each sequence's seed key folded with the absolute position sampled.

    The randomness a request sees depends only on its own seed and on where in its sequence a
    token is drawn, never on its batch slot, batch bucket or on how many tokens a step
    emits, so a seeded request reproduces across batch compositions (the same discipline as
    vLLM's per-request generators). Callers that need several independent streams at one
    position (e.g. a drafter's sample vs. the verifier's uniform) fold a further constant.

    Args:
      seed_keys_B: [B] keys (typed, or raw [B, 2] uint32).
      positions_BT: [B, T] int positions of the tokens to be sampled.
    Returns:
      keys_BT: [B, T] keys (typed, or raw [B, T, 2]).
    """
    fold_T = jax.vmap(jax.random.fold_in, in_axes=(None, 0))
    return jax.vmap(fold_T)(seed_keys_B, positions_BT.astype(jnp.uint32))

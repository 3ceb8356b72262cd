"""N-gram (prompt lookup) drafting, on device.

Prompt-lookup decoding (Saxena 2023, "Prompt Lookup Decoding"; `prompt_lookup_num_tokens` in
Hugging Face transformers; vLLM's `NgramProposer`): if the last n tokens occurred earlier in
the sequence, propose the tokens that followed that earlier occurrence. It needs no draft
model and pays off on inputs that copy from their context (code edits, summaries, RAG).

Shape letters: B batch, S token-buffer length (static), K draft tokens (static), W number of
window start positions (S - n + 1) for an n-gram.

Everything is elementwise compares of the buffer against shifted copies of itself, so the
whole proposer is O(n_max^2 * B * S) vector work inside the jitted decode loop: no host round
trip, no data-dependent shapes.
"""

import numbers

import jax.numpy as jnp


def _check_args(k, n_min, n_max):
    if not (isinstance(k, numbers.Integral) and k >= 1):
        raise ValueError(f"ngram_propose: k must be an int >= 1, got k={k!r}")
    if not (isinstance(n_min, numbers.Integral) and n_min >= 1):
        raise ValueError(f"ngram_propose: n_min must be an int >= 1, got n_min={n_min!r}")
    if not (isinstance(n_max, numbers.Integral) and n_max >= n_min):
        raise ValueError(
            f"ngram_propose: n_max must be an int >= n_min, got n_min={n_min!r}, n_max={n_max!r}")


def _latest_match_start(tokens_BS, lengths_B, n):
    """Largest i with tokens[i:i+n] == the last n tokens and i + n <= length - 1, else -1.

    i + n <= length - 1 excludes the suffix itself and guarantees a token follows the match.
    Buffer entries at or beyond length can only enter a window starting at i > length - 1 - n,
    which the bound masks out, so garbage there is ignored.
    """
    B, S = tokens_BS.shape
    W = S - n + 1
    # Suffix positions length-n .. length-1; when length < n + 1 no i satisfies the bound,
    # so clipped (meaningless) suffix gathers cannot produce a match.
    suffix_pos_Bn = jnp.clip(lengths_B[:, None] - n + jnp.arange(n)[None, :], 0, S - 1)
    suffix_Bn = jnp.take_along_axis(tokens_BS, suffix_pos_Bn, axis=1)
    match_BW = jnp.ones((B, W), dtype=bool)
    for t in range(n):  # static, n <= n_max (small)
        match_BW &= tokens_BS[:, t:t + W] == suffix_Bn[:, t:t + 1]
    i_W = jnp.arange(W, dtype=jnp.int32)
    match_BW &= i_W[None, :] <= (lengths_B[:, None] - 1 - n)
    return jnp.max(jnp.where(match_BW, i_W[None, :], -1), axis=1)


def ngram_propose(tokens_BS, lengths_B, k, n_min, n_max):
    """Propose up to k tokens per sequence by prompt lookup.

    For n from n_max down to n_min, the first n whose suffix (the last n tokens) occurs
    earlier wins, and among its occurrences the most recent one (largest start). The proposal
    is the tokens that followed it, up to k and up to the end of the sequence.

    Args:
      tokens_BS: [B, S] int token buffer; only tokens[b, :lengths[b]] is read.
      lengths_B: [B] int sequence lengths.
      k, n_min, n_max: static ints, 1 <= n_min <= n_max, k >= 1.
    Returns:
      draft_BK: [B, k] int32; entries at j >= draft_len are 0 (a valid id, because the
        verify forward consumes all k slots even when fewer are proposed).
      draft_len_B: [B] int32 in [0, k]; 0 when nothing matches.
    Raises:
      ValueError: for k, n_min or n_max out of range.
    """
    _check_args(k, n_min, n_max)
    k, n_min, n_max = int(k), int(n_min), int(n_max)
    tokens_BS = jnp.asarray(tokens_BS).astype(jnp.int32)
    lengths_B = jnp.asarray(lengths_B).astype(jnp.int32)
    B, S = tokens_BS.shape

    start_B = jnp.full((B,), -1, jnp.int32)   # start of the chosen match's continuation
    for n in range(n_max, n_min - 1, -1):      # static; a longer n-gram takes precedence
        if n + 1 > S:
            continue                           # no room for a match plus a follower
        i_B = _latest_match_start(tokens_BS, lengths_B, n)
        start_B = jnp.where((start_B < 0) & (i_B >= 0), i_B + n, start_B)

    found_B = start_B >= 0
    draft_len_B = jnp.where(found_B, jnp.clip(lengths_B - start_B, 0, k), 0)
    j_K = jnp.arange(k, dtype=jnp.int32)
    pos_BK = jnp.clip(start_B[:, None] + j_K[None, :], 0, S - 1)
    draft_BK = jnp.take_along_axis(tokens_BS, pos_BK, axis=1)
    draft_BK = jnp.where(j_K[None, :] < draft_len_B[:, None], draft_BK, 0)
    return draft_BK, draft_len_B.astype(jnp.int32)

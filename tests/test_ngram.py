"""Specification of on-device prompt-lookup (n-gram) drafting."""

import jax
import numpy as np
import pytest

from jspec.speculative.ngram import ngram_propose


def reference_propose(seq, k, n_min, n_max):
    """Plain Python: longest n first, most recent earlier occurrence, at least one follower."""
    L = len(seq)
    for n in range(n_max, n_min - 1, -1):
        if L < n + 1:
            continue
        suffix = seq[L - n:]
        for i in range(L - 1 - n, -1, -1):
            if seq[i:i + n] == suffix:
                return seq[i + n:min(i + n + k, L)]
    return []


@pytest.mark.parametrize("k,n_min,n_max", [(1, 1, 1), (3, 1, 3), (4, 2, 2), (8, 1, 5), (2, 3, 5)])
def test_matches_python_reference_on_random_sequences(k, n_min, n_max):
    rng = np.random.default_rng(k * 100 + n_min * 10 + n_max)
    B, S = 400, 24
    # Vocabulary of 3 so that matches are common; garbage after length is drawn from the same
    # vocabulary so that reading past length would produce wrong (plausible) matches.
    tokens = rng.integers(0, 3, (B, S)).astype(np.int32)
    lengths = rng.integers(0, S + 1, B).astype(np.int32)
    propose = jax.jit(ngram_propose, static_argnames=("k", "n_min", "n_max"))
    draft, draft_len = propose(tokens, lengths, k=k, n_min=n_min, n_max=n_max)
    draft, draft_len = np.asarray(draft), np.asarray(draft_len)
    assert draft.shape == (B, k)
    n_proposed = 0
    for b in range(B):
        want = reference_propose(tokens[b, :lengths[b]].tolist(), k, n_min, n_max)
        assert draft_len[b] == len(want), b
        assert draft[b, :draft_len[b]].tolist() == want, b
        assert (draft[b, draft_len[b]:] == 0).all(), b
        n_proposed += len(want) > 0
    assert 0 < n_proposed < B


def test_longer_ngram_wins_and_most_recent_occurrence_is_used():
    #        0  1  2  3  4  5  6  7  8  9
    seq = [7, 1, 2, 9, 3, 2, 8, 5, 1, 2]
    # bigram (1, 2) occurs at 1 -> followed by 9; unigram 2 most recently at 5 -> 8.
    draft, n = ngram_propose(np.array([seq + [0, 0]]), np.array([10]), k=3, n_min=1, n_max=2)
    assert int(n[0]) == 3 and np.asarray(draft)[0].tolist() == [9, 3, 2]
    draft, n = ngram_propose(np.array([seq + [0, 0]]), np.array([10]), k=3, n_min=1, n_max=1)
    assert int(n[0]) == 3 and np.asarray(draft)[0].tolist() == [8, 5, 1]


def test_proposal_is_truncated_at_sequence_end():
    seq = [4, 5, 6, 4, 5]  # (4, 5) at 0 -> followed by 6, 4, 5 then the end
    draft, n = ngram_propose(np.array([seq + [5, 5, 5]]), np.array([5]), k=8, n_min=2, n_max=2)
    assert int(n[0]) == 3 and np.asarray(draft)[0, :3].tolist() == [6, 4, 5]


def test_no_match_gives_zero_length():
    draft, n = ngram_propose(np.array([[1, 2, 3, 4], [1, 1, 0, 0]]), np.array([4, 1]),
                             k=2, n_min=1, n_max=3)
    assert np.asarray(n).tolist() == [0, 0]
    assert (np.asarray(draft) == 0).all()


def test_buffer_shorter_than_ngram_is_handled():
    draft, n = ngram_propose(np.array([[3, 3]]), np.array([2]), k=2, n_min=1, n_max=5)
    assert int(n[0]) == 1 and int(np.asarray(draft)[0, 0]) == 3


@pytest.mark.parametrize("k,n_min,n_max", [(0, 1, 2), (2, 0, 2), (2, 3, 2), (2, 1.5, 2)])
def test_bad_arguments_raise_value_error_naming_the_values(k, n_min, n_max):
    with pytest.raises(ValueError, match="ngram_propose"):
        ngram_propose(np.zeros((1, 8), np.int32), np.array([4]), k=k, n_min=n_min, n_max=n_max)

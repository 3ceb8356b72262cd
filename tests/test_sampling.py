"""Specification of the per-request sampling distribution, sampling, and position keys."""

import jax
import jax.numpy as jnp
import numpy as np

from jspec.speculative.sampling import position_keys, processed_probs, sample


def reference_probs(logits_V, temperature, top_k, top_p):
    """Plain NumPy (float64) temperature -> top-k -> top-p, written independently.

    Returns (probs_V, ambiguous): ambiguous marks rows where a cumulative mass lands within
    float32 rounding of top_p, where either answer would be defensible.
    """
    V = logits_V.shape[0]
    if temperature <= 0:
        return np.eye(V)[int(np.argmax(logits_V))], False
    x = logits_V.astype(np.float64) / temperature
    order = sorted(range(V), key=lambda i: (-x[i], i))
    kept = order[:top_k] if top_k > 0 else order
    w = np.exp(x[kept] - x[kept].max())
    w /= w.sum()
    ambiguous = False
    if top_p < 1.0:
        mass, nucleus = 0.0, []
        for token, prob in zip(kept, w):
            nucleus.append(token)
            mass += prob
            ambiguous |= abs(mass - top_p) < 1e-5
            if mass >= top_p:
                break
        kept, w = nucleus, w[:len(nucleus)] / w[:len(nucleus)].sum()
    probs = np.zeros(V)
    probs[kept] = w
    return probs, ambiguous


def random_rows(rng, N, V):
    # Half continuous logits, half small integers so that ties (and the tie rule) are exercised.
    logits = np.where(rng.random((N, 1)) < 0.5, rng.normal(0, 3, (N, V)),
                      rng.integers(-2, 3, (N, V)).astype(np.float64)).astype(np.float32)
    temperature = rng.choice([0.0, 0.3, 0.7, 1.0, 2.5], N).astype(np.float32)
    top_k = rng.choice([0, 1, 2, 5, V, V + 4], N).astype(np.int32)
    top_p = np.where(rng.random(N) < 0.4, 1.0, rng.uniform(0.05, 1.0, N)).astype(np.float32)
    return logits, temperature, top_k, top_p


def test_processed_probs_matches_numpy_reference():
    rng = np.random.default_rng(0)
    N, V = 3000, 16
    logits, temperature, top_k, top_p = random_rows(rng, N, V)
    got = np.asarray(jax.jit(processed_probs)(logits, temperature, top_k, top_p))
    checked = 0
    for n in range(N):
        want, ambiguous = reference_probs(logits[n], temperature[n], top_k[n], float(top_p[n]))
        if ambiguous:
            continue
        np.testing.assert_allclose(got[n], want, atol=2e-6, err_msg=f"row {n}")
        checked += 1
    assert checked > 0.95 * N
    assert got.dtype == np.float32


def test_temperature_zero_is_one_hot_of_argmax_lowest_index_on_ties():
    logits = np.array([[1.0, 3.0, 3.0, -1.0], [0.0, 0.0, 0.0, 0.0], [-5, -1, -2, -1]], np.float32)
    probs = processed_probs(logits, np.zeros(3, np.float32), np.array([0, 1, 2], np.int32),
                            np.array([1.0, 0.5, 0.1], np.float32))
    np.testing.assert_array_equal(np.asarray(probs), np.eye(4, dtype=np.float32)[[1, 0, 1]])


def test_top_p_always_keeps_the_top_token():
    logits = np.array([[0.0, 0.1, 0.2, 0.3]], np.float32)
    probs = processed_probs(logits, np.ones(1, np.float32), np.zeros(1, np.int32),
                            np.array([1e-6], np.float32))
    np.testing.assert_array_equal(np.asarray(probs), [[0.0, 0.0, 0.0, 1.0]])


def test_sample_returns_index_of_one_hot_rows_for_every_key():
    V, N = 11, 500
    idx = np.random.default_rng(1).integers(0, V, N)
    keys = jax.random.split(jax.random.key(0), N)
    tokens = jax.jit(sample)(jax.nn.one_hot(idx, V), keys)
    assert tokens.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(tokens), idx)


def test_sample_frequencies_follow_probs():
    probs_V = np.array([0.5, 0.0, 0.2, 0.25, 0.05], np.float32)
    N = 100_000
    keys = jax.random.split(jax.random.key(2), N)
    tokens = np.asarray(jax.jit(sample)(jnp.broadcast_to(probs_V, (N, 5)), keys))
    freq = np.bincount(tokens, minlength=5) / N
    assert freq[1] == 0
    # Per-cell standard error is at most 0.0016 at this N.
    np.testing.assert_allclose(freq, probs_V, atol=0.008)


def test_position_keys_do_not_depend_on_batch_composition():
    seeds = jax.random.split(jax.random.key(3), 3)
    positions = jnp.array([[5, 6, 7], [0, 1, 2], [40, 41, 42]], jnp.int32)
    keys_full = position_keys(seeds, positions)
    keys_alone = jax.jit(position_keys)(seeds[2:], positions[2:])
    np.testing.assert_array_equal(jax.random.key_data(keys_full[2]),
                                  jax.random.key_data(keys_alone[0]))
    # Same sequence, same position -> same key, even when it shows up in another step's window.
    keys_shifted = position_keys(seeds[:1], jnp.array([[6, 7, 8]], jnp.int32))
    np.testing.assert_array_equal(jax.random.key_data(keys_full[0, 1:]),
                                  jax.random.key_data(keys_shifted[0, :2]))
    # Distinct positions give distinct keys.
    data = jax.random.key_data(keys_full).reshape(9, -1)
    assert len({tuple(np.asarray(r)) for r in data}) == 9


def test_position_keys_accept_raw_uint32_keys():
    raw = jax.random.split(jax.random.PRNGKey(0), 2)
    keys = position_keys(raw, jnp.array([[0, 1], [2, 3]], jnp.int32))
    assert keys.shape == (2, 2, 2) and keys.dtype == jnp.uint32


def test_unfiltered_rows_do_not_depend_on_their_batch_mates():
    """A temperature-only row gets bit-identical probabilities whether or not another row of
    the batch uses top-k/top-p (the sorted path) and whether the sort runs at all."""
    rng = np.random.default_rng(7)
    logits = jnp.asarray(rng.normal(size=(4, 301)) * 3, jnp.float32)
    temperature = jnp.asarray([0.7, 1.3, 0.0, 1.0], jnp.float32)
    plain_k, plain_p = jnp.zeros(4, jnp.int32), jnp.ones(4, jnp.float32)
    mixed_k = plain_k.at[3].set(20)
    mixed_p = plain_p.at[3].set(0.8)
    alone = processed_probs(logits, temperature, plain_k, plain_p, any_filtered=False)
    sorted_path = processed_probs(logits, temperature, plain_k, plain_p)
    mixed = processed_probs(logits, temperature, mixed_k, mixed_p)
    np.testing.assert_array_equal(np.asarray(alone), np.asarray(sorted_path))
    np.testing.assert_array_equal(np.asarray(alone)[:3], np.asarray(mixed)[:3])
    assert np.count_nonzero(np.asarray(mixed)[3]) <= 20

"""Specification of greedy verification and lossless rejection sampling.

The distribution tests simulate one speculative step with K = 2 over a tiny vocabulary whose
target and draft models are fixed tables (the second position's distribution depends on the
first token, as a language model's would). The first two tokens of the generated sequence --
from this step, or the first token of this step and the next step's first token when this
step emits only one -- must be distributed as p0(x) * p1(y | x). A chi-square test at
alpha = 1e-4 checks it, and the same test must reject deliberately broken rules.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.speculative import verify
from jspec.speculative.sampling import processed_probs, sample
from jspec.speculative.verify import PLACEHOLDER_TOKEN, greedy_verify, rejection_verify

V = 6
N_SAMPLES = 200_000
ALPHA = 1e-4


def chi2_critical(df, alpha=ALPHA):
    """Upper-alpha chi-square quantile, Wilson-Hilferty approximation (good for df >= 3)."""
    z = float(jax.scipy.special.ndtri(1.0 - alpha))
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * np.sqrt(c)) ** 3


def chi2_test(observed, expected_probs):
    """(statistic, critical value); cells with zero probability must be empty."""
    observed, expected_probs = np.ravel(observed), np.ravel(expected_probs).astype(np.float64)
    support = expected_probs > 1e-9
    assert observed[~support].sum() == 0, "a token outside the target's support was emitted"
    expected = observed.sum() * expected_probs[support] / expected_probs[support].sum()
    stat = float(np.sum((observed[support] - expected) ** 2 / expected))
    return stat, chi2_critical(int(support.sum()) - 1)


def model_tables(seed, temperature, top_k, top_p):
    """Processed p0 [V], p1 [V, V] (row = first token) for target and draft (different logits)."""
    rng = np.random.default_rng(seed)
    process = lambda logits: np.asarray(processed_probs(
        logits, np.full(len(logits), temperature, np.float32),
        np.full(len(logits), top_k, np.int32), np.full(len(logits), top_p, np.float32)))
    target = rng.normal(0, 1.5, (1 + V, V)).astype(np.float32)
    draft = (target + rng.normal(0, 1.5, (1 + V, V))).astype(np.float32)
    p, q = process(target), process(draft)
    return p[0], p[1:], q[0], q[1:]


def simulate_first_two_tokens(tables, deterministic_draft, seed=0):
    """Returns the first two generated tokens [N, 2] and accept_len [N]."""
    p0, p1, q0, q1 = (jnp.asarray(t) for t in tables)
    key_draft, key_verify, key_next, key_len = jax.random.split(jax.random.key(seed), 4)

    @jax.jit
    def run(key_draft, key_verify, key_next, key_len):
        kd = jax.random.split(key_draft, (N_SAMPLES, 2))
        d0 = sample(jnp.broadcast_to(q0, (N_SAMPLES, V)), kd[:, 0])
        d1 = sample(q1[d0], kd[:, 1])
        draft_BK = jnp.stack([d0, d1], axis=1)
        draft_len_B = jax.random.randint(key_len, (N_SAMPLES,), 0, 3)
        draft_probs = None if deterministic_draft else jnp.stack(
            [jnp.broadcast_to(q0, (N_SAMPLES, V)), q1[d0]], axis=1)
        target = jnp.stack([jnp.broadcast_to(p0, (N_SAMPLES, V)), p1[d0], p1[d1]], axis=1)
        keys_BK1 = jax.random.split(key_verify, (N_SAMPLES, 3))
        accept_len, out = rejection_verify(draft_BK, draft_len_B, draft_probs, target, keys_BK1)
        # If this step emitted one token, the second comes from the next step, which would
        # (with no draft left to check) sample it from the target given the first.
        next_step = sample(p1[out[:, 0]], jax.random.split(key_next, N_SAMPLES))
        second = jnp.where(accept_len >= 1, out[:, 1], next_step)
        return jnp.stack([out[:, 0], second], axis=1), accept_len

    tokens, accept_len = run(key_draft, key_verify, key_next, key_len)
    return np.asarray(tokens), np.asarray(accept_len)


def pair_statistic(tables, deterministic_draft=False):
    p0, p1 = tables[0], tables[1]
    tokens, _ = simulate_first_two_tokens(tables, deterministic_draft)
    first_stat, first_crit = chi2_test(np.bincount(tokens[:, 0], minlength=V), p0)
    pair_counts = np.bincount(tokens[:, 0] * V + tokens[:, 1], minlength=V * V)
    pair_stat, pair_crit = chi2_test(pair_counts, p0[:, None] * p1)
    return first_stat / first_crit, pair_stat / pair_crit


SETTINGS = {
    "temperature": (0.8, 0, 1.0),
    "top_k": (1.0, 3, 1.0),
    "top_p": (1.2, 0, 0.75),
    "top_k_and_top_p": (0.9, 4, 0.85),
}


@pytest.mark.parametrize("setting", SETTINGS)
def test_rejection_sampling_preserves_target_distribution(setting):
    tables = model_tables(1, *SETTINGS[setting])
    assert np.abs(tables[0] - tables[2]).sum() > 0.2  # draft really differs from target
    first, pair = pair_statistic(tables)
    assert first < 1.0 and pair < 1.0, (first, pair)


def test_rejection_sampling_preserves_target_distribution_for_deterministic_drafts():
    first, pair = pair_statistic(model_tables(2, *SETTINGS["top_k_and_top_p"]),
                                 deterministic_draft=True)
    assert first < 1.0 and pair < 1.0, (first, pair)


BROKEN_RULES = {
    "always_accept": ("_accept_draft", lambda u, p, q: jnp.ones_like(u, dtype=bool)),
    "resample_from_p": ("residual_probs", lambda p, q: p),
    "accept_with_p": ("_accept_draft", lambda u, p, q: u < p),
}


@pytest.mark.parametrize("broken", BROKEN_RULES)
def test_distribution_test_detects_a_broken_rule(broken, monkeypatch):
    monkeypatch.setattr(verify, *BROKEN_RULES[broken])
    first, pair = pair_statistic(model_tables(1, *SETTINGS["temperature"]))
    assert max(first, pair) > 3.0, (first, pair)


@pytest.mark.parametrize("setting", ["temperature", "top_k_and_top_p"])
def test_acceptance_rate_is_sum_of_min_p_q(setting):
    p0, _, q0, _ = model_tables(3, *SETTINGS[setting])
    N = N_SAMPLES
    kd, kv = jax.random.split(jax.random.key(4))
    draft = sample(jnp.broadcast_to(q0, (N, V)), jax.random.split(kd, N))[:, None]
    accept_len, _ = jax.jit(rejection_verify)(
        draft, jnp.ones(N, jnp.int32), jnp.broadcast_to(q0, (N, 1, V)),
        jnp.broadcast_to(p0, (N, 2, V)), jax.random.split(kv, (N, 2)))
    expected = np.minimum(p0, q0).sum()
    sigma = np.sqrt(expected * (1 - expected) / N)
    assert abs(float(np.mean(accept_len)) - expected) < 5 * sigma


def greedy_cases(seed, B=600, K=4, V=8):
    rng = np.random.default_rng(seed)
    # Small-integer logits for half the rows so argmax ties (lowest index wins) occur.
    logits = np.where(rng.random((B, 1, 1)) < 0.5, rng.normal(0, 2, (B, K + 1, V)),
                      rng.integers(0, 3, (B, K + 1, V))).astype(np.float32)
    argmax = logits.argmax(-1)
    draft = np.where(rng.random((B, K)) < 0.7, argmax[:, :K], rng.integers(0, V, (B, K)))
    draft_len = rng.integers(0, K + 1, B)
    return logits, draft.astype(np.int32), draft_len.astype(np.int32)


def test_greedy_verify_hand_example():
    logits = np.full((2, 4, 5), -1.0, np.float32)
    for b, row in enumerate([[3, 1, 4, 2], [3, 1, 4, 2]]):
        logits[b, np.arange(4), row] = 1.0
    accept_len, out = greedy_verify(np.array([[3, 1, 0], [3, 1, 4]]), np.array([3, 2]), logits)
    assert np.asarray(accept_len).tolist() == [2, 2]
    assert np.asarray(out).tolist() == [[3, 1, 4, PLACEHOLDER_TOKEN],
                                        [3, 1, 4, PLACEHOLDER_TOKEN]]


def test_greedy_verify_accepts_longest_matching_prefix_within_draft_len():
    logits, draft, draft_len = greedy_cases(5)
    accept_len, out = jax.jit(greedy_verify)(draft, draft_len, logits)
    accept_len, out = np.asarray(accept_len), np.asarray(out)
    argmax = logits.argmax(-1)
    for b in range(len(draft)):
        want = 0
        while want < draft_len[b] and draft[b, want] == argmax[b, want]:
            want += 1
        assert accept_len[b] == want
        assert out[b, :want].tolist() == draft[b, :want].tolist()
        assert out[b, want] == argmax[b, want]
        assert (out[b, want + 1:] == PLACEHOLDER_TOKEN).all()
    assert (accept_len == draft_len).any() and (accept_len < draft_len).any()


@pytest.mark.parametrize("draft_kind", ["deterministic", "one_hot", "sampled"])
def test_one_hot_target_rows_give_exactly_greedy_result_in_mixed_batch(draft_kind):
    logits, draft, draft_len = greedy_cases(6)
    B, K1, Vg = logits.shape
    rng = np.random.default_rng(7)
    # Greedy and sampled requests share the batch; only temperature-0 rows must equal greedy.
    temperature_B = np.where(rng.random(B) < 0.5, 0.0, 1.0).astype(np.float32)
    flat = lambda x: np.repeat(x, K1)
    target = processed_probs(logits.reshape(-1, Vg), flat(temperature_B),
                             np.zeros(B * K1, np.int32), np.ones(B * K1, np.float32))
    target = target.reshape(B, K1, Vg)
    draft_probs = {
        "deterministic": None,
        "one_hot": jax.nn.one_hot(draft, Vg),
        "sampled": jax.nn.softmax(rng.normal(0, 1, (B, K1 - 1, Vg)).astype(np.float32)),
    }[draft_kind]
    keys = jax.random.split(jax.random.key(8), (B, K1))
    got_len, got_out = jax.jit(rejection_verify)(draft, draft_len, draft_probs, target, keys)
    want_len, want_out = greedy_verify(draft, draft_len, logits)
    greedy = temperature_B == 0
    np.testing.assert_array_equal(np.asarray(got_len)[greedy], np.asarray(want_len)[greedy])
    np.testing.assert_array_equal(np.asarray(got_out)[greedy], np.asarray(want_out)[greedy])
    assert (np.asarray(got_len) <= draft_len).all()


def test_positions_beyond_draft_len_are_never_accepted():
    B, K = 1000, 3
    rng = np.random.default_rng(9)
    p = jnp.full((B, K + 1, 4), 0.25)
    draft = rng.integers(0, 4, (B, K)).astype(np.int32)
    draft_len = rng.integers(0, K + 1, B).astype(np.int32)
    accept_len, out = rejection_verify(draft, draft_len, p[:, :K], p,
                                       jax.random.split(jax.random.key(10), (B, K + 1)))
    # p == q: every valid draft is accepted, none past draft_len; the bonus is a real token.
    np.testing.assert_array_equal(np.asarray(accept_len), draft_len)
    assert (np.asarray(out)[np.arange(B), draft_len] >= 0).all()


def test_zero_drafts_is_a_plain_sample_from_the_target():
    p0 = np.array([0.1, 0.0, 0.6, 0.3], np.float32)
    N = 50_000
    accept_len, out = jax.jit(rejection_verify)(
        jnp.zeros((N, 0), jnp.int32), jnp.zeros(N, jnp.int32), None,
        jnp.broadcast_to(p0, (N, 1, 4)), jax.random.split(jax.random.key(11), (N, 1)))
    assert (np.asarray(accept_len) == 0).all()
    stat, crit = chi2_test(np.bincount(np.asarray(out)[:, 0], minlength=4), p0)
    assert stat < crit

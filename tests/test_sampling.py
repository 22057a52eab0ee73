"""Sampling: truncation rules worked by hand, greedy, statistics and per-row RNG independence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.generation import SamplingConfig, process_logits, sample, token_logprobs

LOGP = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05]))


def _kept(cfg, logp=LOGP):
    return np.isfinite(np.asarray(process_logits(jnp.asarray(logp)[None], cfg)))[0]


def test_config_validation():
    for bad in (dict(temperature=-1), dict(top_k=-1), dict(top_p=0.0), dict(min_p=1.0)):
        with pytest.raises(ValueError):
            SamplingConfig(**bad)


@pytest.mark.parametrize(
    "top_p, kept",
    [(0.5, 1), (0.51, 2), (0.7, 2), (0.71, 3), (0.85, 3), (0.86, 4), (1.0, 5)],
)
def test_top_p_keeps_smallest_set_with_mass_at_least_p(top_p, kept):
    # Cumulative masses 0.5, 0.7, 0.85, 0.95, 1.0.
    mask = _kept(SamplingConfig(top_p=top_p))
    assert mask.sum() == kept and mask[:kept].all()


def test_top_k_min_p_and_renormalization():
    assert _kept(SamplingConfig(top_k=2)).tolist() == [1, 1, 0, 0, 0]
    # min_p=0.3: keep p >= 0.15 -> three tokens.
    assert _kept(SamplingConfig(min_p=0.3)).tolist() == [1, 1, 1, 0, 0]
    # top_k=3 then top_p=0.6 on the renormalized {0.5, 0.2, 0.15}/0.85: masses 0.588, 0.824.
    logq = process_logits(jnp.asarray(LOGP)[None], SamplingConfig(top_k=3, top_p=0.6))[0]
    np.testing.assert_allclose(np.exp(logq[:2]), [0.5 / 0.7, 0.2 / 0.7], rtol=1e-6)
    # Temperature 2 flattens: q ∝ p^(1/2).
    logq = process_logits(jnp.asarray(LOGP)[None], SamplingConfig(temperature=2.0))[0]
    expect = np.sqrt(np.exp(LOGP)) / np.sqrt(np.exp(LOGP)).sum()
    np.testing.assert_allclose(np.exp(logq), expect, rtol=1e-6)


def test_temperature_zero_is_greedy():
    logits = jax.random.normal(jax.random.key(0), (6, 11))
    cfg = SamplingConfig(temperature=0.0)
    tok, logp = sample(jax.random.key(1), logits, cfg)
    np.testing.assert_array_equal(tok, jnp.argmax(logits, -1))
    # Greedy log-prob convention: the unprocessed softmax.
    np.testing.assert_allclose(logp, jnp.max(jax.nn.log_softmax(logits), -1), rtol=1e-6)


def test_sample_logp_matches_token_logprobs():
    logits = jax.random.normal(jax.random.key(0), (4, 3, 17)) * 3
    cfg = SamplingConfig(temperature=0.7, top_k=8, top_p=0.9, min_p=0.05)
    tok, logp = sample(jax.random.key(2), logits.reshape(12, 17), cfg)
    scored = token_logprobs(logits, tok.reshape(4, 3), cfg)
    np.testing.assert_allclose(scored.reshape(12), logp, rtol=1e-6)
    assert np.isfinite(np.asarray(logp)).all()


def test_frequencies_match_processed_distribution():
    # Chi-square test of N draws against q (top_p = 0.9 keeps 4 tokens of LOGP).
    cfg = SamplingConfig(temperature=1.3, top_p=0.9)
    n = 20000
    logits = jnp.broadcast_to(jnp.asarray(LOGP, jnp.float32), (n, 5))
    tok, _ = sample(jax.random.key(3), logits, cfg)
    q = np.exp(np.asarray(process_logits(logits[:1], cfg))[0])
    counts = np.bincount(np.asarray(tok), minlength=5)
    assert counts[q == 0].sum() == 0
    nz = q > 0
    chi2 = (((counts[nz] - n * q[nz]) ** 2) / (n * q[nz])).sum()
    assert chi2 < 16.3  # 99.9% quantile of chi-square with 3 degrees of freedom


def test_per_row_rng_independence():
    cfg = SamplingConfig()
    logits = jnp.zeros((64, 50))
    tok, _ = sample(jax.random.key(4), logits, cfg)
    # Identical rows draw different tokens (a shared key would make them all equal) ...
    assert len(set(np.asarray(tok).tolist())) > 30
    # ... and row b's draw does not depend on the batch size.
    tok8, _ = sample(jax.random.key(4), logits[:8], cfg)
    np.testing.assert_array_equal(tok8, tok[:8])

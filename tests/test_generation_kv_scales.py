"""Static KV-cache scale calibration against hand-computed values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.generation import calibrate_kv_scales
from fp8rl_jax.models import QKVAmax


def _stats(k, v=None, q=None):
    k = jnp.asarray(k, jnp.float32)
    return QKVAmax(q_LK=k if q is None else q, k_LK=k, v_LK=k if v is None else v)


def test_single_batch_formula():
    amax = [[448.0, 224.0], [1.0, 4.48]]  # [L=2, K=2]
    s = calibrate_kv_scales(_stats(amax), margin=1.05)
    np.testing.assert_allclose(s.k, [[1.05, 0.525], [1.05 / 448, 0.0105]], rtol=1e-6)
    assert s.k.dtype == jnp.float32 and int(s.num_invalid) == 0
    s = calibrate_kv_scales(_stats(amax), margin=1.0, fp8_dtype="float8_e5m2")
    np.testing.assert_allclose(s.v[0, 0], 448.0 / 57344.0, rtol=1e-6)


def test_nearest_rank_percentile_over_microbatches():
    # M = 2000 micro-batch maxima 1..2000 for every (layer, head); the 99.9th nearest-rank
    # percentile is the ceil(0.999 * 2000) = 1998th smallest = 1998.
    m = jnp.arange(1, 2001, dtype=jnp.float32)[:, None, None] * jnp.ones((1, 2, 3))
    s = calibrate_kv_scales(_stats(m), percentile=99.9, margin=1.0)
    np.testing.assert_allclose(s.k, np.full((2, 3), 1998.0 / 448.0), rtol=1e-6)
    # With few micro-batches the 99.9th percentile is the max; percentile=None is the max.
    m3 = jnp.asarray([[[1.0]], [[7.0]], [[3.0]]])
    for p in (99.9, None):
        np.testing.assert_allclose(calibrate_kv_scales(_stats(m3), percentile=p).k, [[7.35 / 448]])
    np.testing.assert_allclose(calibrate_kv_scales(_stats(m3), percentile=50).k, [[3.15 / 448]])


@pytest.mark.parametrize("bad", [0.0, np.nan, np.inf])
def test_invalid_amax_raises_eagerly(bad):
    with pytest.raises(ValueError, match="refusing"):
        calibrate_kv_scales(_stats([[1.0, bad]]))


def test_invalid_amax_counted_under_jit():
    stats = _stats([[1.0, 0.0]], v=jnp.asarray([[np.nan, 2.0]]), q=jnp.ones((1, 2)))
    s = jax.jit(calibrate_kv_scales)(stats)
    assert int(s.num_invalid) == 2
    assert np.isnan(s.k[0, 1]) and np.isnan(s.v[0, 0])  # poisoned, never 1.0
    prev = calibrate_kv_scales(_stats([[5.0, 6.0]]))
    s = jax.jit(lambda st, p: calibrate_kv_scales(st, previous=p))(stats, prev)
    np.testing.assert_allclose(s.k, [[1.05 / 448, prev.k[0, 1]]], rtol=1e-6)

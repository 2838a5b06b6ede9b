"""Typed metrics against hand values: how pieces merge, and how an iteration averages its updates."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax import metrics as m


@pytest.mark.parametrize("jit", [False, True])
def test_a_mean_with_a_fractional_count_divides_by_it(jit):
    compute = (jax.jit if jit else lambda f: f)(lambda x: x.compute())
    assert float(compute(m.Mean(jnp.float32(0.25), jnp.float32(0.5)))) == pytest.approx(0.5)
    assert math.isnan(float(compute(m.Mean(jnp.float32(0.0), jnp.float32(0.0), math.nan))))


def test_pieces_merge_by_their_type():
    a = {"frac": m.Mean(jnp.float32(1), jnp.float32(4)), "n": m.Sum(jnp.float32(4)), "hi": m.Max(jnp.float32(3), 2)}
    b = {"frac": m.Mean(jnp.float32(3), jnp.float32(4)), "n": m.Sum(jnp.float32(4)), "hi": m.Max(jnp.float32(9), 0)}
    out = m.compute(m.merge(a, b))
    assert float(out["frac"]) == 0.5 and float(out["n"]) == 8 and float(out["hi"]) == 3  # b's max counted nothing


def test_an_iteration_averages_its_updates_and_leaves_out_those_that_counted_nothing():
    updates = [
        {"clip": m.Mean(jnp.float32(1), jnp.float32(2)), "skipped": m.Count(jnp.float32(0))},  # 0.5
        {"clip": m.Mean(jnp.float32(0), jnp.float32(0), math.nan), "skipped": m.Count(jnp.float32(1))},  # none
        {"clip": m.Mean(jnp.float32(1), jnp.float32(4)), "skipped": m.Count(jnp.float32(1))},  # 0.25
    ]
    host = [jax.tree.map(float, jax.device_get(m.per_update(u))) for u in updates]
    out = m.compute(functools.reduce(m.merge, host))
    assert out["clip"] == pytest.approx(0.375) and out["skipped"] == 2
    none = m.compute(jax.tree.map(float, jax.device_get(m.per_update(updates[1]))))
    assert math.isnan(none["clip"])


@pytest.mark.parametrize("jit", [False, True])
def test_a_quantile_is_read_off_merged_histograms_to_within_a_bin(jit):
    """1,000 values log-spaced over four decades, counted in two pieces and merged (as micro-batches and
    updates merge): the 99th percentile is the 990th value to within a bin (10^(7/448) = 3.6%), on the
    device and on the host; masked values count nothing; nothing counted is NaN."""
    x = jnp.logspace(-3, 1, 1000)
    hist = (jax.jit(m.histogram) if jit else m.histogram)(x, jnp.ones(1000, bool))
    half = [m.Quantile(m.histogram(x, jnp.arange(1000) % 2 == i)) for i in (0, 1)]
    merged = m.merge(*half)
    assert float(jnp.sum(hist)) == 1000 and jnp.array_equal(merged.counts, hist)
    kth = float(x[989])
    assert float(merged.compute()) == pytest.approx(kth, rel=10 ** (7 / 448) - 1)
    on_host = m.compute(jax.tree.map(lambda c: np.asarray(c, np.float64), jax.device_get(m.per_update(merged))))
    assert isinstance(on_host, float) and on_host == pytest.approx(float(merged.compute()), rel=1e-5)
    assert float(m.Quantile(m.histogram(x, x < 1.0)).compute()) < 1.0  # the masked tail counts nothing
    assert math.isnan(m.Quantile(m.histogram(x, jnp.zeros(1000, bool))).compute())

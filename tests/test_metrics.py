"""Typed metrics against hand values: how pieces merge, and how an iteration averages its updates."""

import functools
import math

import jax
import jax.numpy as jnp
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

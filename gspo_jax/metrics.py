"""Metrics that say in their type how they combine, so pieces of one batch (micro-batches, shards)
merge without a list of names, as Tunix's losses return a numerator and a denominator.

- `Mean(total, count)`: a ratio whose pieces add: total / count after merging (a loss is its
  numerator over its denominator; a fraction is hits over tokens); `empty` when nothing counted.
- `Sum(total)`: pieces of one value that add (a loss already divided by the global denominator, a
  token count).
- `Min(value, count)` / `Max(value, count)`: extremes over the entries counted; `empty` when none.
- `Count(total)`: a tally of events that adds across updates too (skipped updates).
- `Quantile(counts)`: a quantile of the values counted into a fixed log-spaced histogram (`histogram`);
  counts add across pieces and across updates (a tail is over all the iteration's tokens), and the
  quantile is read off the merged counts, exact to within a bin (3.6% of the value).

All are pytrees (jit-friendly). `merge` combines two trees of metrics, `reduce` a stacked tree (e.g.
the outputs of a `lax.scan` over micro-batches), `compute` turns a tree into plain values. Across the
optimizer steps of an iteration each update weighs the same: `per_update` recasts one update's
metrics as `Mean(value, 1)` (a `Count` stays a `Count`), so an iteration reports the mean over its
updates and the total of its counts; an update in which a ratio counted nothing (no flipped token,
say) weighs 0 for it instead of adding its `empty` value.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class Mean:
    total: Any
    count: Any
    empty: float = struct.field(pytree_node=False, default=0.0)

    def merge(self, other: Mean) -> Mean:
        return Mean(self.total + other.total, self.count + other.count, self.empty)

    def reduce(self) -> Mean:
        return Mean(jnp.sum(self.total, axis=0), jnp.sum(self.count, axis=0), self.empty)

    def compute(self):
        if isinstance(self.count, jax.Array):  # on device (and under jit)
            safe = jnp.where(self.count > 0, self.count, 1)  # counts may be fractional (weights)
            return jnp.where(self.count > 0, self.total / safe, self.empty)
        return self.total / self.count if self.count > 0 else self.empty  # host floats (float64)


@struct.dataclass
class Sum:
    total: Any

    def merge(self, other: Sum) -> Sum:
        return Sum(self.total + other.total)

    def reduce(self) -> Sum:
        return Sum(jnp.sum(self.total, axis=0))

    def compute(self):
        return self.total


@struct.dataclass
class Min:
    value: Any
    count: Any
    empty: float = struct.field(pytree_node=False, default=0.0)

    def merge(self, other: Min) -> Min:
        return Min(_pick(self, other, jnp.minimum), self.count + other.count, self.empty)

    def reduce(self) -> Min:
        value = jnp.min(jnp.where(self.count > 0, self.value, jnp.inf), axis=0)
        return Min(value, jnp.sum(self.count, axis=0), self.empty)

    def compute(self):
        return jnp.where(self.count > 0, self.value, self.empty)


@struct.dataclass
class Max:
    value: Any
    count: Any
    empty: float = struct.field(pytree_node=False, default=0.0)

    def merge(self, other: Max) -> Max:
        return Max(_pick(self, other, jnp.maximum), self.count + other.count, self.empty)

    def reduce(self) -> Max:
        value = jnp.max(jnp.where(self.count > 0, self.value, -jnp.inf), axis=0)
        return Max(value, jnp.sum(self.count, axis=0), self.empty)

    def compute(self):
        return jnp.where(self.count > 0, self.value, self.empty)


@struct.dataclass
class Count:
    total: Any

    def merge(self, other: Count) -> Count:
        return Count(self.total + other.total)

    def reduce(self) -> Count:
        return Count(jnp.sum(self.total, axis=0))

    def compute(self):
        return self.total


# Quantile's bins: log-spaced edges from 10^LOG10_LO to 10^LOG10_HI (values below fall in the first
# bin, above in the last); |log r| of 1e-6 to 10 nats at 64 bins a decade.
LOG10_LO, LOG10_HI, BINS = -6.0, 1.0, 448


def histogram(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Counts of the masked values of `x` (> 0; 0 counts into the first bin) in `Quantile`'s bins."""
    u = (jnp.log10(jnp.maximum(x, 10.0**LOG10_LO)) - LOG10_LO) / (LOG10_HI - LOG10_LO)
    i = jnp.clip(jnp.floor(u * BINS), 0, BINS - 1).astype(jnp.int32)
    return jnp.zeros((BINS,), jnp.float32).at[i.reshape(-1)].add(jnp.asarray(mask, jnp.float32).reshape(-1))


@struct.dataclass
class Quantile:
    counts: Any  # [BINS]: `histogram`'s counts
    q: float = struct.field(pytree_node=False, default=0.99)
    empty: float = struct.field(pytree_node=False, default=float("nan"))

    def merge(self, other: Quantile) -> Quantile:
        return Quantile(self.counts + other.counts, self.q, self.empty)

    def reduce(self) -> Quantile:
        return Quantile(jnp.sum(self.counts, axis=0), self.q, self.empty)

    def compute(self):
        """The q-quantile: the bin where the cumulative count reaches q·total, interpolated in log space."""
        xp = jnp if isinstance(self.counts, jax.Array) else np
        counts = xp.asarray(self.counts, dtype=xp.float64 if xp is np else jnp.float32)
        total = counts.sum()
        cdf = xp.cumsum(counts)
        target = self.q * total
        i = xp.clip(xp.searchsorted(cdf, target, side="left"), 0, BINS - 1)
        below = xp.where(i > 0, cdf[xp.maximum(i - 1, 0)], 0.0)
        frac = xp.where(counts[i] > 0, (target - below) / xp.where(counts[i] > 0, counts[i], 1.0), 0.0)
        value = xp.where(total > 0, 10.0 ** (LOG10_LO + (i + frac) * (LOG10_HI - LOG10_LO) / BINS), self.empty)
        return float(value) if xp is np else value


Metric = Mean | Sum | Min | Max | Count | Quantile
_TYPES = (Mean, Sum, Min, Max, Count, Quantile)


def _pick(a, b, fn):
    """fn over the two values, ignoring a side that counted nothing."""
    return jnp.where(a.count > 0, jnp.where(b.count > 0, fn(a.value, b.value), a.value), b.value)


def is_metric(x) -> bool:
    return isinstance(x, _TYPES)


def merge(a, b):
    """Two trees of metrics (same structure) merged leaf by leaf, each by its own rule."""
    return jax.tree.map(lambda x, y: x.merge(y), a, b, is_leaf=is_metric)


def reduce(stacked):
    """A tree of metrics stacked along a leading axis (e.g. by `lax.scan`) merged over that axis."""
    return jax.tree.map(lambda m: m.reduce(), stacked, is_leaf=is_metric)


def compute(tree):
    """Plain values: every metric in `tree` replaced by its value (other leaves kept)."""
    return jax.tree.map(lambda m: m.compute() if is_metric(m) else m, tree, is_leaf=is_metric)


def per_update(tree):
    """One optimizer step's metrics as it enters an iteration's report: each step weighs 1."""

    def one(m):
        if isinstance(m, (Count, Quantile)):  # a tally, and a tail over every update's values
            return m
        if isinstance(m, Sum):
            return Mean(m.compute(), 1)
        counted = jnp.asarray(m.count) > 0
        return Mean(jnp.where(counted, m.compute(), 0.0), counted.astype(jnp.float32), m.empty)

    return jax.tree.map(one, tree, is_leaf=is_metric)

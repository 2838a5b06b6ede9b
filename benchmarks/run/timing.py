"""Wall-clock timing of a function's calls, results ready, after a warm-up call."""

from __future__ import annotations

import time

import jax


def call_times(fn, repeats: int, min_seconds: float = 0.0) -> list[float]:
    """Wall times of `fn()` (results ready), after one warm-up call: `repeats` calls, and more until
    `min_seconds` have passed (a 50 ms step timed 5 times samples a shared machine for 0.25 s only)."""
    jax.block_until_ready(fn())
    times, start = [], time.perf_counter()
    while len(times) < repeats or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return times


def best_time(fn, repeats: int) -> float:
    """Best wall time of `fn()` over `repeats` calls, after one warm-up call."""
    return min(call_times(fn, repeats))

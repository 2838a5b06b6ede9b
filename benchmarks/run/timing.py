"""Wall-clock timing of a function's calls, results ready, after a warm-up call; the compilation
cache a cold start is timed with."""

from __future__ import annotations

import contextlib
import tempfile
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


@contextlib.contextmanager
def cold_cache_dir(tiny: bool):
    """The persistent compilation cache directory a cold start is timed with: a new empty one, so the
    first iteration compiles as a new run's does. At `tiny` (the smoke test, whose figures are not
    read) the process's own cache where it has one: sections that build the same programs (the
    `iteration` and `loop` sections' cold starts) compile them once, and their cold figures may be
    loads."""
    if tiny and jax.config.jax_compilation_cache_dir:
        yield jax.config.jax_compilation_cache_dir
    else:
        with tempfile.TemporaryDirectory() as directory:
            yield directory

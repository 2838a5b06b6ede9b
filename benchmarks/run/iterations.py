"""Whole RL iterations, timed from runs' metrics rows: the `iteration` shape split by part with drift
on, sub-sampled and off, compiles and time to the first iteration (`iteration`); the default
config's iteration by everything a run spends time on, against group size and completion length
(`iteration_scaling`)."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from jax.experimental.compilation_cache import compilation_cache

from benchmarks.run.shapes import iteration_config, shape_config
from benchmarks.run.timing import cold_cache_dir
from gspo_jax import run as run_lib
from gspo_jax.built import build

SPLIT = ("rollout_seconds", "logprob_seconds", "update_seconds", "drift_seconds")


def _run_iterations(c, cache_dir: str | None = None, cold: bool = True) -> tuple[list[dict], float]:
    """Runs config `c` in a fresh workdir; returns its metrics rows and its start time. `cold`: with
    empty in-memory jit caches, as a new process has, and `cache_dir` as the only persistent
    compilation cache (so its first iteration is timed as a fresh run's); otherwise the programs
    earlier sections compiled are reused (only the compiled iterations are timed then)."""
    before = jax.config.jax_compilation_cache_dir
    if cold:
        # JAX opens the persistent cache once, at the first compile after a reset, and keeps it.
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        compilation_cache.reset_cache()
        jax.clear_caches()
    try:
        with tempfile.TemporaryDirectory() as workdir:
            t0 = time.time()
            run_lib.train_and_evaluate(build(c), workdir, progress=False)  # the build timed, as a run's
            rows = [json.loads(x) for x in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    finally:
        if cold:  # later sections compile with the cache they had (not `cache_dir`, soon deleted)
            jax.config.update("jax_compilation_cache_dir", before)
            compilation_cache.reset_cache()
    return rows, t0


def _warm_iterations(rows: list[dict]) -> tuple[float, dict, list[dict]]:
    """(mean wall seconds between the metrics rows of iterations 2..5, the mean split, those rows):
    compiled iterations, not the last (it evaluates)."""
    warm = [r for r in rows if 2 <= r["step"] <= 5]
    wall = [b["time"] - a["time"] for a, b in zip(rows[1:], rows[2:]) if 2 <= b["step"] <= 5]
    return float(np.mean(wall)), {k: float(np.mean([r[k] for r in warm])) for k in SPLIT}, warm


def iteration(tiny: bool, repeats: int) -> dict:
    """The three drift settings, each a fresh run from cold in-memory caches, then the
    compilation-cache pair, always cold: a run that fills an empty persistent cache, and its rerun.
    At `tiny` (the smoke test) everything compiles once: the drift settings share compiled programs,
    and the first of them is also the pair's cold run (`cold_cache_dir`)."""
    del repeats
    out = {}
    with cold_cache_dir(tiny) as cache_dir:
        for drift, subsample in ((True, 1), (True, 4), (False, 1)):
            c = iteration_config("tiny" if tiny else "iteration")
            c.train.update(drift_metrics=drift, drift_subsample=subsample)
            pair = tiny and drift and subsample == 1
            rows, t0 = _run_iterations(c, cache_dir if pair else None, cold=pair or not tiny)
            seconds, split, warm = _warm_iterations(rows)
            split["other_seconds"] = seconds - sum(split.values())  # checkpoint, logging, host work
            name = "drift_off" if not drift else "drift_on" if subsample == 1 else f"drift_every_{subsample}th"
            out[name] = dict(
                seconds=seconds,
                split=split,
                compiles_after_warmup=int(sum(r["xla_compiles"] for r in warm)),
                seconds_to_first_iteration=rows[1]["time"] - t0,
            )
        # A rerun (or the next run of a sweep) with the persistent compilation cache that scripts/train.py
        # keeps: the first run fills it, the second loads from it.
        c = iteration_config("tiny" if tiny else "iteration")
        if tiny:  # the drift_on run filled the cache: its rerun loads
            c.train.update(drift_metrics=True, drift_subsample=1)
            firsts = [out["drift_on"]["seconds_to_first_iteration"]]
        else:
            c.train.num_iterations = 2  # as above, the first iteration is not the last, which also evaluates
            firsts = []
        while len(firsts) < 2:
            rows, t0 = _run_iterations(c, cache_dir)
            firsts.append(rows[1]["time"] - t0)
    out["compilation_cache"] = dict(
        seconds_to_first_iteration_cold=firsts[0], seconds_to_first_iteration_warm=firsts[1]
    )
    return out


RACE_ITERATIONS = 6  # iterations 2..5 timed


def race_iteration(c) -> dict:
    """The race (issue 40): config `c` run with drift on, one iteration and its split (`_warm_iterations`)."""
    c = c.copy_and_resolve_references()
    c.train.update(drift_metrics=True, drift_subsample=1, num_iterations=RACE_ITERATIONS)
    seconds, split, _ = _warm_iterations(_run_iterations(c, cold=False)[0])
    return dict(seconds=seconds, split=split)


def median_iteration(c) -> dict:
    """A whole run of config `c`: the median wall time of its compiled iterations (2 .. the one before
    the last, which evaluates) and the median of each part of the split."""
    rows, _ = _run_iterations(c, cold=False)
    last = c.train.num_iterations - 1
    wall = [b["time"] - a["time"] for a, b in zip(rows[1:], rows[2:]) if 2 <= b["step"] <= last]
    warm = [r for r in rows if 2 <= r["step"] <= last]
    return dict(seconds=float(np.median(wall)), split={k: float(np.median([r[k] for r in warm])) for k in SPLIT})


SCALING = {  # group sizes and completion lengths tried, one varied at a time (the other as configured), by shape
    "default": dict(group_size=(4, 8, 16), max_new_tokens=(6, 12, 24)),
    "tiny": dict(group_size=(4, 8), max_new_tokens=(8, 16)),
}


EVERY = 2  # the scaling runs evaluate and checkpoint every 2nd iteration: both measured in place


def whole_split(rows: list[dict], every: int) -> tuple[float, dict]:
    """(an iteration's seconds, every part of a run's time per compiled iteration (steps 2..)) from
    the metrics rows of a run that evaluated and saved every `every` iterations. An iteration right
    after a save is slower (the save's asynchronous write shares the cores with it), so the
    iteration's own timers (rollout, log-probs, updates, drift, and the host work between them) and
    logging (the wall time between rows beyond the iteration and evaluation timers) come from the
    iterations that do not follow one; evaluation from its timer; a save is the extra wall time of
    an iteration after one: what it blocks, and what its write takes from the next iteration."""
    by_step = {r["step"]: r for r in rows}
    med = lambda xs: float(np.median(list(xs)))
    wall = {
        s: by_step[s]["time"] - by_step[s - 1]["time"] - by_step[s].get("eval_seconds", 0.0) for s in by_step if s >= 2
    }
    plain = [s for s in wall if (s - 1) % every]
    after_save = [s for s in wall if (s - 1) % every == 0]
    out = {k: med(by_step[s][k] for s in plain) for k in SPLIT}
    out["host_seconds"] = med(by_step[s]["iteration_seconds"] - sum(by_step[s][k] for k in SPLIT) for s in plain)
    out["evaluation_seconds"] = med(r["eval_seconds"] for s, r in by_step.items() if s >= 2 and "eval_seconds" in r)
    out["logging_seconds"] = med(wall[s] - by_step[s]["iteration_seconds"] for s in plain)
    out["checkpoint_seconds"] = med(wall[s] for s in after_save) - med(wall[s] for s in plain)
    return med(by_step[s]["iteration_seconds"] for s in plain), out


def iteration_scaling(tiny: bool, repeats: int) -> dict:
    """One RL iteration of the default config split into everything a run spends time on, and how it
    grows with group size and completion length. `seconds` is the iteration alone (what
    `iteration_seconds` logs, where no save precedes it); `seconds_at_config_cadence` adds logging,
    and evaluation and saves amortised at the config's own `eval_every` / `checkpoint_every`."""
    del repeats
    rows = []
    base = shape_config("tiny" if tiny else "default")
    G, C = base.rollout.group_size, base.max_new_tokens
    grid = SCALING["tiny" if tiny else "default"]
    shapes = (
        [(G, C)] + [(g, C) for g in grid["group_size"] if g != G] + [(G, n) for n in grid["max_new_tokens"] if n != C]
    )
    for g, n in shapes:
        c = shape_config("tiny" if tiny else "default")
        c.rollout.group_size, c.max_new_tokens = g, n
        c.train.update(num_iterations=6 if tiny else 12, eval_every=EVERY, checkpoint_every=EVERY)
        run, _ = _run_iterations(c, cold=False)
        seconds, split = whole_split(run, EVERY)
        cadence = seconds + split["logging_seconds"]
        cadence += (
            split["evaluation_seconds"] / base.train.eval_every
            + split["checkpoint_seconds"] / base.train.checkpoint_every
        )
        rows.append(
            dict(
                group_size=g,
                max_new_tokens=n,
                sequences=c.rollout.num_groups * g,
                completion_len_mean=float(np.mean([r["completion_len_mean"] for r in run if r["step"] >= 2])),
                seconds=seconds,
                seconds_at_config_cadence=cadence,
                split=split,
                compiles_after_warmup=int(sum(r["xla_compiles"] for r in run if r["step"] >= 2)),
            )
        )
    return dict(
        group_size=G,
        max_new_tokens=C,
        eval_every=base.train.eval_every,
        checkpoint_every=base.train.checkpoint_every,
        rows=rows,
    )

"""Sampling beside training (`mesh.rollout_devices`, gspo_jax/overlap.py): the `iteration` shape at
staleness 1 as one mesh over every device, then split in halves (the sampler on one, the trainer on the
other), on the same devices, each iteration against its rollout and its trainer's work. On a CPU it runs
in a child process with two fake devices, which share the same cores: what it shows there is the
bookkeeping's cost, not an overlap's gain (each half computes as slowly as the whole while the other
runs). On an accelerator with several devices the split iteration should approach
max(rollout, trainer) + the weight transfer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

from benchmarks.run.iterations import _run_iterations
from benchmarks.run.shapes import iteration_config

TRAINER = ("logprob_seconds", "update_seconds", "drift_seconds")  # the trainer's mesh's phases


def overlap_figures(tiny: bool, repeats: int) -> dict:
    """The one-mesh and split runs' medians (`_measure`); on a one-device CPU, from a child process with
    two fake CPU devices (`XLA_FLAGS` must be set before JAX starts). One accelerator cannot be split."""
    if jax.device_count() >= 2:
        return _measure(tiny)
    if jax.default_backend() != "cpu":
        raise SystemExit("benchmarks.run --only overlap: needs two or more devices to split")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "overlap.json"
        env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
        cmd = [sys.executable, "-m", "benchmarks.run", "--only", "overlap", "--size", "tiny" if tiny else "full"]
        cmd += ["--out", str(out), "--repeats", str(repeats)]
        subprocess.run(cmd, check=True, env=env, cwd=Path(__file__).parents[2], stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())["overlap"]


def _measure(tiny: bool) -> dict:
    n = jax.device_count()
    c = iteration_config("tiny" if tiny else "iteration")
    c.rollout.staleness = 1
    if tiny:  # the fewest with a median: iterations 2 and 3 (1 compiles, 4 is the last)
        c.train.num_iterations = 4
    c.mesh.update(data=n)
    one = _run_iterations(c, cold=False)[0]
    c.mesh.update(data=n - n // 2)
    c.mesh.rollout_devices = n // 2
    return summary(one, _run_iterations(c, cold=False)[0], devices=n, sampler_devices=n // 2)


def summary(one_mesh: list[dict], split: list[dict], *, devices: int, sampler_devices: int) -> dict:
    """The figures from the two runs' metrics rows: each run's medians (`_medians`), and the split
    iteration against the one-mesh one and against its two meshes' work."""
    one, split = _medians(one_mesh), _medians(split)
    return dict(
        devices=devices,
        sampler_devices=sampler_devices,
        one_mesh=one,
        split=split,
        split_vs_one_mesh=split["iteration_seconds"] / one["iteration_seconds"],
        # What an overlap can reach: the longer of the two meshes' work, against what it took.
        split_vs_max=split["iteration_seconds"] / max(split["rollout_seconds"], split["trainer_seconds"]),
        split_vs_sum=split["iteration_seconds"] / (split["rollout_seconds"] + split["trainer_seconds"]),
    )


def _medians(rows: list[dict]) -> dict:
    """Medians over the compiled iterations (2 .. the one before the last) of the iteration, its rollout,
    the trainer's phases and, for a split run, its overlap."""
    last = max(r["step"] for r in rows) - 1
    warm = [r for r in rows if 2 <= r["step"] <= last]
    med = lambda f: float(np.median([f(r) for r in warm]))
    out = dict(
        iteration_seconds=med(lambda r: r["iteration_seconds"]),
        rollout_seconds=med(lambda r: r["rollout_seconds"]),
        trainer_seconds=med(lambda r: sum(r[k] for k in TRAINER)),
    )
    if "overlap_seconds" in warm[0]:
        out.update(
            overlap_seconds=med(lambda r: r["overlap_seconds"]), wait_seconds=med(lambda r: r["rollout_wait_seconds"])
        )
    return out


def print_overlap(r: dict) -> None:
    one, split = r["one_mesh"], r["split"]
    print(
        f"overlap [{r['devices']} devices, {r['sampler_devices']} sampling]: iteration one mesh "
        f"{one['iteration_seconds']:.3f} s (rollout {one['rollout_seconds']:.3f} + trainer "
        f"{one['trainer_seconds']:.3f}); "
        f"split {split['iteration_seconds']:.3f} s (rollout {split['rollout_seconds']:.3f}, trainer "
        f"{split['trainer_seconds']:.3f}, overlapped {split['overlap_seconds']:.3f}): split / one mesh "
        f"{r['split_vs_one_mesh']:.2f}x, split / max(rollout, trainer) {r['split_vs_max']:.2f}x, "
        f"split / (rollout + trainer) {r['split_vs_sum']:.2f}x"
    )

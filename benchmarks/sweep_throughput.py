"""Sweeps sharing one machine: runs per hour of a config at `--parallel 1` and at larger N, run by
scripts/sweep.py itself (issue 68, point 2: on one GPU, the default size at 1 and the best N).

    python -m benchmarks.sweep_throughput                          # the main job's size; N = 1,2,4,8 on a GPU
    python -m benchmarks.sweep_throughput --iterations 40          # shorter runs, projected to the config's
    python -m benchmarks.sweep_throughput --config configs/gspo.py:tiny --iterations 2 --parallel 1,2

First one untimed run fills the warm-start cache and a fresh persistent compilation cache (its time is
recorded: a sweep's first run of an arm). Then, for each N, a sweep of N runs of the same config (the same
seed, told apart by their tracker tag `logging.arm`) runs at `--parallel N` (each run pinned to its share
of the CPUs and, on a GPU, given 0.9/N of its memory), every run finding its warm start and programs
cached, as a sweep's later runs do. A wave's runs per hour are N × 3600 / its wall seconds. With
`--iterations` below the config's own, each wave is also projected to full runs: its wall seconds plus
the config's remaining iterations at the runs' measured mean (a run's iterations after its first, which
compiles); a projection, labelled so. Writes benchmarks/sweep_throughput-<device>.json
after every wave (device, versions, command, commit); this process never touches a device itself (a child
reads the machine), so the runs get all of it. SIGTERM stops the running wave's runs at their next
iteration (the sweep's own stop) and keeps the waves already measured."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gspo_jax.writers import read_metrics

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WARM_UP = "warm-up"
STATE_FILE = ".sweep.json"  # gspo_jax.study.sweeps.STATE_FILE: a run's attempts, as the sweep records them


class Stopped(Exception):
    """SIGTERM or SIGINT reached this process during a wave."""


def _probe(config: str) -> dict:
    """What a child process reports: the machine, its float32 matmul peak and versions (the device's own,
    then released), and the config's own iteration count."""
    import jax

    from benchmarks.run.machine import accelerator_versions, peak
    from gspo_jax.config_files import load_config
    from gspo_jax.provenance import commit, cpu, device_slug, machine

    c = load_config(config)
    return dict(
        machine=machine(),
        peak_flops_per_s=peak(tiny=False, repeats=5)["flops_per_s"],
        jax=jax.__version__,
        git=commit(),
        **accelerator_versions(),
        slug=device_slug(),
        config_iterations=int(c.train.num_iterations),
        cores=cpu()[2],
    )


def probe(config: str) -> dict:
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}  # a GPU's memory is not held, even briefly
    cmd = [sys.executable, "-m", "benchmarks.sweep_throughput", "--probe", "--config", config]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"the probe failed (exit {r.returncode}): {r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def timings(run_dir: Path) -> dict:
    """A finished run's seconds (the sweep's record of its attempts, process start to exit) and, from
    its metrics.jsonl, the RL iterations it ran and their mean seconds after the first (which compiles):
    the start-up is the rest."""
    state = json.loads((run_dir / STATE_FILE).read_text())
    seconds = float(sum(a["seconds"] for a in state["attempts"]))
    times = {r["step"]: r["time"] for r in read_metrics(run_dir) if isinstance(r.get("time"), (int, float))}
    steps = sorted(s for s in times if s >= 1)
    out = dict(name=run_dir.name, status=state["status"], seconds=seconds, iterations=steps[-1] if steps else 0)
    if len(steps) >= 2:
        span = times[steps[-1]] - times[steps[0]]
        out["iteration_seconds"] = span / (steps[-1] - steps[0])
        out["startup_seconds"] = seconds - span
    return out


def wave_figures(n: int, wall: float, runs: list[dict], config_iterations: int) -> dict:
    """A wave's runs per hour, measured, and projected to `config_iterations` where its runs were shorter."""
    out = dict(parallel=n, wall_seconds=wall, runs=runs, runs_per_hour=n * 3600 / wall)
    timed = [r for r in runs if "iteration_seconds" in r]
    if timed:
        it = sum(r["iteration_seconds"] for r in timed) / len(timed)
        startup = sum(r["startup_seconds"] for r in timed) / len(timed)
        out.update(iteration_seconds=it, startup_seconds=startup)
        if all(r["iterations"] < config_iterations for r in runs):  # the rest of each run, at its pace so far
            full = wall + (config_iterations - max(r["iterations"] for r in runs)) * it
            out.update(projected_wave_seconds=full, projected_runs_per_hour=n * 3600 / full)
    return out


def best(waves: list[dict]) -> dict:
    key = "projected_runs_per_hour" if all("projected_runs_per_hour" in w for w in waves) else "runs_per_hour"
    top = max(waves, key=lambda w: w[key])
    return dict(parallel=top["parallel"], by=key, runs_per_hour=top[key])


def sweep_file(config: str, common: dict, names: list[str]) -> str:
    """A sweep of `names` runs of `config`, each told apart only by its tracker tag."""
    runs = [{"logging.arm": name} for name in names]
    return f"BASE = {config!r}\nCOMMON = {common!r}\n\n\ndef runs():\n    return {runs!r}\n"


def run_wave(root: Path, wave: str, config: str, common: dict, n: int, env: dict) -> tuple[float, list]:
    """`n` runs of `config` at once by scripts/sweep.py, in `root`/`wave`; wall seconds and each run's timings."""
    workroot = root / wave
    workroot.mkdir(parents=True)
    path = root / f"{wave}.py"
    path.write_text(sweep_file(config, common, [f"{wave}-run{i}" for i in range(n)]))
    cmd = [sys.executable, "scripts/sweep.py", str(path), "--workroot", str(workroot), "--parallel", str(n)]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)  # signals reach it from here only
    try:
        rc = proc.wait()
    except Stopped:
        proc.send_signal(signal.SIGTERM)  # the sweep stops its runs at their next iteration, then exits
        while proc.poll() is None:
            try:
                proc.wait()
            except Stopped:  # a second signal: the sweep stops its runs at once
                proc.send_signal(signal.SIGINT)
        raise
    wall = time.monotonic() - t0
    run_dirs = sorted((workroot / "runs").iterdir())
    if rc != 0:
        logs = "\n".join(str(d / "log.txt") for d in run_dirs)
        raise SystemExit(f"the wave at --parallel {n} did not finish (scripts/sweep.py exit {rc}); logs:\n{logs}")
    return wall, [timings(d) for d in run_dirs]


def _line(w: dict) -> str:
    s = f"--parallel {w['parallel']}: {w['runs_per_hour']:.1f} runs/h ({w['wall_seconds']:.0f} s for {w['parallel']})"
    if "iteration_seconds" in w:
        s += f"; {w['iteration_seconds']:.3f} s/iteration, start-up {w['startup_seconds']:.0f} s"
    if "projected_runs_per_hour" in w:
        s += f"; projected to full runs: {w['projected_runs_per_hour']:.1f} runs/h"
    return s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/gspo.py", help="the runs' config (default: the main job's)")
    ap.add_argument(
        "--parallel", default="", help="runs at once, e.g. 1,4 (default 1,2,4,8 on a GPU; 1 and the cores on a CPU)"
    )
    ap.add_argument("--iterations", type=int, default=0, help="RL iterations per run (default: the config's own)")
    ap.add_argument("--workroot", default="", help="where the runs go (default: a temporary folder, removed)")
    ap.add_argument("--out", default="", help="the JSON to write (default benchmarks/sweep_throughput-<device>.json)")
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # the child that reads the machine
    args = ap.parse_args(argv)
    if args.probe:
        print(json.dumps(_probe(args.config)))
        return 0
    try:
        parallel = [int(n) for n in args.parallel.split(",")] if args.parallel else []
    except ValueError:
        ap.error(f"--parallel={args.parallel!r}: comma-separated run counts, e.g. 1,2,4")
    if any(n < 1 for n in parallel) or args.iterations < 0:
        ap.error(f"--parallel={args.parallel!r}, --iterations={args.iterations}: N at least 1, iterations at least 0")
    if not Path(ROOT / args.config.partition(":")[0]).is_file():
        ap.error(f"--config={args.config!r}: no such config file under {ROOT}")
    if args.workroot and Path(args.workroot).exists() and any(Path(args.workroot).iterdir()):
        ap.error(f"--workroot={args.workroot!r} is not empty (finished runs would not run again): give a new folder")

    info = probe(args.config)
    print(f"{info['machine']}; float32 matmul peak {info['peak_flops_per_s'] / 1e9:.0f} GFLOP/s", flush=True)
    on_gpu = info["backend"] == "gpu"
    parallel = parallel or ([1, 2, 4, 8] if on_gpu else sorted({1, info["cores"]}))
    iterations = args.iterations or info["config_iterations"]
    path = Path(args.out or HERE / f"sweep_throughput-{info.pop('slug')}.json")
    results = dict(**info, command=shlex.join(["python", "-m", "benchmarks.sweep_throughput", *(argv or sys.argv[1:])]))
    results.update(config=args.config, iterations=iterations, waves=[])

    root = Path(args.workroot or tempfile.mkdtemp(prefix="gspo_jax_sweep_throughput_")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    # One warm-start cache for every wave, and a fresh persistent compilation cache: the warm-up fills both.
    common = {"warm_start.cache_dir": str(root / "warm_starts")}
    common.update({"train.num_iterations": args.iterations} if args.iterations else {})
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(root / "xla_cache")}

    def stop(signum, frame):
        raise Stopped

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        wall, runs = run_wave(root, WARM_UP, args.config, common, 1, env)
        results["warm_up"] = dict(wall_seconds=wall, **runs[0])
        print(f"warm-up (fills the warm-start and compilation caches): {wall:.0f} s", flush=True)
        for n in parallel:
            wall, runs = run_wave(root, f"p{n}", args.config, common, n, env)
            results["waves"].append(wave_figures(n, wall, runs, info["config_iterations"]))
            results["best"] = best(results["waves"])
            path.write_text(json.dumps(results, indent=2))
            print(_line(results["waves"][-1]), flush=True)
    except Stopped:
        print(f"stopped: {len(results['waves'])} wave(s) measured, in {path if results['waves'] else 'no file'}")
        return 75
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if not args.workroot:
            shutil.rmtree(root, ignore_errors=True)
    b = results["best"]
    print(f"best: --parallel {b['parallel']} ({b['runs_per_hour']:.1f} runs/h, {b['by'].replace('_', ' ')})")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Runs an ablation sweep (configs/sweeps/<name>.py): one scripts/train.py process per run, N at a time.

    python scripts/sweep.py configs/sweeps/tiny.py --workroot /tmp/sw --parallel 2   # run (or resume) it
    python scripts/sweep.py configs/sweeps/tiny.py --workroot /tmp/sw --list         # names and commands
    python scripts/sweep.py configs/sweeps/tiny.py --workroot /tmp/sw --report       # -> /tmp/sw/report.md
    python scripts/sweep.py configs/sweeps/tiny.py --workroot /tmp/sw --compare results/tiny  # a rerun vs the committed
    python scripts/sweep.py configs/sweeps/tiny.py --workroot /shared/sw --shard 0/4  # 1 of 4 hosts / array tasks

Each run lives in WORKROOT/runs/<name>/ (its checkpoints, metrics.jsonl, log.txt, and .sweep.json, the
sweep's record of its attempts). Kill the sweep at any point (SIGTERM, Ctrl-C) and run the same command
again: finished runs are skipped, stopped ones resume from their checkpoint, failed ones are retried.
SIGTERM / Ctrl-C stop every run at its next iteration boundary (a checkpoint each); a second one stops
them at once. One sweep process per workroot (per shard): a second is refused.

--parallel N: each child is pinned to its own share of this process's CPUs (gspo_jax.study.runner.cpu_slots); more
runs than CPUs share them. On 2 CPU cores the main job's runs (warm start and programs cached) went 27.6 an
hour at --parallel 1 and 39.1 at --parallel 2 (`python -m benchmarks.sweep_throughput`, docs/BENCHMARKS.md):
use one run per core. On one GPU the N runs share it: each is started with JAX's client memory settings, no
preallocation and 0.9/N of the device at most
(gspo_jax.study.runner.device_memory_env; a value already in the environment is kept). A TPU chip takes one
process: spread a sweep over slices with --shard instead.

Exit codes: 0 every run done; 1 some failed (the others ran on); 2 refused (bad sweep file or arguments,
or the workroot in use by another sweep); 75 stopped by a signal, or a run stopped by someone else's:
rerun to go on.
"""

import argparse
import shlex
import sys
from pathlib import Path

from gspo_jax.exit_codes import EXIT_REFUSED
from gspo_jax.study import sweeps
from gspo_jax.study.runner import Runner, SweepLock
from gspo_jax.workdir import WorkdirBusy

REPO = Path(__file__).resolve().parents[1]  # scripts/train.py and the config paths are relative to it


def refuse(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return EXIT_REFUSED


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    parser.add_argument("sweep", help="a sweep file, configs/sweeps/<name>.py")
    parser.add_argument("--workroot", required=True, help="where the runs (runs/<name>/) and the report go")
    parser.add_argument("--parallel", type=int, default=1, help="runs at a time (default %(default)s)")
    parser.add_argument("--shard", help="i/n: run only the runs whose index %% n == i (n hosts or array tasks)")
    parser.add_argument("--list", action="store_true", help="print each run's name, status and command; run none")
    parser.add_argument("--report", action="store_true", help="write WORKROOT/report.md for the whole sweep; run none")
    parser.add_argument(
        "--compare", metavar="OTHER", help="final accuracies of the runs done in WORKROOT and OTHER; run none"
    )
    args = parser.parse_args(argv)
    if args.parallel < 1:
        return refuse(f"--parallel={args.parallel}: must be >= 1")
    try:
        sweep = sweeps.load_sweep(args.sweep, REPO)
        part = sweeps.parse_shard(args.shard) if args.shard else None
    except sweeps.SweepError as e:
        return refuse(str(e))
    root = Path(args.workroot).resolve()
    runs = sweeps.shard(sweep.runs, *part) if part else sweep.runs

    if args.list:
        print(f"# name, status, command (run from {REPO})")
        for run in runs:
            run_dir = sweeps.workdir(root, run)
            print(f"{run.name}\t{sweeps.status(run_dir)}\t{shlex.join([sys.executable, *run.train_args(run_dir)])}")
        return 0
    if args.compare:
        from gspo_jax.study.report import compare

        if not Path(args.compare).is_dir():
            return refuse(f"--compare {args.compare}: no such workroot")
        print(compare(sweep, root, Path(args.compare)), end="")
        return 0
    if args.report:
        from gspo_jax.study.report import analysis_text, write_report  # matplotlib only here

        path = write_report(sweep, root)
        print(analysis_text(sweep, root), end="")
        print(f"\nfull report: {path}")
        return 0
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return refuse(f"--workroot {root} cannot be created: {e.strerror}")
    try:
        with SweepLock(root, part):
            return Runner(runs, root, REPO, parallel=args.parallel).run()
    except WorkdirBusy as e:
        return refuse(f"another sweep is running on this workroot ({e})")


if __name__ == "__main__":
    sys.exit(main())

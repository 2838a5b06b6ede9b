"""Regenerates a run's PNG plots from its metrics.jsonl, optionally overlaying other runs.

Usage:
  python scripts/plot.py WORKDIR                       # -> WORKDIR/plots/*.png
  python scripts/plot.py runs/gspo --compare grpo=runs/grpo dapo=runs/dapo \\
      --key reward_mean --out docs/reward.png          # WORKDIR is labelled by its folder name
"""

import argparse
import sys
from pathlib import Path

from gspo_jax import plots


def _label_dir(text: str) -> tuple[str, str]:
    label, sep, path = text.partition("=")
    if not sep or not label or not path:
        raise argparse.ArgumentTypeError(f"expected LABEL=DIR, got {text!r}")
    return label, path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    parser.add_argument("workdir", help="run directory holding metrics.jsonl")
    parser.add_argument("--out-dir", help="where the run's plots go (default WORKDIR/plots)")
    parser.add_argument(
        "--compare",
        nargs="+",
        type=_label_dir,
        default=[],
        metavar="LABEL=DIR",
        help="other runs to overlay with WORKDIR",
    )
    parser.add_argument("--key", default="reward_mean", help="metric to overlay (default %(default)s)")
    parser.add_argument("--out", help="comparison PNG (default WORKDIR/plots/compare_KEY.png)")
    args = parser.parse_args(argv)

    workdir = Path(args.workdir)
    if not (workdir / "metrics.jsonl").exists():
        print(f"no metrics.jsonl in {workdir}", file=sys.stderr)
        return 1
    for path in plots.plot_run(workdir, args.out_dir):
        print(f"wrote {path}")
    if args.compare or args.out:
        runs = {workdir.resolve().name: workdir, **dict(args.compare)}
        out = args.out or workdir / "plots" / f"compare_{args.key}.png"
        path = plots.plot_comparison(runs, args.key, out)
        if path is None:
            print(f"no run has {args.key!r}; comparison not written", file=sys.stderr)
            return 1
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

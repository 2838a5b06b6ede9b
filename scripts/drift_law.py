"""Routing drift as a law of depth, experts, top-k and completion length: the fit and extrapolation of
configs/sweeps/drift_scaling.py's runs (gspo_jax.study.drift_law), as docs/RESULTS.md shows them.

python scripts/drift_law.py --workroot results/drift_scaling            # print the table
python scripts/drift_law.py --workroot results/drift_scaling --write    # the figure and docs/RESULTS.md's section
"""

import argparse
import sys
from pathlib import Path

from gspo_jax.exit_codes import EXIT_DONE, EXIT_FAILED
from gspo_jax.study import drift_law, report, sweeps

REPO = Path(__file__).resolve().parents[1]
SWEEP = REPO / "configs" / "sweeps" / "drift_scaling.py"
DOC = REPO / "docs" / "RESULTS.md"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workroot", default=str(REPO / "results" / "drift_scaling"), help="the sweep's runs")
    parser.add_argument("--write", action="store_true", help="write the figure and docs/RESULTS.md's section")
    parser.add_argument("--doc", default=str(DOC), help="the document whose section --write replaces")
    parser.add_argument("--boot", type=int, default=1000, help="bootstrap resamples of the extrapolation's interval")
    args = parser.parse_args(argv)
    root = Path(args.workroot)
    pts = drift_law.points(report.collect(sweeps.load_sweep(SWEEP, REPO), root))
    laws = [w for m in drift_law.METRICS if (w := drift_law.law(pts, m, boot=args.boot)) is not None]
    if not laws:
        lacking = ", ".join(drift_law.missing(pts)) or "a finite value of every metric"
        print(f"drift_law: {len(pts)} finished runs under {root}: no law yet; it lacks {lacking}")
        return EXIT_FAILED
    print(drift_law.table(laws), end="")
    if args.write:
        doc = Path(args.doc)
        fig = drift_law.figure(pts, {w.metric: w for w in laws}, root / "report" / "drift_law.png")
        rel = Path("..") / fig.resolve().relative_to(REPO) if fig.resolve().is_relative_to(REPO) else fig
        doc.write_text(
            drift_law.replace(doc.read_text(encoding="utf-8"), drift_law.section(laws, str(rel), len(pts), args.boot))
        )
        print(f"wrote {fig} and the drift-law section of {doc}")
    return EXIT_DONE


if __name__ == "__main__":
    sys.exit(main())

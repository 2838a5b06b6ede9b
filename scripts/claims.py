"""Rebuilds docs/RESULTS.md's claims table from results/ (gspo_jax.study.claims): the runs on disk, so it
names finished runs that are not committed yet (commit them with the table, or a clean checkout differs).

The claims, and how each row reads the sweeps, are the study's: configs/sweeps/claims.py.

python scripts/claims.py            # print the table
python scripts/claims.py --write    # replace the table in docs/RESULTS.md
python scripts/claims.py --check    # exit 1 if docs/RESULTS.md's table differs from the regenerated one
"""

import argparse
import difflib
import sys
from pathlib import Path

from gspo_jax.exit_codes import EXIT_DONE, EXIT_FAILED
from gspo_jax.study import claims

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "RESULTS.md"
CLAIMS = REPO / "configs" / "sweeps" / "claims.py"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="replace the table in docs/RESULTS.md")
    mode.add_argument(
        "--check", action="store_true", help="exit 1 if docs/RESULTS.md's table is not the regenerated one"
    )
    args = parser.parse_args(argv)
    new = claims.table(REPO, claims.load(CLAIMS))
    loose = claims.uncommitted_runs(REPO)
    if loose:
        runs = f"{len(loose)} finished run{'s are' if len(loose) > 1 else ' is'} not committed"
        print(
            f"claims: {runs} ({', '.join(loose[:3])}{', ...' if len(loose) > 3 else ''}): the table reads "
            "them and a clean checkout will not; commit them with it",
            file=sys.stderr,
        )
    if args.write:
        DOC.write_text(claims.replace(DOC.read_text(encoding="utf-8"), new), encoding="utf-8")
        print(f"wrote the claims table to {DOC}")
    elif args.check:
        old = claims.current(DOC.read_text(encoding="utf-8"))
        if old != new:
            sys.stdout.writelines(
                difflib.unified_diff(old.splitlines(True), new.splitlines(True), "docs/RESULTS.md", "regenerated")
            )
            return EXIT_FAILED
        print("docs/RESULTS.md's claims table is the regenerated one")
    else:
        print(new, end="")
    return EXIT_DONE


if __name__ == "__main__":
    sys.exit(main())

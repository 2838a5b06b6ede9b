"""Regenerates the shipped character tokenizer (gspo_jax/tasks/data/tokenizer/).

Usage: python scripts/build_tokenizer.py [--out DIR]
The output is deterministic; tests check the shipped files equal a fresh build.
"""

import argparse

from gspo_jax.tasks.tokenizer import TOKENIZER_DIR, VOCAB_SIZE, write_tokenizer_files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(TOKENIZER_DIR), help="output directory")
    args = parser.parse_args()
    for path in write_tokenizer_files(args.out):
        print(f"wrote {path}")
    print(f"vocab size {VOCAB_SIZE}")


if __name__ == "__main__":
    main()

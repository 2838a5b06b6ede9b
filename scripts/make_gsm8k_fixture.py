"""Regenerates the shipped GSM8K-format fixture (gspo_jax/tasks/data/gsm8k_fixture.jsonl): its first 20
hand-written records as they are, then made-up word problems from templates with a fixed seed, each
with GSM8K's calculator annotations and a final "#### <answer>" line. Enough records that the default
hold-out (1/16) leaves both splits non-empty, so the dataset task runs on what ships.

    python scripts/make_gsm8k_fixture.py            # rewrites the fixture in place
    python scripts/make_gsm8k_fixture.py --out x.jsonl
"""

import argparse
import json
from pathlib import Path

import numpy as np

FIXTURE = Path(__file__).resolve().parents[1] / "gspo_jax" / "tasks" / "data" / "gsm8k_fixture.jsonl"
HANDWRITTEN = 20
TOTAL = 256
SEED = 0
PEOPLE = [("Ana", "she"), ("Ben", "he"), ("Chloe", "she"), ("Dev", "he"), ("Ema", "she"), ("Finn", "he")]
PEOPLE += [("Gia", "she"), ("Hugo", "he"), ("Iris", "she"), ("Jonas", "he"), ("Kemi", "she"), ("Leo", "he")]
ITEMS = ["apple", "card", "marble", "sticker", "shell", "pencil", "book", "stamp"]


def _calc(a, op, b, value) -> str:
    return f"{a} {op} {b} = <<{a}{op}{b}={value}>>{value}"


def _problem(rng: np.random.Generator, kind: int) -> tuple[str, list[str], int]:
    """One templated problem: the question, its solution's steps and the answer."""
    name, he = PEOPLE[int(rng.integers(len(PEOPLE)))]
    item = ITEMS[int(rng.integers(len(ITEMS)))]
    n = lambda low, high: int(rng.integers(low, high + 1))  # noqa: E731
    if kind == 0:
        a, b, c = n(2, 40), n(2, 9), n(2, 12)
        q = f"{name} has {a} {item}s. {he.capitalize()} buys {b} packs with {c} {item}s in each pack. "
        q += f"How many {item}s does {he} have now?"
        return (
            q,
            [
                f"The packs hold {_calc(b, '*', c, b * c)} {item}s.",
                f"Now {he} has {_calc(a, '+', b * c, a + b * c)} {item}s.",
            ],
            a + b * c,
        )
    if kind == 1:
        p, k = n(2, 15), n(2, 8)
        bill = next(b for b in (20, 50, 100, 200) if b > p * k)
        q = f"A shop sells one {item} for ${p}. {name} buys {k} of them and pays with a ${bill} bill. "
        q += f"How much change does {he} get?"
        return (
            q,
            [
                f"The {item}s cost {_calc(k, '*', p, k * p)} dollars.",
                f"The change is {_calc(bill, '-', k * p, bill - k * p)} dollars.",
            ],
            bill - k * p,
        )
    if kind == 2:
        a, b, w = n(2, 9), n(2, 15), n(2, 6)
        week = 5 * a + 2 * b
        q = f"{name} walks {a} km on each weekday and {b} km on each day of the weekend. "
        q += f"How many km does {he} walk in {w} weeks?"
        steps = [
            f"On weekdays {he} walks {_calc(5, '*', a, 5 * a)} km.",
            f"At the weekend {he} walks {_calc(2, '*', b, 2 * b)} km.",
        ]
        steps += [
            f"A week is {_calc(5 * a, '+', 2 * b, week)} km.",
            f"In {w} weeks that is {_calc(w, '*', week, w * week)} km.",
        ]
        return q, steps, w * week
    if kind == 3:
        per_box, m, each = n(4, 12), n(1, 4), n(2, 6)
        children, total = per_box * m, per_box * m * each
        q = f"A box holds {per_box} {item}s. A class of {children} children needs {each} {item}s each. "
        q += "How many boxes does the teacher need?"
        return (
            q,
            [
                f"The class needs {_calc(children, '*', each, total)} {item}s.",
                f"That is {_calc(total, '/', per_box, m * each)} boxes.",
            ],
            m * each,
        )
    if kind == 4:
        r, h, d = n(8, 25), n(2, 8), n(2, 6)
        earned = r * h * d
        rent = n(1, earned // 10) * 10 if earned >= 10 else 0
        q = f"{name} earns ${r} an hour and works {h} hours a day for {d} days. Then {he} pays ${rent} for rent. "
        q += "How much money is left?"
        steps = [
            f"Each day {he} earns {_calc(r, '*', h, r * h)} dollars.",
            f"In {d} days that is {_calc(r * h, '*', d, earned)} dollars.",
        ]
        return q, [*steps, f"After rent {he} has {_calc(earned, '-', rent, earned - rent)} dollars."], earned - rent
    if kind == 5:
        a, b, c = n(5, 30), n(5, 30), n(5, 30)
        t = n(1, a + b + c - 1)
        q = f"A jar holds {a} red, {b} blue and {c} green marbles. {name} takes out {t} marbles. "
        q += "How many marbles are still in the jar?"
        steps = [
            f"There are {_calc(a, '+', b, a + b)} red and blue marbles.",
            f"With the green ones, {_calc(a + b, '+', c, a + b + c)}.",
        ]
        return (
            q,
            [*steps, f"After {name} takes some, {_calc(a + b + c, '-', t, a + b + c - t)} are left."],
            a + b + c - t,
        )
    if kind == 6:
        s1, h1, s2, h2 = n(40, 120), n(2, 5), n(40, 120), n(2, 5)
        q = f"A train runs at {s1} km per hour for {h1} hours, then at {s2} km per hour for {h2} hours. "
        q += "How far does it go in total?"
        steps = [f"First it goes {_calc(s1, '*', h1, s1 * h1)} km.", f"Then it goes {_calc(s2, '*', h2, s2 * h2)} km."]
        return q, [*steps, f"In total it goes {_calc(s1 * h1, '+', s2 * h2, s1 * h1 + s2 * h2)} km."], s1 * h1 + s2 * h2
    a = 3 * n(2, 20)
    q = f"{name} had {a} {item}s and gave a third of them to a friend. How many {item}s does {he} have left?"
    return (
        q,
        [
            f"{he.capitalize()} gave away {_calc(a, '/', 3, a // 3)} {item}s.",
            f"{he.capitalize()} has {_calc(a, '-', a // 3, a - a // 3)} left.",
        ],
        a - a // 3,
    )


def generated(count: int, seed: int = SEED) -> list[dict]:
    """`count` made-up records, distinct questions, in a fixed order."""
    rng, records, seen = np.random.default_rng(seed), [], set()
    while len(records) < count:
        question, steps, answer = _problem(rng, len(records) % 8)
        if question not in seen:
            seen.add(question)
            records.append({"question": question, "answer": "\n".join([*steps, f"#### {answer}"])})
    return records


def fixture_text(handwritten: list[str]) -> str:
    """The fixture's text: the hand-written lines, then the generated records."""
    lines = handwritten[:HANDWRITTEN] + [json.dumps(r) for r in generated(TOTAL - HANDWRITTEN)]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(FIXTURE))
    out = Path(parser.parse_args().out)
    out.write_text(fixture_text(FIXTURE.read_text().splitlines()))
    print(f"wrote {TOTAL} records to {out}")


if __name__ == "__main__":
    main()

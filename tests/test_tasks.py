"""Tests for gspo_jax.tasks: verifiers, demonstrations, tokenizer, dataset task, prompt iterators."""

import collections
import dataclasses
import hashlib
import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gspo_jax import built as built_lib
from gspo_jax import config as config_lib
from gspo_jax.tasks import (
    BOS_ID,
    EOS_ID,
    FIXTURE_PATH,
    PAD_ID,
    TASKS,
    TOKENIZER_DIR,
    UNK_ID,
    VOCAB_SIZE,
    ArithmeticTask,
    CountdownTask,
    DatasetPrompts,
    DatasetTask,
    Example,
    Task,
    TaskPrompts,
    answer_text,
    answers_match,
    check_splits,
    expressions,
    load_tokenizer,
    make_task,
    parse_int,
    prompt_iterator,
    solutions,
    task_fields,
)
from gspo_jax.tasks.prompts import in_holdout
from gspo_jax.tasks.tokenizer import write_tokenizer_files
from gspo_jax.warm_start import demonstration_ids

ROOT = Path(__file__).resolve().parents[1]

# Difficulty settings exercised by the demonstration and tokenizer tests.
TASK_CONFIGS = [
    ("arithmetic", {}),
    ("arithmetic", {"digits": 1, "operands": 4}),
    ("arithmetic", {"digits": 6, "operands": 3, "ops": "*-"}),
    ("arithmetic", {"digits": 2, "operands": 4, "working": 0.5}),
    ("countdown", {}),
    ("countdown", {"count": 4, "max_number": 50, "target_max": 500}),
    ("countdown", {"count": 4, "allow_division": True, "use_all": True}),
    ("countdown", {"count": 2, "max_number": 9, "target_min": 1, "target_max": 30}),
    ("gsm8k", {}),
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def examples_of(task, n, seed=0):
    rng = np.random.default_rng(seed)
    return [task.sample(rng) for _ in range(n)]


# --- the completion format -------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("#### 42", "42"),
        ("some working\n####   42   \n", "42"),
        ("####42", "42"),
        ("no marker here, 42", None),
        ("", None),
        ("#### ", None),
        ("#### 41\n####", None),  # the last marker wins even when it has no answer
        ("#### 41\n#### 42", "42"),  # several answers: the last one wins
        ("#### 41 #### 42", "42"),
        ("#### 42\nmore text afterwards", "42"),  # later lines without a marker are ignored
        ("#### 42 apples", "42 apples"),  # the task decides whether trailing text is acceptable
    ],
)
def test_answer_text(completion, expected):
    assert answer_text(completion) == expected


@settings(max_examples=200, deadline=None)
@given(
    value=st.integers(-(10**12), 10**12),
    zeros=st.integers(0, 5),
    left=st.sampled_from(["", " ", "  ", "\t"]),
    right=st.sampled_from(["", " ", "   "]),
    sign_gap=st.sampled_from(["", " "]),
    plus=st.booleans(),
)
def test_parse_int_tolerates_spaces_zeros_and_signs(value, zeros, left, right, sign_gap, plus):
    sign = "-" if value < 0 else ("+" if plus else "")
    text = f"{left}{sign}{sign_gap if sign else ''}{'0' * zeros}{abs(value)}{right}"
    assert parse_int(text) == value
    task = ArithmeticTask()
    example = Example(prompt="", answer=str(value))
    assert task.reward(f"work\n#### {text}", example) == 1.0
    assert task.reward(f"#### {text}", Example(prompt="", answer=str(value + 1))) == 0.0


@pytest.mark.parametrize(
    "text",
    ["", " ", "42abc", "4 2", "42.0", "42.", "1,000", "--5", "+-5", "0x10", "4e2", "\u0663", "- -1", "42 !"],
)
def test_parse_int_rejects_garbage(text):
    assert parse_int(text) is None


def test_parse_int_huge_leading_zeros():
    assert parse_int("0" * 10_000 + "7") == 7
    assert parse_int("9" * 10_000) is None  # beyond Python's int-from-string limit: no crash


# --- arithmetic --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, reward",
    [
        ("#### -7", 1.0),
        ("#### - 7", 1.0),
        ("####   -007  ", 1.0),
        ("#### 7", 0.0),  # wrong sign
        ("#### +7", 0.0),
        ("-7", 0.0),  # no marker
        ("#### -7 apples", 0.0),  # garbage after the answer on its line
        ("#### -7.", 0.0),
        ("#### -7\nthe end", 1.0),  # text on later lines is ignored
        ("#### -7\n#### 3", 0.0),  # several answers: last one wins
        ("#### 3\n#### -7", 1.0),
        ("#### -7 #### 3", 0.0),
    ],
)
def test_arithmetic_reward(completion, reward):
    task = ArithmeticTask()
    assert task.reward(completion, Example(prompt="What is 3-10?\n", answer="-7")) == reward


def test_arithmetic_sample_is_consistent():
    task = ArithmeticTask(digits=2, operands=3)
    for example in examples_of(task, 200):
        text = example.prompt.removeprefix("What is ").removesuffix("?\n")
        values = [int(v) for v in text.replace("+", " ").replace("-", " ").replace("*", " ").split()]
        assert values == list(example.meta["operands"])
        assert all(10 <= v <= 99 for v in values)
        assert int(example.answer) == expressions.evaluate(expressions.parse(text))


@pytest.mark.parametrize(
    "operands, ops, demonstration",
    [
        ((8, 6, 5), ("+", "+"), "8+6=14\n14+5=19\n#### 19"),
        ((2, 3, 4), ("+", "*"), "3*4=12\n2+12=14\n#### 14"),  # the product first
        ((10, 3, 4), ("-", "*"), "3*4=12\n10-12=-2\n#### -2"),
        ((9, 5, 7), ("-", "-"), "9-5=4\n4-7=-3\n#### -3"),  # left to right
        ((2, 3, 4, 5), ("*", "+", "*"), "2*3=6\n4*5=20\n6+20=26\n#### 26"),
    ],
)
def test_arithmetic_working(operands, ops, demonstration):
    text = str(operands[0]) + "".join(op + str(v) for op, v in zip(ops, operands[1:], strict=True))
    example = Example(
        prompt=f"What is {text}?\n", answer=demonstration.rsplit(" ", 1)[1], meta={"operands": operands, "ops": ops}
    )
    assert ArithmeticTask(working=1.0).demonstration(example) == demonstration
    assert ArithmeticTask().demonstration(example) == "#### " + example.answer
    assert ArithmeticTask(working=1.0).reward(demonstration, example) == 1.0


def test_arithmetic_working_adds_up():
    task = ArithmeticTask(digits=2, operands=5, working=1.0)
    for example in examples_of(task, 200):
        *steps, answer = task.demonstration(example).split("\n")
        assert len(steps) == task.operands - 1 and answer == "#### " + example.answer
        for step in steps:  # an intermediate value may be negative: "3-12=-9", then "-9+4=-5"
            a, op, b, value = re.fullmatch(r"(-?\d+)([-+*])(-?\d+)=(-?\d+)", step).groups()
            assert {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op] == int(value)
        assert steps[-1].endswith("=" + example.answer)


def test_arithmetic_working_share():
    """A share of the prompts, fixed per prompt, show their working; 0 and 1 mean none and all."""
    examples = examples_of(ArithmeticTask(digits=3), 1000)
    shown = lambda share: [ArithmeticTask(digits=3, working=share).demonstration(e).count("\n") > 0 for e in examples]
    assert not any(shown(0.0)) and all(shown(1.0))
    quarter, half = np.array(shown(0.25)), np.array(shown(0.5))
    assert 0.2 < quarter.mean() < 0.3 and 0.45 < half.mean() < 0.55
    assert np.all(half[quarter])  # the prompts shown at 1/4 are shown at 1/2 too
    assert shown(0.5) == list(half)  # fixed per prompt


def test_format_reward():
    task = ArithmeticTask(format_reward=0.1)
    example = Example(prompt="", answer="5")
    assert task.reward("#### 5", example) == 1.0
    assert task.reward("#### 6", example) == 0.1
    assert task.reward("#### five", example) == 0.0
    assert task.reward("5", example) == 0.0
    assert ArithmeticTask().reward("#### 6", example) == 0.0  # default format reward is 0


# --- countdown ---------------------------------------------------------------------------------

CD_EXAMPLE = Example(
    prompt="Make 33 from 3 7 12 with + - *.\n", answer="33", meta={"numbers": (3, 7, 12), "target": 33}
)


@pytest.mark.parametrize(
    "answer, reward",
    [
        ("3*7+12", 1.0),
        ("  ( 3 * 7 ) + 12  ", 1.0),
        ("12+7*3", 1.0),
        ("(12-7)*3+12", 0.0),  # reuses 12
        ("3*7+12+3-3", 0.0),  # reuses 3
        ("3*11", 0.0),  # 11 is not given
        ("33", 0.0),  # 33 is not given
        ("03*7+12", 1.0),  # a leading zero does not change the number
        ("3*7+13", 0.0),  # wrong value
        ("3*7+12-0", 0.0),  # 0 is not given
        ("(3*7+12", 0.0),  # unbalanced parentheses
        ("3*7)+12", 0.0),
        ("((3*7)+12", 0.0),
        ("3*7+12=33", 0.0),  # garbage after the expression
        ("3*7+12 apples", 0.0),
        ("-3+7*3+12+3", 0.0),  # unary minus is not allowed
        ("7*3+12/1", 0.0),  # division not allowed in this task
        ("3**7", 0.0),
        ("3 7 12", 0.0),
        ("", 0.0),
        ("__import__('os').system('false')", 0.0),
        ("(" * 200 + "3" + ")" * 200, 0.0),  # deep nesting: rejected, no RecursionError
        ("9" * 40 + "-" + "9" * 40, 0.0),
    ],
)
def test_countdown_verifier(answer, reward):
    task = CountdownTask()
    assert task.reward(f"let me think\n#### {answer}", CD_EXAMPLE) == reward


def test_countdown_missing_and_several_answers():
    task = CountdownTask()
    assert task.reward("3*7+12", CD_EXAMPLE) == 0.0
    assert task.reward("#### 3*11\n#### 3*7+12", CD_EXAMPLE) == 1.0
    assert task.reward("#### 3*7+12\n#### 3*11", CD_EXAMPLE) == 0.0


def test_countdown_division_and_zero():
    task = CountdownTask(allow_division=True)
    example = Example(prompt="", answer="8", meta={"numbers": (3, 4, 6), "target": 8})
    assert task.reward("#### 6/3*4", example) == 1.0
    assert task.reward("#### 4/3*6", example) == 1.0  # exact rational arithmetic
    assert task.reward("#### 6*4/3", example) == 1.0
    assert task.reward("#### 4/(6-6)", example) == 0.0  # would reuse 6 anyway
    zero = Example(prompt="", answer="2", meta={"numbers": (4, 4, 8), "target": 2})
    assert task.reward("#### 8/(4-4)", zero) == 0.0  # division by zero
    assert task.reward("#### 8/4", zero) == 1.0
    with_format = CountdownTask(allow_division=True, format_reward=0.2)
    assert with_format.reward("#### 8/(4-4)", zero) == 0.2  # well formed but not a valid solution
    assert with_format.reward("#### 8/(4-4", zero) == 0.0


def test_countdown_use_all():
    example = Example(prompt="", answer="21", meta={"numbers": (3, 7, 12), "target": 21})
    assert CountdownTask().reward("#### 3*7", example) == 1.0
    assert CountdownTask(use_all=True).reward("#### 3*7", example) == 0.0
    assert CountdownTask(use_all=True).reward("#### 3*(19-12)", example) == 0.0


@pytest.mark.parametrize("allow_division", [False, True])
@pytest.mark.parametrize("use_all", [False, True])
def test_countdown_solutions_are_valid(allow_division, use_all):
    rng = np.random.default_rng(1)
    for _ in range(10):
        numbers = tuple(int(v) for v in rng.integers(1, 30, size=4))
        found = solutions(numbers, allow_division, use_all)
        assert found
        for value, expr in found.items():
            tree = expressions.parse(expr, "+-*/" if allow_division else "+-*")
            assert expressions.evaluate(tree) == value
            used, given = collections.Counter(expressions.literals(tree)), collections.Counter(numbers)
            assert used == given if use_all else all(used[v] <= given[v] for v in used)


def test_countdown_generates_solvable_nontrivial_instances():
    task = CountdownTask()
    for example in examples_of(task, 300):
        target = example.meta["target"]
        assert task.target_min <= target <= task.target_max
        assert target not in example.meta["numbers"]
        assert example.prompt.startswith(f"Make {target} from ")


# --- every task: demonstrations, protocol, lengths ---------------------------------------------


@pytest.mark.parametrize("name, kwargs", TASK_CONFIGS)
def test_demonstrations_earn_full_reward(name, kwargs):
    task = make_task(name, **kwargs)
    assert isinstance(task, Task)
    for seed in range(4):
        for example in examples_of(task, 100, seed):
            demo = task.demonstration(example)
            assert task.reward(demo, example) == 1.0, (example, demo)
            assert task.reward("I do not know.", example) == 0.0


@pytest.mark.parametrize("name", ["arithmetic", "countdown"])
def test_default_lengths_fit_a_tiny_model(name):
    task = make_task(name)
    examples = examples_of(task, 2000)
    assert max(len(e.prompt) for e in examples) < 48
    assert max(len(task.demonstration(e)) for e in examples) < 40


def test_a_warm_start_target_past_the_budget_is_cut_without_eos():
    """EOS only where the whole demonstration fits: a cut answer is never taught as complete, so the
    warm-started policy runs past the budget where its demonstrations did (and is truncated there)."""
    assert demonstration_ids([5, 6, 7], eos=1, budget=4) == [5, 6, 7, 1]
    assert demonstration_ids([5, 6, 7], eos=1, budget=3) == [5, 6, 7]  # fits, its EOS does not
    assert demonstration_ids([5, 6, 7, 8, 9], eos=1, budget=3) == [5, 6, 7]


# --- tokenizer ---------------------------------------------------------------------------------


def test_tokenizer_ids(tokenizer):
    assert len(tokenizer) == VOCAB_SIZE == 128
    assert VOCAB_SIZE % 64 == 0
    assert (
        (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id)
        == (
            PAD_ID,
            BOS_ID,
            EOS_ID,
            UNK_ID,
        )
        == (0, 1, 2, 3)
    )
    assert tokenizer.encode("ab") == tokenizer.encode("ab", add_special_tokens=True)  # nothing added
    assert tokenizer.encode("é") == [UNK_ID]


@pytest.mark.parametrize("name, kwargs", TASK_CONFIGS)
def test_tokenizer_round_trips_task_strings(tokenizer, name, kwargs):
    task = make_task(name, **kwargs)
    for example in examples_of(task, 50):
        for text in (
            example.prompt,
            task.demonstration(example),
            example.prompt + task.demonstration(example),
        ):
            ids = tokenizer.encode(text)
            assert UNK_ID not in ids
            assert len(ids) == len(text)  # one token per character
            assert tokenizer.decode(ids) == text


def test_tokenizer_round_trips_fixture(tokenizer):
    for record in map(json.loads, FIXTURE_PATH.read_text().splitlines()):
        for text in record.values():
            ids = tokenizer.encode(text)
            assert UNK_ID not in ids and tokenizer.decode(ids) == text


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126) | st.sampled_from("\n\t")))
def test_tokenizer_round_trips_any_ascii(tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    # A special-token literal such as "<eos>" in the text is parsed as that token (as in every HF
    # tokenizer), so skipping special tokens drops it; everything else survives.
    expected = text
    for special in tokenizer.all_special_tokens:
        expected = expected.replace(special, "")
    if expected == text:
        assert tokenizer.decode(ids + [EOS_ID, PAD_ID], skip_special_tokens=True) == text


def test_special_token_literals_in_text_become_special_tokens(tokenizer):
    ids = tokenizer.encode("1<eos>2")
    assert ids.count(EOS_ID) == 1 and tokenizer.decode(ids) == "1<eos>2"
    assert tokenizer.decode(ids, skip_special_tokens=True) == "12"


def test_autotokenizer_loads_shipped_dir(tokenizer):
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    text = "What is 12 + 3 ?\n#### 15 ."
    assert auto.encode(text) == tokenizer.encode(text)
    assert auto.decode(auto.encode(text)) == text
    assert auto.eos_token_id == EOS_ID and auto.pad_token_id == PAD_ID and len(auto) == VOCAB_SIZE
    assert load_tokenizer(TOKENIZER_DIR).encode(text) == tokenizer.encode(text)


def test_shipped_tokenizer_matches_build(tmp_path):
    for path in write_tokenizer_files(tmp_path):
        assert path.read_bytes() == (TOKENIZER_DIR / path.name).read_bytes(), path.name


# --- the dataset task --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gsm8k():
    return DatasetTask()


def example_with_answer(task, answer):
    return next(task.example(i) for i in range(len(task)) if task.example(i).answer == answer)


def test_fixture_loads(gsm8k):
    assert len(gsm8k) == 256
    assert all(gsm8k.example(i).answer for i in range(len(gsm8k)))
    assert "<<" not in gsm8k.demonstration(gsm8k.example(0))
    assert all(gsm8k.reward(gsm8k.demonstration(gsm8k.example(i)), gsm8k.example(i)) == 1.0 for i in range(256))
    # The default hold-out leaves both splits non-empty: the dataset task runs on what ships.
    assert len(DatasetPrompts(gsm8k, split="eval")) == 21 and len(DatasetPrompts(gsm8k, split="train")) == 235
    check_splits(gsm8k)


def test_fixture_is_what_its_script_generates(tmp_path):
    out = tmp_path / "fixture.jsonl"
    subprocess.run([sys.executable, "scripts/make_gsm8k_fixture.py", "--out", str(out)], cwd=ROOT, check=True)
    assert out.read_bytes() == FIXTURE_PATH.read_bytes()


@pytest.mark.parametrize(
    "gold, pred, expected",
    [
        ("42", "42", 1.0),
        ("42", "42.0", 1.0),
        ("42", "042", 1.0),
        ("42", "$42$", 1.0),
        ("42", "\\boxed{42}", 1.0),
        ("42", "42.", 1.0),
        ("42", "84/2", 1.0),
        ("42", "42 dollars", 1.0),  # math-verify tolerates units
        ("42", "41", 0.0),
        ("42", "-42", 0.0),
        ("42", "- 42", 0.0),  # math-verify alone would read 42
        ("42", "42.5", 0.0),
        ("42", "forty-two", 0.0),
        ("42", "4 2", 0.0),
        ("1,200", "1200", 1.0),
        ("1,200", "1,200", 1.0),
        ("1,200", "120", 0.0),
        ("7.5", "15/2", 1.0),
        ("7.5", "\\frac{15}{2}", 1.0),
        ("7.5", "7.50", 1.0),
        ("7.5", "7", 0.0),
        ("-3", "- 3", 1.0),
        ("-3", "-3.0", 1.0),
        ("-3", "3", 0.0),
    ],
)
def test_dataset_surface_forms(gsm8k, gold, pred, expected):
    example = example_with_answer(gsm8k, gold)
    assert gsm8k.reward(f"So the answer is clear.\n#### {pred}", example) == expected


def test_dataset_missing_and_several_answers(gsm8k):
    example = example_with_answer(gsm8k, "42")
    assert gsm8k.reward("The answer is 42.", example) == 0.0
    assert gsm8k.reward("#### ", example) == 0.0
    assert gsm8k.reward("#### 41\n#### 42", example) == 1.0
    assert gsm8k.reward("#### 42\n#### 41", example) == 0.0


def test_dataset_plain_fallback():
    task = DatasetTask(use_math_verify=False)
    example = example_with_answer(task, "7.5")
    assert task.reward("#### 15/2", example) == 1.0
    assert task.reward("#### $7.50$", example) == 1.0
    assert task.reward("#### \\frac{15}{2}", example) == 0.0  # only math-verify knows LaTeX


def test_math_verify_off_main_thread_falls_back():
    results = []
    thread = threading.Thread(target=lambda: results.append((answers_match("42.0", "42"), answers_match("41", "42"))))
    thread.start()
    thread.join()
    assert results == [(True, False)]


@pytest.mark.parametrize("failure", ["missing", "raises"])
def test_math_verify_unavailable_or_raising_falls_back(monkeypatch, failure):
    if failure == "missing":
        monkeypatch.setitem(sys.modules, "math_verify", None)  # import fails
    else:
        import math_verify

        def boom(*args, **kwargs):
            raise RuntimeError("math-verify broke")

        monkeypatch.setattr(math_verify, "parse", boom)
    assert answers_match("42.0", "42") and answers_match("$1,200$", "1200") and answers_match("15/2", "7.5")
    assert not answers_match("\\frac{15}{2}", "7.5")  # needs math-verify
    assert not answers_match("41", "42")


def test_dataset_custom_file(tmp_path):
    path = tmp_path / "qa.jsonl"
    rows = [{"q": "What is two plus two?", "a": "4"}, {"q": "Half of 9?", "a": "It is 9/2.\n#### 4.5"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    task = make_task("gsm8k", path=str(path), question_key="q", answer_key="a", prompt_template="Q: {question}\nA:")
    first, second = task.example(0), task.example(1)
    assert first.prompt == "Q: What is two plus two?\nA:" and first.answer == "4"
    assert task.demonstration(first) == "#### 4" and task.reward("#### 4", first) == 1.0
    assert second.answer == "4.5" and task.reward(task.demonstration(second), second) == 1.0
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "x"}) + "\n")
    with pytest.raises(ValueError, match="answer"):
        DatasetTask(path=str(bad))
    with pytest.raises(ValueError, match="path"):
        DatasetTask(path=str(tmp_path / "missing.jsonl"))


RECORDS = [
    {"q": "What is two plus two?", "a": "#### 4", "id": 0},
    {"q": "Half of 9?", "a": "It is 9/2.\n#### 4.5", "id": 1},
    {"q": "Three times five?", "a": "#### 15", "id": 2},
]


def write_records(path: Path, records: list[dict]) -> Path:
    """`records` as a .jsonl, .json or .parquet file, by `path`'s suffix."""
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records), path)
    elif path.suffix == ".json":
        path.write_text(json.dumps(records))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_dataset_reads_jsonl_json_and_parquet_alike(tmp_path, suffix):
    path = write_records(tmp_path / f"qa{suffix}", RECORDS)
    task = make_task("gsm8k", path=str(path), question_key="q", answer_key="a", prompt_template="Q: {question}\nA:")
    assert [task.example(i).prompt for i in range(len(task))] == [f"Q: {r['q']}\nA:" for r in RECORDS]
    assert [task.example(i).answer for i in range(len(task))] == ["4", "4.5", "15"]
    assert all(task.reward(task.demonstration(task.example(i)), task.example(i)) == 1.0 for i in range(3))


def test_dataset_separate_eval_file_is_the_eval_split(tmp_path):
    train = write_records(tmp_path / "train.parquet", RECORDS[:2])
    evaluation = write_records(tmp_path / "test.json", RECORDS[2:])
    task = make_task("gsm8k", path=str(train), eval_path=str(evaluation), question_key="q", answer_key="a")
    assert len(task) == 3 and task.split_indices("train") == [0, 1] and task.split_indices("eval") == [2]
    assert task.split_indices("eval", holdout=0.9) == [2]  # the files decide, not the hold-out
    assert {e.meta["index"] for e in DatasetPrompts(task, split="train").next_batch(6)} == {0, 1}
    assert [e.prompt for e in prompt_iterator(task, split="eval").next_batch(2)] == ["Three times five?\n"] * 2
    assert len(DatasetPrompts(task, split="all")) == 3
    check_splits(task)
    assert task.max_prompt_tokens(list) == max(len(r["q"]) + 1 for r in RECORDS)  # both files


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"path": "/no/such/qa.jsonl"}, "DatasetTask.path='/no/such/qa.jsonl' is not allowed; an existing .jsonl"),
        ({"eval_path": "/no/such/test.parquet"}, "DatasetTask.eval_path='/no/such/test.parquet'"),
        ({"path": "{dir}/qa.csv"}, "DatasetTask.path='{dir}/qa.csv' is not allowed; an existing .jsonl, .json"),
        ({"path": "{dir}/empty.jsonl"}, "a file with at least one record"),
        ({"path": "{dir}/broken.json"}, "not JSON"),
        ({"path": "{dir}/broken.parquet"}, "not a readable Parquet file"),
        ({"path": "{dir}/qa.jsonl", "question_key": "question"}, "no string field 'question' (it has ['a', 'id', "),
        ({"prompt_template": "{{q}}"}, "DatasetTask.prompt_template='{q}' is not allowed; it must contain"),
        ({"prompt_template": "{{question}} {{x}}"}, "its only field must be '{question}'"),
        ({"holdout": 0.0}, "holdout"),
    ],
)
def test_dataset_refuses_bad_files_and_fields_in_one_line(tmp_path, kwargs, words):
    for name in ("qa.jsonl", "qa.csv"):
        write_records(tmp_path / name, RECORDS)
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "broken.json").write_text("[{")
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    kwargs = {k: v.format(dir=tmp_path) if isinstance(v, str) else v for k, v in kwargs.items()}
    with pytest.raises(ValueError) as e:
        make_task("gsm8k", **kwargs)
    assert words.replace("{dir}", str(tmp_path)) in str(e.value) and "\n" not in str(e.value)


def test_empty_splits_are_refused_naming_the_split(tmp_path):
    small = write_records(tmp_path / "qa.jsonl", RECORDS)
    task = make_task("gsm8k", path=str(small), question_key="q", answer_key="a")
    assert not any(in_holdout(task.example(i).prompt) for i in range(3))  # 3 records: none held out
    with pytest.raises(ValueError, match=r"split 'eval' of 'gsm8k' is empty: none of its 3 records"):
        check_splits(task)
    # A generated task: 100 distinct prompts, a hold-out below (or above) every prompt's hash.
    prompts = {f"What is {a}+{b}?\n" for a in range(10) for b in range(10)}
    hashes = sorted(int.from_bytes(hashlib.blake2b(p.encode(), digest_size=8).digest(), "big") / 2**64 for p in prompts)
    check_splits(make_task("arithmetic", digits=1, operands=2, ops="+"))
    with pytest.raises(ValueError, match=r"split 'eval' of 'arithmetic' is empty: none of \d+ prompts drawn"):
        check_splits(make_task("arithmetic", digits=1, operands=2, ops="+", holdout=hashes[0] / 2))
    with pytest.raises(ValueError, match=r"split 'train' of 'arithmetic' is empty"):
        check_splits(make_task("arithmetic", digits=1, operands=2, ops="+", holdout=(hashes[-1] + 1) / 2))


# --- prompt iterators --------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TASKS))
def test_iterator_determinism_and_resume(name):
    task = make_task(name)
    k, m = 13, 29 + len(getattr(task, "records", ()))  # crosses an epoch boundary of the fixture
    reference = prompt_iterator(task, seed=5).next_batch(k + m)
    assert prompt_iterator(task, seed=5).next_batch(k + m) == reference
    assert [e.prompt for e in prompt_iterator(task, seed=6).next_batch(k + m)] != [e.prompt for e in reference]

    it = prompt_iterator(task, seed=5)
    assert it.next_batch(k) == reference[:k]
    state = json.loads(json.dumps(it.state()))  # plain ints, serialisable
    assert all(type(v) is int for v in state.values())
    fresh = prompt_iterator(task, seed=123)
    fresh.restore(state)
    assert fresh.next_batch(m) == reference[k:]
    assert type(it).from_state(task, state).next_batch(m) == reference[k:]
    assert [next(it) for _ in range(m)] == reference[k:]


def test_dataset_epochs_cover_the_split_once_each():
    task = DatasetTask()
    it = DatasetPrompts(task, seed=0, split="all")
    first, second = it.next_batch(len(task)), it.next_batch(len(task))
    assert sorted(e.meta["index"] for e in first) == list(range(len(task)))
    assert sorted(e.meta["index"] for e in second) == list(range(len(task)))
    assert [e.meta["index"] for e in first] != [e.meta["index"] for e in second]  # reshuffled
    assert it.state() == {"seed": 0, "epoch": 1, "position": len(task)}


@pytest.mark.parametrize("name", sorted(TASKS))
def test_train_and_eval_splits_are_disjoint(name):
    task = make_task(name)
    holdout = 0.25
    train = {e.prompt for e in prompt_iterator(task, 0, "train", holdout).next_batch(300)}
    evaluation = {e.prompt for e in prompt_iterator(task, 0, "eval", holdout).next_batch(100)}
    assert train and evaluation and not train & evaluation


def test_iterator_validation():
    task = ArithmeticTask()
    with pytest.raises(ValueError, match="split"):
        TaskPrompts(task, split="test")
    with pytest.raises(ValueError, match="holdout"):
        TaskPrompts(task, holdout=1.5)
    with pytest.raises(ValueError, match="seed"):
        TaskPrompts(task, seed=-1)
    with pytest.raises(ValueError, match="index"):
        TaskPrompts(task).restore({"seed": 0, "index": -3})
    with pytest.raises(ValueError, match="keys"):
        TaskPrompts(task).restore({"seed": 0, "epoch": 0, "position": 0})
    with pytest.raises(TypeError):
        DatasetPrompts(task)


# --- registry and validation -------------------------------------------------------------------


def test_make_task_unknown_name():
    with pytest.raises(ValueError, match="arithmetic.*countdown.*gsm8k"):
        make_task("sudoku")


@pytest.mark.parametrize(
    "name, kwargs, field",
    [
        ("arithmetic", {"digits": 0}, "digits"),
        ("arithmetic", {"digits": 2.5}, "digits"),
        ("arithmetic", {"operands": 1}, "operands"),
        ("arithmetic", {"ops": "+/"}, "ops"),
        ("arithmetic", {"ops": ""}, "ops"),
        ("arithmetic", {"working": 1.5}, "working"),
        ("arithmetic", {"working": True}, "working"),
        ("arithmetic", {"format_reward": 1.5}, "format_reward"),
        ("countdown", {"count": 9}, "count"),
        ("countdown", {"max_number": True}, "max_number"),
        ("countdown", {"target_min": 50, "target_max": 10}, "target_max"),
        ("countdown", {"allow_division": "yes"}, "allow_division"),
        ("countdown", {"colour": "red"}, "colour"),
        ("gsm8k", {"prompt_template": "no placeholder"}, "prompt_template"),
    ],
)
def test_invalid_difficulty_names_the_field(name, kwargs, field):
    with pytest.raises(ValueError, match=field):
        make_task(name, **kwargs)


def test_tasks_are_frozen_and_configurable():
    task = make_task("arithmetic", digits=np.int64(4))
    assert task.digits == 4 and type(task.digits) is int
    with pytest.raises(dataclasses.FrozenInstanceError):
        task.digits = 5
    assert make_task("countdown", count=4).count == 4


# --- every task's fields are config keys -------------------------------------------------------


@pytest.mark.parametrize("size", ["tiny", "default", "qwen3_30b_a3b"])
def test_every_task_has_a_config_section_of_exactly_its_fields(size):
    c = config_lib.base_config("gspo", size)
    assert set(c.task) == {"name", *TASKS}
    sums = {"digits": 1, "operands": 3, "ops": "+"}  # base_config's arithmetic at these sizes
    set_by_size = {"default": sums, "tiny": sums}
    for name, cls in TASKS.items():
        fields = [f for f in dataclasses.fields(cls) if f.init]
        assert list(c.task[name]) == sorted(f.name for f in fields)  # ConfigDict keeps its keys sorted
        defaults = {f.name: f.default for f in fields}
        expected = {**defaults, **set_by_size.get(size, {})} if name == c.task.name == "arithmetic" else defaults
        assert c.task[name].to_dict() == expected == {**task_fields(name), **expected}


@pytest.mark.parametrize("name", sorted(TASKS))
def test_naming_a_task_builds_it_from_its_section(name):
    c = config_lib.base_config("gspo", "tiny")
    c.task.name = name
    c.prompt_len = 160  # the longest task's prompts (the GSM8K fixture's) fit
    task = built_lib.build(c).task
    assert task == TASKS[name](**c.task[name]) and task.name == name
    assert config_lib.task_settings(c) == {"name": name, **c.task[name]}
    for field, value in {"arithmetic": ("operands", 4), "countdown": ("count", 4), "gsm8k": ("holdout", 0.25)}.items():
        if field == name:
            c.task[name][value[0]] = value[1]
            assert getattr(built_lib.build(c).task, value[0]) == value[1]


@pytest.mark.parametrize(
    "mutate, words",
    [
        (lambda c: c.task.arithmetic.update(foo=1), "config.task.arithmetic: task 'arithmetic' has no field foo; its"),
        (lambda c: c.task.countdown.update(colour=1), "config.task.countdown: task 'countdown' has no field colour"),
        (lambda c: c.task.update(digits=2), "config.task: unknown key(s) ['digits']; it holds `name` and one section"),
        (lambda c: c.task.update(name="sudoku"), "config.task.name='sudoku' is not allowed; choose one of"),
        (lambda c: c.task.arithmetic.update(ops="/"), "config.task.arithmetic: ArithmeticTask.ops='/' is not allowed"),
        (lambda c: c.update(prompt_len=8), "config.prompt_len=8 is not allowed; the prompt bucket must hold the"),
    ],
)
def test_a_wrong_task_setting_is_refused_at_build_naming_the_task(mutate, words):
    c = config_lib.base_config("gspo", "tiny")
    mutate(c)
    with pytest.raises(built_lib.ConfigError) as e:
        built_lib.build(c)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_missing_key_names_what_the_section_holds():
    c = config_lib.base_config("gspo", "tiny")
    assert config_lib.missing_key(c, "task.gsm8k.path") is None
    assert config_lib.missing_key(c, "task.arithmetic.foo") == (
        "no such config key: task.arithmetic.foo; task 'arithmetic' has the fields: "
        "format_reward, holdout, digits, operands, ops, working"
    )
    assert "e.g. config.task.arithmetic.digits" in config_lib.missing_key(c, "task.digits")
    assert "config.seed is a value" in config_lib.missing_key(c, "seed.x")


def test_the_flagship_size_starts_on_the_shipped_data():
    """configs/grpo.py:qwen3_30b_a3b shrunk as a new user would try it on a CPU: it builds, and both of
    its task's splits give a rollout's worth of prompts (the fixture used to leave "eval" empty)."""
    c = config_lib.base_config("grpo", "qwen3_30b_a3b")
    c.model.num_layers = 2
    c.mesh.update(fsdp=1, expert=1)
    built = built_lib.build(c, device_count=1)
    assert built.task.name == "gsm8k" and built.task.path == ""  # the shipped fixture
    for split in ("train", "eval"):
        assert len(prompt_iterator(built.task, seed=0, split=split).next_batch(c.rollout.num_groups)) == 64


def test_a_run_recorded_with_the_flat_task_layout_stays_readable(tmp_path):
    from gspo_jax import snapshots

    old = config_lib.base_config("gspo", "tiny").to_dict()
    old["task"] = {"name": "arithmetic", "digits": 2, "operands": 3, "ops": "+"}  # before task sections
    (tmp_path / "config.json").write_text(json.dumps(old, default=list))
    task = snapshots.open_run(tmp_path).config.task
    assert task.name == "arithmetic" and (task.arithmetic.digits, task.arithmetic.operands) == (2, 3)

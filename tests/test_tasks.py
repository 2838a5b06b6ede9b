"""Tests for gspo_jax.tasks: verifiers, demonstrations, tokenizer, dataset task, prompt iterators."""

import collections
import dataclasses
import json
import sys
import threading
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
    expressions,
    load_tokenizer,
    make_task,
    parse_int,
    prompt_iterator,
    solutions,
)
from gspo_jax.tasks.tokenizer import write_tokenizer_files

# Difficulty settings exercised by the demonstration and tokenizer tests.
TASK_CONFIGS = [
    ("arithmetic", {}),
    ("arithmetic", {"digits": 1, "operands": 4}),
    ("arithmetic", {"digits": 6, "operands": 3, "ops": "*-"}),
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
    assert len(gsm8k) == 20
    assert all(gsm8k.example(i).answer for i in range(len(gsm8k)))
    assert "<<" not in gsm8k.demonstration(gsm8k.example(0))


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


def test_dataset_parquet_goes_through_pyarrow(tmp_path, monkeypatch):
    rows = [{"question": "One plus one?", "answer": "#### 2"}]
    parquet = types.ModuleType("pyarrow.parquet")
    parquet.read_table = lambda path: types.SimpleNamespace(to_pylist=lambda: rows)
    pyarrow = types.ModuleType("pyarrow")
    pyarrow.parquet = parquet
    monkeypatch.setitem(sys.modules, "pyarrow", pyarrow)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", parquet)
    path = tmp_path / "qa.parquet"
    path.write_bytes(b"")
    task = DatasetTask(path=str(path))
    assert task.example(0).answer == "2"


# --- prompt iterators --------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TASKS))
def test_iterator_determinism_and_resume(name):
    task = make_task(name)
    k, m = 13, 29  # crosses an epoch boundary of the 20-record fixture
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

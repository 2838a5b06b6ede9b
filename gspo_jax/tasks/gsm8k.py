"""A dataset task over local question/answer records in the GSM8K style (answer text ends "#### 42").

Records come from a local JSONL file (one JSON object per line), a JSON file (a list of objects) or a
Parquet file (read with pyarrow); nothing is downloaded. `question_key` and `answer_key` name the
record's fields, `prompt_template` turns the question into the prompt. The eval split is either a
separate file (`eval_path`) or the `holdout` share of `path`'s prompts (`prompts.in_holdout`). The
reference answer is the text after the record's last "####" (the whole answer field if it has none).
Completions use the same "#### <answer>" format and are scored with `matching.answers_match`
(math-verify, with a plain numeric fallback). The default path is a made-up fixture shipped with the
package (scripts/make_gsm8k_fixture.py), for tests and smoke runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import ClassVar

import numpy as np

from gspo_jax.tasks.answers import ANSWER_MARKER, answer_text, format_answer
from gspo_jax.tasks.base import Example, VerifiableTask
from gspo_jax.tasks.matching import answers_match
from gspo_jax.tasks.prompts import SPLITS, in_holdout
from gspo_jax.validation import check_choice, fail

FIXTURE_PATH = Path(__file__).resolve().parent / "data" / "gsm8k_fixture.jsonl"
FORMATS = (".jsonl", ".json", ".parquet")

_CALCULATOR_RE = re.compile(r"<<[^<>]*>>")  # GSM8K's calculator annotations, "<<48/2=24>>"


def load_records(path: str | os.PathLike) -> list[dict]:
    """The records of a .jsonl file (one object per line), a .json file (a list of objects) or a
    .parquet file (pyarrow); ValueError (one line) for any other file or a malformed one."""
    path = Path(path)
    check_choice("load_records", "suffix", path.suffix, FORMATS)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # only Parquet files need it

        try:
            return list(pq.read_table(path).to_pylist())
        except Exception as err:  # pyarrow's errors are its own types, several lines long
            raise ValueError(f"{path}: not a readable Parquet file: {str(err).splitlines()[0]}") from None
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            records = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not JSON: {err}") from None
        if not isinstance(records, list):
            raise ValueError(f"{path}: a .json file must hold a list of records, not a {type(records).__name__}")
        return records
    records = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not a JSON object: {err}") from None
    return records


def final_answer(solution: str) -> str:
    """The reference answer of a solution text: after its last "####", else the whole text."""
    text = answer_text(solution)
    return text if text is not None else solution.strip()


@dataclasses.dataclass(frozen=True, kw_only=True)
class DatasetTask(VerifiableTask):
    """Question/answer pairs from local files, scored with math-verify (see the module docstring)."""

    name: ClassVar[str] = "gsm8k"
    path: str = ""  # a .jsonl / .json / .parquet file; "": the shipped fixture
    eval_path: str = ""  # the eval split's own file (same keys); "": hold out `holdout` of `path`
    question_key: str = "question"
    answer_key: str = "answer"
    prompt_template: str = "{question}\n"
    use_math_verify: bool = True
    strip_calculator: bool = True  # drop "<<...>>" annotations from demonstrations
    records: tuple = dataclasses.field(init=False, repr=False, compare=False)  # path's, then eval_path's
    num_train: int = dataclasses.field(init=False, repr=False, compare=False)  # how many are path's

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("question_key", "answer_key", "prompt_template"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key):
                fail("DatasetTask", key, getattr(self, key), "a non-empty string")
        if "{question}" not in self.prompt_template:
            fail("DatasetTask", "prompt_template", self.prompt_template, "it must contain '{question}'")
        try:
            self.prompt_template.format(question="")
        except (KeyError, IndexError, ValueError):
            fail("DatasetTask", "prompt_template", self.prompt_template, "its only field must be '{question}'")
        train = self._load("path", self.path or FIXTURE_PATH)
        evaluation = self._load("eval_path", self.eval_path) if self.eval_path else []
        object.__setattr__(self, "records", tuple(train + evaluation))
        object.__setattr__(self, "num_train", len(train))

    def _load(self, key: str, path: str | os.PathLike) -> list[dict]:
        """The records of `path` (the field `key`), each with string question and answer fields."""
        kinds = f"an existing {', '.join(FORMATS)} file (nothing is downloaded)"
        if not isinstance(path, (str, os.PathLike)) or Path(path).suffix not in FORMATS or not Path(path).is_file():
            fail("DatasetTask", key, str(path), kinds)
        try:
            records = load_records(path)
        except (OSError, UnicodeDecodeError) as err:
            fail("DatasetTask", key, str(path), f"a readable file ({err})")
        except ValueError as err:
            fail("DatasetTask", key, str(path), str(err).splitlines()[0])
        if not records:
            fail("DatasetTask", key, str(path), "a file with at least one record")
        for i, record in enumerate(records):
            for field in (self.question_key, self.answer_key):
                if not isinstance(record, dict) or not isinstance(record.get(field), str):
                    fields = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise ValueError(
                        f"record {i} of {str(path)!r} has no string field {field!r} (it has {fields}); "
                        "set question_key / answer_key"
                    )
        return records

    def __len__(self) -> int:
        return len(self.records)

    def split_indices(self, split: str, holdout: float | None = None) -> list[int]:
        """The record indices of `split`: with `eval_path`, its records are "eval" and `path`'s
        "train"; else a prompt is "eval" iff `in_holdout(prompt, holdout)` (default: `self.holdout`)."""
        check_choice("DatasetTask", "split", split, SPLITS)
        if split == "all":
            return list(range(len(self)))
        if self.eval_path:
            return list(range(self.num_train) if split == "train" else range(self.num_train, len(self)))
        holdout = self.holdout if holdout is None else holdout
        return [i for i in range(len(self)) if in_holdout(self.example(i).prompt, holdout) == (split == "eval")]

    def example(self, index: int) -> Example:
        """The `index`-th record as an Example (meta: index, full solution text)."""
        record = self.records[index]
        solution = record[self.answer_key]
        return Example(
            prompt=self.prompt_template.format(question=record[self.question_key].strip()),
            answer=final_answer(solution),
            meta={"index": int(index), "solution": solution},
        )

    def sample(self, rng: np.random.Generator) -> Example:
        """A uniformly random record (use `prompts.DatasetPrompts` for epoch-wise shuffling)."""
        return self.example(int(rng.integers(len(self.records))))

    def max_prompt_tokens(self, encode) -> int:
        return max(len(encode(self.example(i).prompt)) for i in range(len(self)))

    def extract_answer(self, completion: str) -> str | None:
        """The text after the last "####" on its line (any text; the matcher decides)."""
        return answer_text(completion)

    def is_correct(self, answer: str, example: Example) -> bool:
        return answers_match(answer, example.answer, use_math_verify=self.use_math_verify)

    def demonstration(self, example: Example) -> str:
        """The record's own solution (calculator annotations removed), ending in "#### <answer>"."""
        solution = example.meta["solution"].strip()
        if self.strip_calculator:
            solution = _CALCULATOR_RE.sub("", solution)
        if ANSWER_MARKER not in solution:
            return format_answer(example.answer)
        return solution

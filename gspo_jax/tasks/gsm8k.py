"""A dataset task over local question/answer records in the GSM8K style (answer text ends "#### 42").

Records come from a JSONL file (one JSON object per line) or, if pyarrow is installed, a parquet
file; nothing is downloaded. The reference answer is the text after the record's last "####" (the
whole answer field if it has none). Completions use the same "#### <answer>" format and are scored
with `matching.answers_match` (math-verify, with a plain numeric fallback). The default path is a
small made-up fixture shipped with the package, for tests and smoke runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import numpy as np

from gspo_jax.tasks.answers import ANSWER_MARKER, answer_text, format_answer
from gspo_jax.tasks.base import Example, VerifiableTask
from gspo_jax.tasks.matching import answers_match
from gspo_jax.validation import fail

FIXTURE_PATH = Path(__file__).resolve().parent / "data" / "gsm8k_fixture.jsonl"

_CALCULATOR_RE = re.compile(r"<<[^<>]*>>")  # GSM8K's calculator annotations, "<<48/2=24>>"


def load_records(path: str | os.PathLike) -> list[dict]:
    """Reads a .jsonl (or .json list) file, or a .parquet file when pyarrow is available."""
    path = Path(path)
    if path.suffix == ".parquet":
        try:  # optional dependency: only .parquet files need it
            import pyarrow.parquet as pq
        except ImportError as err:
            raise ImportError(f"reading {path} needs pyarrow; use a .jsonl file instead") from err
        return list(pq.read_table(path).to_pylist())
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        return list(json.loads(text))
    records = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not a JSON object: {err}") from err
    return records


def final_answer(solution: str) -> str:
    """The reference answer of a solution text: after its last "####", else the whole text."""
    text = answer_text(solution)
    return text if text is not None else solution.strip()


@dataclasses.dataclass(frozen=True, kw_only=True)
class DatasetTask(VerifiableTask):
    """Question/answer pairs from a local file, scored with math-verify (see the module docstring)."""

    name: str = "gsm8k"
    path: str | None = None  # None: the shipped fixture
    question_key: str = "question"
    answer_key: str = "answer"
    prompt_template: str = "{question}\n"
    use_math_verify: bool = True
    strip_calculator: bool = True  # drop "<<...>>" annotations from demonstrations
    records: tuple = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        path = FIXTURE_PATH if self.path is None else Path(self.path)
        if not path.is_file():
            fail("DatasetTask", "path", str(path), "an existing JSONL file")
        if "{question}" not in self.prompt_template:
            fail("DatasetTask", "prompt_template", self.prompt_template, "it must contain '{question}'")
        records = load_records(path)
        if not records:
            fail("DatasetTask", "path", str(path), "a JSONL file with at least one record")
        for i, record in enumerate(records):
            for key in (self.question_key, self.answer_key):
                if not isinstance(record.get(key), str):
                    raise ValueError(f"record {i} of {str(path)!r} has no string field {key!r}")
        object.__setattr__(self, "records", tuple(records))

    def __len__(self) -> int:
        return len(self.records)

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

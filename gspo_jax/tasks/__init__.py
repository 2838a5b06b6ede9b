"""Verifiable tasks for critic-free RL (arithmetic, countdown, a GSM8K-style dataset from a local
JSONL / JSON / Parquet file), their rewards, seeded resumable prompt iterators with a train / eval
split, and the character tokenizer in the Hugging Face format.

Completion format for every task: the final answer on a line "#### <answer>"; the last marker wins
(see `answers.py`).
"""

from gspo_jax.tasks.answers import ANSWER_MARKER, answer_text, format_answer, parse_int
from gspo_jax.tasks.arithmetic import ArithmeticTask
from gspo_jax.tasks.base import Example, Task, VerifiableTask
from gspo_jax.tasks.countdown import CountdownTask, solutions
from gspo_jax.tasks.gsm8k import FIXTURE_PATH, DatasetTask, load_records
from gspo_jax.tasks.matching import answers_match
from gspo_jax.tasks.prompts import DatasetPrompts, TaskPrompts, check_splits, in_holdout, prompt_iterator
from gspo_jax.tasks.registry import TASKS, check_fields, make_task, task_fields
from gspo_jax.tasks.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    TOKENIZER_DIR,
    UNK_ID,
    VOCAB_SIZE,
    load_tokenizer,
)

__all__ = [
    "ANSWER_MARKER",
    "BOS_ID",
    "EOS_ID",
    "FIXTURE_PATH",
    "PAD_ID",
    "TASKS",
    "TOKENIZER_DIR",
    "UNK_ID",
    "VOCAB_SIZE",
    "ArithmeticTask",
    "CountdownTask",
    "DatasetPrompts",
    "DatasetTask",
    "Example",
    "Task",
    "TaskPrompts",
    "VerifiableTask",
    "answer_text",
    "answers_match",
    "check_fields",
    "check_splits",
    "format_answer",
    "in_holdout",
    "load_records",
    "load_tokenizer",
    "make_task",
    "parse_int",
    "prompt_iterator",
    "solutions",
    "task_fields",
]

"""Verifiable tasks for critic-free RL (arithmetic, countdown, a GSM8K-style dataset), their
rewards, seeded resumable prompt iterators, and the character tokenizer in the Hugging Face format.

Completion format for every task: the final answer on a line "#### <answer>"; the last marker wins
(see `answers.py`).
"""

from gspo_jax.tasks.answers import ANSWER_MARKER, answer_text, format_answer, parse_int
from gspo_jax.tasks.arithmetic import ArithmeticTask
from gspo_jax.tasks.base import Example, Task, VerifiableTask
from gspo_jax.tasks.countdown import CountdownTask, solutions
from gspo_jax.tasks.gsm8k import FIXTURE_PATH, DatasetTask, load_records
from gspo_jax.tasks.matching import answers_match
from gspo_jax.tasks.prompts import DatasetPrompts, TaskPrompts, in_holdout, prompt_iterator
from gspo_jax.tasks.registry import TASKS, make_task
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
    "format_answer",
    "in_holdout",
    "load_records",
    "load_tokenizer",
    "make_task",
    "parse_int",
    "prompt_iterator",
    "solutions",
]

"""The task registry: `TASKS` by name and `make_task(name, **kwargs)`, e.g. from a config."""

from __future__ import annotations

import dataclasses

from gspo_jax.tasks.arithmetic import ArithmeticTask
from gspo_jax.tasks.base import Task
from gspo_jax.tasks.countdown import CountdownTask
from gspo_jax.tasks.gsm8k import DatasetTask
from gspo_jax.validation import check_choice, fail

TASKS: dict[str, type] = {
    "arithmetic": ArithmeticTask,
    "countdown": CountdownTask,
    "gsm8k": DatasetTask,
}


def make_task(name: str, **kwargs) -> Task:
    """Builds the task `name` with its knobs set from `kwargs`.

    Raises ValueError naming the allowed task names for an unknown name, the allowed fields for an
    unknown keyword, and the offending field for an invalid value.
    """
    check_choice("task", "name", name, sorted(TASKS))
    cls = TASKS[name]
    allowed = sorted(f.name for f in dataclasses.fields(cls) if f.init)
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        fail("task", ",".join(unknown), name, f"task {name!r} has the fields {', '.join(allowed)}")
    return cls(**kwargs)

"""The task registry: `TASKS` by name, each task's settings (`task_fields`), and `make_task(name, **kwargs)`,
e.g. from a config."""

from __future__ import annotations

import dataclasses
from typing import Any

from gspo_jax.tasks.arithmetic import ArithmeticTask
from gspo_jax.tasks.base import Task
from gspo_jax.tasks.countdown import CountdownTask
from gspo_jax.tasks.gsm8k import DatasetTask
from gspo_jax.validation import ConfigError, check_choice

TASKS: dict[str, type] = {
    "arithmetic": ArithmeticTask,
    "countdown": CountdownTask,
    "gsm8k": DatasetTask,
}


def task_fields(name: str) -> dict[str, Any]:
    """Task `name`'s settings: its dataclass's fields (those set at construction) with their defaults,
    in declaration order; what `config.task.<name>` holds."""
    check_choice("task", "name", name, sorted(TASKS))
    fields = [f for f in dataclasses.fields(TASKS[name]) if f.init]
    return {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default for f in fields}


def check_fields(name: str, keys) -> None:
    """Raises ConfigError naming task `name`'s fields if `keys` holds any other."""
    fields = task_fields(name)
    unknown = sorted(set(keys) - set(fields))
    if unknown:
        raise ConfigError(f"task {name!r} has no field {', '.join(unknown)}; its fields: {', '.join(fields)}")


def make_task(name: str, **kwargs) -> Task:
    """Builds the task `name` with its knobs set from `kwargs`.

    Raises ValueError naming the allowed task names for an unknown name, the allowed fields for an
    unknown keyword, and the offending field for an invalid value.
    """
    check_fields(name, kwargs)
    return TASKS[name](**kwargs)

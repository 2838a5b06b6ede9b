"""The one way a bad setting is refused: `ConfigError`, a one-line `ValueError` that names the field, the
value and what is allowed — "LossConfig.eps_low=-1 is not allowed; it must be a finite number >= 0".

Every config dataclass (model, loss, rollout, tasks) and the sampler check their arguments with these
helpers at construction, before any array is touched; `built.build` prefixes the config key.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Collection
from typing import Any


class ConfigError(ValueError):
    """A setting that cannot work; the message is one line naming the field and what is allowed."""


def fail(owner: str, field: str, value: Any, allowed: str) -> None:
    """Raises `ConfigError("{owner}.{field}={value!r} is not allowed; {allowed}")`."""
    raise ConfigError(f"{owner}.{field}={value!r} is not allowed; {allowed}")


def check(ok: bool, owner: str, field: str, value: Any, allowed: str) -> None:
    if not ok:
        fail(owner, field, value, allowed)


def check_choice(owner: str, field: str, value: Any, choices: Collection) -> None:
    check(value in choices, owner, field, value, f"choose one of {tuple(choices)}")


def is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(owner: str, field: str, value: Any, low: int = 1, high: int | None = None) -> None:
    ok = is_int(value) and value >= low and (high is None or value <= high)
    check(ok, owner, field, value, f"it must be an int >= {low}" if high is None else f"an int in [{low}, {high}]")


def check_number(
    owner: str,
    field: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    strict: bool = False,
    allow_none: bool = False,
) -> None:
    """A finite real number in [low, high] (or (low, high] with `strict`), or None when allowed."""
    if value is None and allow_none:
        return
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if strict else value >= low
    if ok and high is not None:
        ok = value <= high
    bounds = []
    if low is not None:
        bounds.append(f"{'>' if strict else '>='} {low}")
    if high is not None:
        bounds.append(f"<= {high}")
    allowed = "it must be a finite number" + (" " + " and ".join(bounds) if bounds else "")
    check(ok, owner, field, value, allowed + (" or None" if allow_none else ""))

"""Counts XLA backend compiles in this process (jax.monitoring events): how the trainer logs, and the
tests assert, that every jitted function compiles once. (`jitted._cache_size()` is not reliable for
this: it reads a global LRU shared with every other jitted function and eager op.)"""

import jax

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_total = [0]


def _on_event(name, *args, **kwargs):
    if name == COMPILE_EVENT:
        _total[0] += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def total() -> int:
    """XLA compiles since this module was imported."""
    return _total[0]


class CompileCounter:
    """Compiles since construction or the last `reset()`."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self._start = total()

    @property
    def count(self) -> int:
        return total() - self._start

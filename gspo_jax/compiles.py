"""Counts XLA backend compiles in this process (jax.monitoring events): how the trainer logs, and the
tests assert, that every jitted function compiles once. (`jitted._cache_size()` is not reliable for
this: it reads a global LRU shared with every other jitted function and eager op.) And keeps compiled
programs across processes (`use_persistent_cache`), so reruns and sweeps do not pay compilation again."""

from pathlib import Path

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


def run_once_options() -> dict[str, int] | None:
    """XLA options for a program a run executes once (random init): on CPU, LLVM at -O1 instead of -O2
    compiles it about 3× faster (3.0 -> 0.9 s at the `iteration` shape) to bitwise the same output,
    running as fast. Not for the step programs: -O1 made the `bench` train step 2× slower."""
    return {"xla_backend_optimization_level": 1} if jax.default_backend() == "cpu" else None


def use_persistent_cache(directory: str | Path) -> None:
    """Keeps every compiled program in `directory` (JAX's persistent compilation cache): a resumed run,
    or the next run of a sweep with the same shapes, loads its programs instead of compiling them.
    Entries are keyed by the program, the JAX/XLA version and the flags, so a stale one is never used."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

"""Counts XLA backend compiles in this process (jax.monitoring events): how the trainer logs, and the
tests assert, that every jitted function compiles once. (`jitted._cache_size()` is not reliable for
this: it reads a global LRU shared with every other jitted function and eager op.) And keeps compiled
programs across processes (`use_persistent_cache`), so reruns and sweeps do not pay compilation again;
chooses XLA:CPU's fast-compile code generation (`step_options`, `run_once_options`); and compiles a
program ahead, on a background thread (`Background`)."""

import concurrent.futures
import functools
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


# XLA:CPU's older loop emitters (LLVM IR written directly, not through MLIR) at LLVM -O1: the
# `iteration` train step compiles in 2.2-2.3 instead of 4.3-4.4 s, the sampler in 1.8 instead of 2.4 s.
# Their loops run as fast over activation-sized arrays (the `iteration` step about 5% slower, the
# default config's faster), but about 3x slower over parameter stacks of 100+ MiB (the optimizer's
# passes on `bench`: its step 750 -> 905 ms), so a large model on CPU turns it off (`cpu_fast_compile`).
FAST_CPU_COMPILE = {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 1}


def run_once_options() -> dict | None:
    """XLA options for a program a run executes once (random init): on CPU the fast-compile options,
    whatever `cpu_fast_compile` says (the `iteration` shape's init compiles in 0.6 s; 0.8 s at -O1 with
    the default emitters, 3.0 s at -O2), drawing bitwise the same parameters."""
    return dict(FAST_CPU_COMPILE) if jax.default_backend() == "cpu" else None


def step_options(fast: bool) -> dict | None:
    """XLA options for the programs a run executes every iteration (`config.cpu_fast_compile`): on CPU
    with `fast`, the fast-compile options, keeping the test suite's -O0 where it is on
    (JAX_DISABLE_MOST_OPTIMIZATIONS); None (XLA's defaults) otherwise and on every other backend."""
    if not fast or jax.default_backend() != "cpu":
        return None
    if jax.config.values["jax_disable_most_optimizations"]:
        return {"xla_cpu_use_fusion_emitters": False}
    return dict(FAST_CPU_COMPILE)


_BACKGROUND = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gspo_jax_compile")


class Background:
    """`fn` (a `functools.partial` of a jitted function over its static arguments) lowered and compiled
    for `abstract` arguments (ShapeDtypeStructs with shardings) on a background thread, so a run's
    first iteration does not wait for programs that are needed later (XLA releases the GIL while it
    compiles). Called like `fn`: the first call waits for the compile, and every call runs that one
    executable (arguments of another shape or sharding raise TypeError, never recompile)."""

    def __init__(self, fn: functools.partial, *abstract):
        self._future = _BACKGROUND.submit(lambda: fn.func.lower(*fn.args, *abstract, **fn.keywords).compile())

    def __call__(self, *args):
        return self._future.result()(*args)


def use_persistent_cache(directory: str | Path) -> None:
    """Keeps every compiled program in `directory` (JAX's persistent compilation cache): a resumed run,
    or the next run of a sweep with the same shapes, loads its programs instead of compiling them.
    Entries are keyed by the program, the JAX/XLA version and the flags, so a stale one is never used."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

"""Counts XLA backend compiles in this process (jax.monitoring events): how the trainer logs, and the
tests assert, that every jitted function compiles once. (`jitted._cache_size()` is not reliable for
this: it reads a global LRU shared with every other jitted function and eager op.) And keeps compiled
programs across processes (`use_persistent_cache`), so reruns and sweeps do not pay compilation again;
chooses XLA:CPU's fast-compile code generation (`step_options`, `run_once_options`); and binds a jitted
function's static arguments into a `Program`, which can be lowered (AOT, profiling) or compiled ahead
on a background thread."""

import concurrent.futures
import functools
import logging
import threading
from pathlib import Path

import jax
import numpy as np

log = logging.getLogger(__name__)

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_total = [0]
_probing = threading.local()  # a thread's option probe (`xla_knows`) is not one of the run's compiles


def _on_event(name, *args, **kwargs):
    if name == COMPILE_EVENT and not getattr(_probing, "active", False):
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
# XLA dropped the older emitters (jax 0.12 answers "No such compile option"): what the running XLA does
# not know is left out (`supported`), which leaves -O1 there.
FAST_CPU_COMPILE = {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 1}


@functools.cache
def xla_knows(name: str, value) -> bool:
    """Whether the running XLA accepts compile option `name` (set to `value`): asked of XLA itself, by
    compiling a one-op program with it, never assumed from a version string. Cached per process."""
    _probing.active = True
    try:
        jax.jit(lambda x: x + 1, compiler_options={name: value}).lower(np.float32(0)).compile()
        return True
    except Exception as e:  # jaxlib's error type moved between releases; the message did not
        if "No such compile option" not in str(e):
            raise
        return False
    finally:
        _probing.active = False


def supported(options: dict | None) -> dict | None:
    """`options` without those the running XLA does not know, each dropped with one debug line."""
    if options is None:
        return None
    kept = {}
    for name, value in options.items():
        if xla_knows(name, value):
            kept[name] = value
        else:
            log.debug("XLA %s has no compile option %r: left out", jax.__version__, name)
    return kept


def run_once_options() -> dict | None:
    """XLA options for a program a run executes once (random init): on CPU the fast-compile options,
    whatever `cpu_fast_compile` says (the `iteration` shape's init compiles in 0.6 s; 0.8 s at -O1 with
    the default emitters, 3.0 s at -O2), drawing bitwise the same parameters. Where the test suite's -O0
    is on (JAX_DISABLE_MOST_OPTIMIZATIONS) it stays: the tiny init compiles in 3.1 s there, 4.4 s at -O1."""
    if jax.default_backend() != "cpu" or jax.config.values["jax_disable_most_optimizations"]:
        return None
    return supported(FAST_CPU_COMPILE)


def step_options(fast: bool) -> dict | None:
    """XLA options for the programs a run executes every iteration (`config.cpu_fast_compile`): on CPU
    with `fast`, the fast-compile options, keeping the test suite's -O0 where it is on
    (JAX_DISABLE_MOST_OPTIMIZATIONS); None (XLA's defaults) otherwise and on every other backend."""
    if not fast or jax.default_backend() != "cpu":
        return None
    if jax.config.values["jax_disable_most_optimizations"]:
        return supported({"xla_cpu_use_fusion_emitters": False})
    return supported(FAST_CPU_COMPILE)


_BACKGROUND = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gspo_jax_compile")


class Program:
    """A jitted function with its static arguments bound, and after them `args`, arrays it takes as
    arguments rather than as constants (a learning-rate schedule: programs that differ only in those
    compile once): called like the function on the rest, and lowered for abstract ones (`lower`:
    AOT, profiling) without unpacking anything. `in_background` gives a copy compiled ahead, on a
    background thread."""

    def __init__(self, jitted, *static, args: tuple = (), args_sharding=None):
        self.jitted, self.static, self.args, self.args_sharding = jitted, static, args, args_sharding
        self._compiled: concurrent.futures.Future | None = None
        self._placed: tuple | None = None  # `args` on the devices (`args_sharding`), from the first call on

    def _args(self) -> tuple:
        """`args` as a call passes them: placed once, at the first call (not at construction: a
        deviceless AOT compile only lowers), so no call transfers them again."""
        if self.args_sharding is None:
            return self.args
        if self._placed is None:
            self._placed = jax.device_put(self.args, self.args_sharding)
        return self._placed

    def __call__(self, *args):
        if self._compiled is not None:
            return self._compiled.result()(*self._args(), *args)
        return self.jitted(*self.static, *self._args(), *args)

    def lower(self, *abstract) -> jax.stages.Lowered:
        """The program lowered for `abstract` arguments (ShapeDtypeStructs with shardings)."""
        return self.jitted.lower(*self.static, *self.args, *abstract)

    def compile(self, *abstract) -> "Program":
        """This program compiled now for `abstract` arguments: called like this one, every call runs
        that one executable (`executable`: its HLO text, its memory analysis)."""
        ahead = Program(self.jitted, *self.static, args=self.args, args_sharding=self.args_sharding)
        ahead._compiled = concurrent.futures.Future()
        ahead._compiled.set_result(self.lower(*abstract).compile())
        return ahead

    @property
    def executable(self) -> jax.stages.Compiled:
        """The executable of a program from `compile` or `in_background` (waiting for its compile)."""
        if self._compiled is None:
            raise ValueError("not compiled ahead: use Program.compile or Program.in_background")
        return self._compiled.result()

    def in_background(self, *abstract) -> "Program":
        """This program compiled for `abstract` arguments on a background thread, so a run's first
        iteration does not wait for programs that are needed later (XLA releases the GIL while it
        compiles). Its first call waits for the compile, and every call runs that one executable
        (arguments of another shape or sharding raise TypeError, never recompile)."""
        ahead = Program(self.jitted, *self.static, args=self.args, args_sharding=self.args_sharding)
        ahead._compiled = _BACKGROUND.submit(lambda: self.lower(*abstract).compile())
        return ahead


def use_persistent_cache(directory: str | Path) -> None:
    """Keeps every compiled program in `directory` (JAX's persistent compilation cache): a resumed run,
    or the next run of a sweep with the same shapes, loads its programs instead of compiling them.
    Entries are keyed by the program, the JAX/XLA version and the flags, so a stale one is never used."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

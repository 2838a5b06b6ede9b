"""Test set-up: a fake 8-device CPU platform, configured before JAX is imported."""

import atexit
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the session, inherited by the processes tests start: the same
# tiny programs compile again in many modules (each module's are dropped, below) and child processes
# (test_runs + test_critic: 403 -> 323 s). A load still counts for `compile_counter` (the same
# jax.monitoring event as a compile), so the compile-once tests assert the same thing.
# Under pytest-xdist the controller makes it and removes it at exit; its workers inherit it.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="gspo_jax_tests_xla_")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
# Tests check what programs compute, not how fast they run, and their time is mostly XLA:CPU compiling
# tiny programs: JAX's own switch for that (LLVM at -O0 without its expensive passes; XLA's HLO passes
# unchanged) takes about a third off. Child processes inherit it, except the TPU AOT compiles (what
# they assert is memory). JAX_DISABLE_MOST_OPTIMIZATIONS=0 runs the suite fully optimised.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import gc  # noqa: E402

import jax  # noqa: E402  (must come after XLA_FLAGS)
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# CI explores the same examples every run (reproducible); local runs keep drawing new ones.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

jax.config.update("jax_default_matmul_precision", "highest")

# Python's cyclic garbage collector: a full collection walks every live object (JAX's caches, the
# imported libraries: 0.2-0.35 s each in a worker), and at the default thresholds one ran about every
# 70,000 net allocations, which tracing makes by the million: ~4% of the suite's CPU time. The modules
# imported so far are never garbage: frozen out of every collection. Full collections come 10x less
# often (the young generations as before); each test module still ends with one (below).
gc.collect()
gc.freeze()
gc.set_threshold(gc.get_threshold()[0], gc.get_threshold()[1], 100)


# The slowest modules, longest first (end-to-end runs in child processes, then the step and model
# tests; `pytest --durations=0` per module): each xdist worker takes whole modules (and classes) in
# this order, so no worker is left with a long one at the end (pytest.ini). test_train (~210 s) used
# to come last alphabetically and left one worker ~200 s behind the other.
SLOWEST_FIRST = (
    "test_benchmarks.py",
    "test_multihost.py",
    "test_train.py",
    "test_critic.py",
    "test_runs.py",
    "test_sweep.py",
    "test_model.py",
    "test_aot.py",
    "test_losses.py",
)
MAX_WORKERS = 4  # a worker holds up to ~4 GB (compiled programs of a module, fake 8-device arrays)


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core, at most MAX_WORKERS."""
    return max(1, min(os.cpu_count() or 1, MAX_WORKERS))


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    """XLA:CPU maps memory for every compiled program (about 5 maps each) and keeps it while JAX caches
    the program: the whole suite in one process passed the kernel's limit (vm.max_map_count = 65,530)
    and the next compile aborted. Each test module's programs are dropped when it ends."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture
def fully_optimised():
    """Compiles as a real run does (the suite turns most optimizations off, above): for tests about the
    bits a given optimization level produces. Compiled programs are dropped on both sides, as the
    switch is not part of JAX's in-memory cache keys."""
    before = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", False)
    jax.clear_caches()
    yield
    jax.config.update("jax_disable_most_optimizations", before)
    jax.clear_caches()


@pytest.fixture
def compile_counter():
    """XLA compiles since the test started (or since `compile_counter.reset()`)."""
    from gspo_jax.compiles import CompileCounter

    return CompileCounter()

"""Where the test suite's time goes, per test module: seconds of XLA backend compile, tracing and lowering
in the pytest processes (xdist workers included; child processes a test starts are not seen), and the
compile seconds the persistent cache saved; then the programs (the jitted functions' names) that took the
most compile time, with how often each compiled. A pytest plugin, for profiling the suite before cutting it:

    pytest -p benchmarks.suite_compiles            # two tables at the end, slowest first

It listens to JAX's own duration events (`jax.monitoring`); each xdist worker writes its sums to a
temporary folder and the controller prints them merged."""

from __future__ import annotations

import atexit
import collections
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

EVENTS = {  # column -> JAX's event
    "compile": "/jax/core/compile/backend_compile_duration",
    "trace": "/jax/core/compile/jaxpr_trace_duration",
    "lower": "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "cache_saved": "/jax/compilation_cache/compile_time_saved_sec",
}
_COLUMN = {event: column for column, event in EVENTS.items()}
_ENV = "GSPO_JAX_SUITE_COMPILES_DIR"  # where workers write their sums (made by the controller)


class _Sums:
    def __init__(self):
        self.seconds = collections.defaultdict(collections.Counter)  # module -> column -> seconds
        self.compiles = collections.Counter()  # module -> backend compiles
        self.programs = collections.defaultdict(collections.Counter)  # "jit(name)" -> compile seconds, compiles
        self.module = "(collection)"

    def listen(self, event: str, duration: float, fun_name: str = "?", **_) -> None:
        column = _COLUMN.get(event)  # called on every JAX duration event: one dict lookup
        if column is not None:
            self.seconds[self.module][column] += duration
            if column == "compile":
                self.compiles[self.module] += 1
                self.programs[fun_name].update(compile=duration, compiles=1)

    def as_json(self) -> dict:
        modules = {m: {**self.seconds[m], "compiles": self.compiles[m]} for m in self.seconds}
        return {"modules": modules, "programs": {p: dict(c) for p, c in self.programs.items()}}


_sums = _Sums()


def pytest_configure(config):
    from jax import monitoring

    monitoring.register_event_duration_secs_listener(_sums.listen)
    if not os.environ.get("PYTEST_XDIST_WORKER") and _ENV not in os.environ:
        os.environ[_ENV] = tempfile.mkdtemp(prefix="gspo_jax_suite_compiles_")  # the workers inherit it
        atexit.register(shutil.rmtree, os.environ[_ENV], ignore_errors=True)  # the controller's, after its summary


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _sums.module = item.path.name
    yield


def pytest_sessionfinish(session):
    folder = Path(os.environ[_ENV])
    worker = os.environ.get("PYTEST_XDIST_WORKER", "controller")
    (folder / f"{worker}.json").write_text(json.dumps(_sums.as_json()))


def merged(folder: Path, part: str = "modules") -> dict[str, dict[str, float]]:
    """Every process's sums in `folder`, added up per module (`part` "modules") or per program ("programs")."""
    total: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for f in folder.glob("*.json"):
        for key, sums in json.loads(f.read_text())[part].items():
            total[key].update(sums)
    return {k: dict(c) for k, c in total.items()}


def table(sums: dict[str, dict[str, float]]) -> list[str]:
    """Rows of `sums`, the most compile time first, and their total."""
    columns = (*EVENTS, "compiles")
    rows = [f"{'module':<32}" + "".join(f"{c:>12}" for c in columns)]
    order = sorted(sums, key=lambda m: -sums[m].get("compile", 0.0))
    for m in [*order, "total"]:
        s = sums.get(m) or {c: sum(x.get(c, 0.0) for x in sums.values()) for c in columns}
        rows.append(f"{m:<32}" + "".join(f"{s.get(c, 0.0):>12.1f}" for c in EVENTS) + f"{s.get('compiles', 0):>12.0f}")
    return rows


def program_table(programs: dict[str, dict[str, float]], top: int = 20) -> list[str]:
    """The `top` programs by compile seconds: seconds, compiles, seconds per compile."""
    rows = [f"{'program':<40}{'compile':>12}{'compiles':>12}{'per compile':>12}"]
    for p in sorted(programs, key=lambda p: -programs[p]["compile"])[:top]:
        s, n = programs[p]["compile"], programs[p]["compiles"]
        rows.append(f"{p[:40]:<40}{s:>12.1f}{n:>12.0f}{s / n:>12.2f}")
    return rows


def pytest_terminal_summary(terminalreporter):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    folder = Path(os.environ[_ENV])
    terminalreporter.section("XLA seconds per test module (benchmarks.suite_compiles)")
    for line in table(merged(folder)):
        terminalreporter.write_line(line)
    terminalreporter.section("XLA compile seconds per program, the most first (benchmarks.suite_compiles)")
    for line in program_table(merged(folder, "programs")):
        terminalreporter.write_line(line)

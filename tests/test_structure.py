"""The library's shape, held by its own code: rooms of one job and bounded size, functions that take
few arguments, and the run's decisions made once, in the build (`built.Plan`)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = sorted((ROOT / "gspo_jax").rglob("*.py"))
MAX_LINES = 550  # a module over this holds more than one job
MAX_PARAMS = 10  # past this a function takes a typed value (a frozen config, a NamedTuple)


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def _params(fn: ast.FunctionDef) -> int:
    a = fn.args
    names = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
    return len([n for n in names if n.arg not in ("self", "cls")])


def _function(module: str, name: str) -> ast.FunctionDef:
    return next(f for f in _functions(ROOT / module) if f.name == name)


def _lines(fn: ast.FunctionDef) -> int:
    return fn.end_lineno - fn.lineno + 1


def test_no_library_module_is_over_its_line_budget():
    long = {str(p.relative_to(ROOT)): n for p in LIBRARY if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_no_library_function_takes_more_than_ten_parameters():
    many = [
        f"{p.relative_to(ROOT)}:{fn.name} ({_params(fn)})" for p in LIBRARY for fn in _functions(p) if _params(fn) > 10
    ]
    assert not many, f"functions over {MAX_PARAMS} parameters: {many}"


@pytest.mark.parametrize(
    "module, name, most",
    [
        ("gspo_jax/train.py", "train_step", 60),
        ("gspo_jax/train.py", "_loss", 25),  # the step's loss function
        ("gspo_jax/iteration.py", "rl_iteration", 60),
    ],
)
def test_the_step_and_the_iteration_read_top_to_bottom(module, name, most):
    assert _lines(_function(module, name)) <= most


def test_the_iteration_takes_its_run_context_not_its_pieces():
    assert _params(_function("gspo_jax/iteration.py", "rl_iteration")) <= 4


def test_the_runs_decisions_are_made_in_the_build_alone():
    """Which replay a run does is read from `Built.plan` downstream, never worked out again: the
    replay's names appear only in the build (the study, which names its arms by them, aside)."""
    core = [p for p in LIBRARY if "study" not in p.relative_to(ROOT).parts]
    for mode in ('"R3W"', '"R3"', '"R2"'):
        where = [str(p.relative_to(ROOT)) for p in core if mode in p.read_text()]
        assert where == ["gspo_jax/built.py"], (mode, where)

"""Who may import the study (gspo_jax/study/: sweep files, their runner and report, the analysis, the
claims table): the study itself, the scripts, the tests and the sweep files (configs/sweeps/, which take
its `grid`). The library, the benchmarks and the other configs do not, so that the training code never
depends on one study's tools. Imports are read with `ast`: a docstring that names the study is no import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STUDY = "gspo_jax.study"
CHECKED = ("gspo_jax", "benchmarks", "configs")  # every Python file under these, and the repository's own
MAY_IMPORT = ("gspo_jax/study/", "scripts/", "tests/", "configs/sweeps/")


def checked_files() -> list[Path]:
    """The Python files that must not import the study."""
    files = [*REPO.glob("*.py"), *(p for root in CHECKED for p in (REPO / root).rglob("*.py"))]
    return sorted(p for p in files if not p.relative_to(REPO).as_posix().startswith(MAY_IMPORT))


def _is_study(name: str) -> bool:
    return name == STUDY or name.startswith(STUDY + ".")


def study_imports(source: str, module: str) -> list[str]:
    """Where `source`, the text of the module `module` (dotted, e.g. `gspo_jax.run`: it resolves relative
    imports), imports the study or a module of it: `line N: name` each. Covers `import`, `from ...
    import` (relative ones too) and importlib.import_module / __import__ of a literal name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # `from . import x` in a.b.c (or in a/b/__init__.py, module a.b.__init__) is a.b
                base = ".".join([*module.split(".")[: -node.level], *filter(None, [node.module])])
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if func in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
        found += [f"line {node.lineno}: {name}" for name in names if _is_study(name)][:1]
    return found


def test_only_the_study_the_scripts_the_tests_and_the_sweep_files_import_the_study():
    files = checked_files()
    names = {p.relative_to(REPO).as_posix() for p in files}
    assert {"gspo_jax/run.py", "gspo_jax/tasks/__init__.py", "configs/grpo.py", "setup.py"} <= names
    assert not names & {"gspo_jax/study/claims.py", "configs/sweeps/claims.py", "scripts/sweep.py"}
    offenders = []
    for path in files:
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        offenders += [f"{path.relative_to(REPO)} {hit}" for hit in study_imports(path.read_text("utf-8"), module)]
    assert not offenders, f"only {', '.join(MAY_IMPORT)} may import {STUDY}: {offenders}"


@pytest.mark.parametrize(
    "source, module, found",
    [
        ("import gspo_jax.study.sweeps", "gspo_jax.run", True),
        ("import gspo_jax.study as s", "gspo_jax.run", True),
        ("from gspo_jax import config, study", "gspo_jax.run", True),
        ("from gspo_jax.study.report import RunResult", "benchmarks.run.loop", True),
        ("from .study import claims", "gspo_jax.run", True),
        ("from . import study", "gspo_jax.__init__", True),
        ("from ..study import sweeps", "gspo_jax.tasks.arithmetic", True),
        ("def f():\n    import importlib\n    return importlib.import_module('gspo_jax.study.claims')", "x", True),
        ('"""Reads gspo_jax.study.sweeps\' files."""\nimport gspo_jax.config', "gspo_jax.run", False),
        ("from gspo_jax import studies, config", "gspo_jax.run", False),
        ("from . import study", "gspo_jax.tasks.arithmetic", False),  # gspo_jax.tasks.study
    ],
)
def test_the_check_finds_every_form_of_import_and_nothing_else(source, module, found):
    assert bool(study_imports(source, module)) is found

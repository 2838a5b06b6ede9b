"""A Python file of this repository's configs (`configs/<algorithm>.py`, `configs/sweeps/<name>.py`, the
study's claims) loaded by its path: the files are not a package, so they are run as modules of their own."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType


def load_file(path: str | os.PathLike, name: str | None = None) -> ModuleType:
    """The module that running the Python file at `path` defines, under `name` (default: from its stem),
    not added to sys.modules. Whatever the file raises is raised here; a path that is not a Python
    file raises ImportError."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(name or f"_config_file_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_config(spec: str, name: str | None = None):
    """The ConfigDict of a config file given as config_flags takes it, "file.py:arg": the file's
    `get_config(arg)`, or its `get_config()` where no arg is given (the file's own default)."""
    path, _, arg = spec.partition(":")
    module = load_file(path, name)
    return module.get_config(arg) if arg else module.get_config()

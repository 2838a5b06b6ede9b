"""`scripts/train.py` in this process: its flag parsing and `main`, as `app.run` calls them, for the
refusal tests. A child process costs a Python and JAX start-up (~5 s) per case; tests/test_runs.py keeps
one refusal, and the exit-code runs, as the real command in a child process."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import logging
import sys
import warnings
from pathlib import Path

import jax
from absl import flags
from absl import logging as absl_logging

ROOT = Path(__file__).resolve().parents[1]
# What `main` sets process-wide on its way to a run (the persistent cache, log levels): put back after.
_JAX_KEYS = (
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
)
_script = None


@dataclasses.dataclass
class Result:
    returncode: int
    stderr: str


def _train_script():
    global _script
    if _script is None:  # defines the script's flags in absl's FLAGS once per process
        spec = importlib.util.spec_from_file_location("train_script", ROOT / "scripts" / "train.py")
        _script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_script)
    return _script


def train_cli(*args: str) -> Result:
    """`python scripts/train.py ARGS`, in this process: its exit code (0 if `main` returned) and stderr."""
    script = _train_script()
    FLAGS = flags.FLAGS
    # config_flags defines a flag per `--config.KEY` override while parsing, and reads them from sys.argv.
    for name in [n for n in FLAGS if n.startswith("config.")]:
        delattr(FLAGS, name)
    FLAGS.unparse_flags()
    saved_argv, saved_jax = sys.argv, {k: jax.config.values[k] for k in _JAX_KEYS}
    saved_levels = absl_logging.get_verbosity(), logging.getLogger("absl").level
    sys.argv = ["scripts/train.py", *args]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), warnings.catch_warnings():
            # config_flags loads the config file with importlib's deprecated load_module (its warning, not ours)
            warnings.filterwarnings("ignore", "the load_module", DeprecationWarning)
            script.main(script.parse_flags(sys.argv))
        code = 0
    except SystemExit as e:
        code = e.code
    finally:
        sys.argv = saved_argv
        for k, v in saved_jax.items():
            jax.config.update(k, v)
        absl_logging.set_verbosity(saved_levels[0])
        logging.getLogger("absl").setLevel(saved_levels[1])
    return Result(code, err.getvalue())

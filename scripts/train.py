"""The main job: critic-free RL of a sparse-MoE policy on a verifiable task.

    python scripts/train.py --config configs/gspo.py --workdir /tmp/gspo
    python scripts/train.py --config configs/grpo.py:tiny --workdir /tmp/t --config.train.num_iterations=2

Several hosts (JAX's multi-controller runtime): the same command on every host with `--multihost`. On
a TPU VM or pod slice JAX finds the coordinator itself; elsewhere pass `--coordinator_address`,
`--num_processes` and `--process_id` (two CPU processes on one machine, four fake devices each):
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python scripts/train.py --config configs/gspo.py:tiny \
        --workdir /tmp/mh --config.mesh.data=8 --multihost --coordinator_address=localhost:12355 \
        --num_processes=2 --process_id=0     # and --process_id=1 in a second shell
The workdir must be one path that every process sees (orbax writes each process's shards there).

Exit codes (for schedulers and sweeps):
    0    the run finished (or had nothing left to do), plots written; also when a SIGTERM or Ctrl-C
         came during the last iteration
    2    refused before any work, one line on stderr: a bad flag, key or value; a config that differs
         from the one the workdir was started with; a workdir in use by another live run
    75   stopped early by SIGTERM or Ctrl-C at an iteration boundary, checkpoint saved: rerun to resume
    130  a second Ctrl-C: stopped at once; the newest complete checkpoint is intact
A refused run leaves the workdir byte-for-byte as it was. Re-running on a workdir resumes from its
latest good checkpoint.
"""

import logging
import os
import sys
from pathlib import Path

# This project never uses PyTorch: keep transformers' notice about its absence off stderr, so that a
# refused run prints exactly one line.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

if __name__ == "__main__":
    from gspo_jax.host_memory import reexec_with_huge_pages

    reexec_with_huge_pages()  # XLA's big per-call buffers on huge pages; glibc reads this only at start-up

import jax  # noqa: E402
from absl import app, flags  # noqa: E402
from absl import logging as absl_logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from gspo_jax import built as built_lib  # noqa: E402
from gspo_jax import config as config_lib  # noqa: E402
from gspo_jax import multihost  # noqa: E402
from gspo_jax.compiles import use_persistent_cache  # noqa: E402
from gspo_jax.config_files import load_config  # noqa: E402
from gspo_jax.exit_codes import EXIT_INTERRUPTED, EXIT_REFUSED, EXIT_STOPPED  # noqa: E402
from gspo_jax.run import StoppedEarly, train_and_evaluate  # noqa: E402
from gspo_jax.workdir import WorkdirBusy  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "A configs/<algorithm>.py[:size] file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints, metrics.jsonl, TensorBoard and plots go.")
_PROGRESS = flags.DEFINE_boolean(
    "progress", True, "Show progress on stderr: a bar on a terminal, else a line every --log_every iterations."
)
_LOG_EVERY = flags.DEFINE_integer("log_every", 10, "Iterations between progress lines when stderr is not a terminal.")
_MULTIHOST = flags.DEFINE_boolean(
    "multihost", False, "Initialise jax.distributed (one process per host; on a TPU VM JAX finds the coordinator)."
)
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (implies --multihost).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "How many processes (implies --multihost).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index (implies --multihost).")
_COMPILATION_CACHE = flags.DEFINE_string(
    "compilation_cache",
    os.environ.get("JAX_COMPILATION_CACHE_DIR")
    or str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gspo_jax" / "xla"),
    "Keep compiled programs here, so a rerun or the next run of a sweep loads them instead of compiling "
    "(JAX's persistent compilation cache; default: $JAX_COMPILATION_CACHE_DIR if set); '' turns it off.",
)
_ALLOW_CONFIG_CHANGE = flags.DEFINE_boolean(
    "allow_config_change", False, "Continue a workdir with a config that differs from the one it was started with."
)


PREFIX = ""  # "[process i] " once several processes run: every line says which one wrote it


def refuse(message: str) -> None:
    print(f"{PREFIX}error: {message}", file=sys.stderr)
    sys.exit(EXIT_REFUSED)


def parse_flags(argv):
    """absl flag parsing, with every override error reduced to one line and exit code 2."""
    for i, arg in enumerate(argv[1:], 1):
        if arg.startswith("--config.algorithm"):
            refuse("config.algorithm cannot be overridden: it names the config file's algorithm (configs/<name>.py)")
        path = arg.split("=", 1)[1] if arg.startswith("--config=") else None
        if arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        if path is not None and not Path(path.split(":")[0]).is_file():
            refuse(f"config file not found: {path.split(':')[0]}")
    try:
        return flags.FLAGS(argv)
    except (AttributeError, KeyError) as e:  # config_flags' way of saying "no such key"
        refuse(unknown_key(argv) or f"no such config key: {str(e).strip(chr(34))}")
    except (flags.Error, ValueError, TypeError) as e:
        lines = [x.strip() for x in str(e).splitlines() if x.strip()]
        # An error raised inside get_config arrives wrapped in a traceback: its last line says it.
        refuse(lines[-1].split(": ", 1)[-1] if "Traceback" in str(e) else lines[0])


def unknown_key(argv) -> str | None:
    """The first `--config.KEY=` override that is not a key, said in one line with what its section
    holds (a task's section: that task's fields); None if the config file cannot be loaded."""
    spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    spec = spec or next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"), None)
    try:  # as config_flags loads it: the file's get_config(arg) ("file.py:arg"; no arg: its default)
        config = load_config(spec, "_config")
    except Exception:  # noqa: BLE001  (any failure: fall back to config_flags' own words)
        return None
    for arg in argv[1:]:
        if arg.startswith("--config."):
            why = config_lib.missing_key(config, arg.removeprefix("--config.").split("=", 1)[0])
            if why:
                return why
    return None


def start_processes() -> None:
    """`jax.distributed.initialize` when asked; every log line then names its process."""
    explicit = (_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    if not _MULTIHOST.value and all(v is None for v in explicit):
        return
    if any(v is None for v in explicit) and any(v is not None for v in explicit):
        refuse("--coordinator_address, --num_processes and --process_id go together (or none: TPU VMs detect them)")
    if _NUM_PROCESSES.value is not None and not 0 <= _PROCESS_ID.value < _NUM_PROCESSES.value:
        refuse(f"--process_id={_PROCESS_ID.value} must be in [0, --num_processes={_NUM_PROCESSES.value})")
    try:
        multihost.initialize(*explicit)
    except (RuntimeError, ValueError) as e:
        refuse(f"jax.distributed.initialize failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    global PREFIX
    PREFIX = f"[process {jax.process_index()}] "
    absl_logging.get_absl_handler().setFormatter(
        logging.Formatter(PREFIX + "%(levelname).1s%(asctime)s %(name)s] %(message)s")
    )


def main(argv):
    del argv
    if _CONFIG.value is None or not _WORKDIR.value:
        refuse("--config and --workdir are required")
    if _LOG_EVERY.value < 1:
        refuse(f"--log_every={_LOG_EVERY.value}: must be >= 1")
    start_processes()  # before anything touches a JAX backend (built.build does)
    try:
        built = built_lib.build(_CONFIG.value)  # every check, before any work; the run reads only this
    except ValueError as e:
        refuse(str(e))
    if _COMPILATION_CACHE.value:
        try:
            use_persistent_cache(_COMPILATION_CACHE.value)
        except OSError as e:
            refuse(f"--compilation_cache={_COMPILATION_CACHE.value!r} cannot be used: {e.strerror}")
    absl_logging.set_verbosity(absl_logging.INFO)
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every save step at INFO
    try:
        metrics = train_and_evaluate(
            built,
            _WORKDIR.value,
            progress=_PROGRESS.value,
            log_every=_LOG_EVERY.value,
            allow_config_change=_ALLOW_CONFIG_CHANGE.value,
        )
    except (ValueError, WorkdirBusy) as e:  # config drift, workdir in use or not creatable, checkpoint mismatch
        refuse(str(e))
    except StoppedEarly as e:
        print(f"{PREFIX}stopped: {e}", file=sys.stderr)
        sys.exit(EXIT_STOPPED)
    except KeyboardInterrupt:
        print(f"{PREFIX}interrupted: stopped at once; the newest complete checkpoint is intact", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    keys = ("reward_mean", "accuracy", "eval_accuracy", "eval_accuracy_sampled", "clip_frac", "drift_slot_change_rate")
    print(PREFIX + "final: " + ", ".join(f"{k}={metrics[k]:.4f}" for k in keys if k in metrics))


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)

"""The main job: critic-free RL of a sparse-MoE policy on a verifiable task.

    python scripts/train.py --config configs/gspo.py --workdir /tmp/gspo
    python scripts/train.py --config configs/grpo.py:tiny --workdir /tmp/t --config.train.num_iterations=2

A wrong override or an invalid value exits with a one-line error naming the key (exit code 2)
before any work starts and without touching the workdir. Re-running on a workdir with checkpoints
resumes from the latest good one.
"""

import logging
import sys

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from gspo_jax import config as config_lib
from gspo_jax.train import train_and_evaluate

_CONFIG = config_flags.DEFINE_config_file("config", None, "A configs/<algorithm>.py[:size] file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints, metrics.jsonl, TensorBoard and plots go.")
_PROGRESS = flags.DEFINE_boolean("progress", True, "Show a progress bar.")


def parse_flags(argv):
    """absl flag parsing, with every override error reduced to one line and exit code 2."""
    try:
        return flags.FLAGS(argv)
    except (AttributeError, KeyError) as e:  # config_flags' way of saying "no such key"
        print(f"error: no such config key: {str(e).strip(chr(34))}", file=sys.stderr)
    except (flags.Error, ValueError, TypeError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
    sys.exit(2)


def main(argv):
    del argv
    if _CONFIG.value is None or not _WORKDIR.value:
        print("error: --config and --workdir are required", file=sys.stderr)
        sys.exit(2)
    try:
        config_lib.build(_CONFIG.value)  # every check, before any work
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    absl_logging.set_verbosity(absl_logging.INFO)
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every save step at INFO
    metrics = train_and_evaluate(_CONFIG.value, _WORKDIR.value, progress=_PROGRESS.value)
    keys = ("reward_mean", "accuracy", "eval_accuracy", "clip_frac", "drift_slot_change_rate")
    print("final: " + ", ".join(f"{k}={metrics[k]:.4f}" for k in keys if k in metrics))


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)

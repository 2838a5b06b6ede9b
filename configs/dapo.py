"""DAPO: clip-higher (0.2 / 0.28), token-level mean, no KL; dynamic sampling and overlong shaping.

    python scripts/train.py --config configs/dapo.py --workdir /tmp/dapo           # default size
    python scripts/train.py --config configs/dapo.py:tiny --workdir /tmp/dapo_tiny  # tests
Sizes: tiny | default | qwen3_30b_a3b. Override any key with --config.a.b=value.
"""

from gspo_jax.config import base_config


def get_config(arg: str = "default"):
    return base_config("dapo", arg or "default")

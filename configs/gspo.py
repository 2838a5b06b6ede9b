"""GSPO: sequence-level ratio with tiny clip ranges (3e-4 / 4e-4), one loss per sequence.

    python scripts/train.py --config configs/gspo.py --workdir /tmp/gspo           # default size
    python scripts/train.py --config configs/gspo.py:tiny --workdir /tmp/gspo_tiny  # tests
Sizes: tiny | default | qwen3_30b_a3b. Override any key with --config.a.b=value.
"""

from gspo_jax.config import base_config


def get_config(arg: str = "default"):
    return base_config("gspo", arg or "default")

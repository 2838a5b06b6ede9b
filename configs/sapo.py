"""SAPO: a soft sigmoid gate instead of a hard clip (tau_pos 1.0, tau_neg 1.05).

    python scripts/train.py --config configs/sapo.py --workdir /tmp/sapo           # default size
    python scripts/train.py --config configs/sapo.py:tiny --workdir /tmp/sapo_tiny  # tests
Sizes: tiny | default | qwen3_30b_a3b. Override any key with --config.a.b=value.
"""

from gspo_jax.config import base_config


def get_config(arg: str = "default"):
    return base_config("sapo", arg or "default")

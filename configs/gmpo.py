"""GMPO: geometric mean of per-token ratios, clipped in log space to (-0.4, 0.4).

    python scripts/train.py --config configs/gmpo.py --workdir /tmp/gmpo           # default size
    python scripts/train.py --config configs/gmpo.py:tiny --workdir /tmp/gmpo_tiny  # tests
Sizes: tiny | default | qwen3_30b_a3b. Override any key with --config.a.b=value.
"""

from gspo_jax.config import base_config


def get_config(arg: str = "default"):
    return base_config("gmpo", arg or "default")

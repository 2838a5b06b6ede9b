"""CISPO (MiniMax-M1): REINFORCE weighted by a clipped, stop-gradient token ratio.

    python scripts/train.py --config configs/cispo.py --workdir /tmp/cispo           # default size
    python scripts/train.py --config configs/cispo.py:tiny --workdir /tmp/cispo_tiny  # tests
Sizes: tiny | default | qwen3_30b_a3b. Override any key with --config.a.b=value.
"""

from gspo_jax.config import base_config


def get_config(arg: str = "default"):
    return base_config("cispo", arg or "default")

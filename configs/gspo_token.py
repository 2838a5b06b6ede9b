"""GSPO-token: GSPO's sequence ratio with per-token gradients (and per-token advantages).

    python scripts/train.py --config configs/gspo_token.py --workdir /tmp/gspo_token           # default size
    python scripts/train.py --config configs/gspo_token.py:tiny --workdir /tmp/gspo_token_tiny  # tests
Sizes: tiny | default | qwen3_30b_a3b. Override any key with --config.a.b=value.
"""

from gspo_jax.config import base_config


def get_config(arg: str = "default"):
    return base_config("gspo_token", arg or "default")

"""GRPO (DeepSeekMath): token ratio, symmetric clip 0.2, per-sequence token mean, k3 KL with beta 0.04.

    python scripts/train.py --config configs/grpo.py --workdir /tmp/grpo           # default size
    python scripts/train.py --config configs/grpo.py:tiny --workdir /tmp/grpo_tiny  # tests
Sizes: tiny | default | qwen3_30b_a3b. Override any key with --config.a.b=value.
"""

from gspo_jax.config import base_config


def get_config(arg: str = "default"):
    return base_config("grpo", arg or "default")

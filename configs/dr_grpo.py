"""Dr.GRPO: GRPO without std scaling of advantages, token sums divided by the max length.

    python scripts/train.py --config configs/dr_grpo.py --workdir /tmp/dr_grpo           # default size
    python scripts/train.py --config configs/dr_grpo.py:tiny --workdir /tmp/dr_grpo_tiny  # tests
Sizes: tiny | default | qwen3_30b_a3b. Override any key with --config.a.b=value.
"""

from gspo_jax.config import base_config


def get_config(arg: str = "default"):
    return base_config("dr_grpo", arg or "default")

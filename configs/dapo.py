r"""DAPO: Decoupled Clip and Dynamic sAmpling Policy Optimization (Yu et al., 2025).

GRPO's token ratios with clip-higher (ε_low = 0.2, ε_high = 0.28: low-probability tokens may grow
more), a token-level mean over the whole batch (long completions weigh by their length) and no KL.
Outside the loss: dynamic sampling (groups whose rewards are all equal carry no signal; they are
dropped and new prompts drawn, here up to 3 generation rounds, the batch topped up with
zero-weight groups if still short) and soft overlong punishment over the last 4 tokens of the
budget.

    python scripts/train.py --config configs/dapo.py --workdir /tmp/dapo  # default size
    python scripts/train.py --config configs/dapo.py:tiny --workdir /tmp/dapo_tiny  # tiny
    python scripts/train.py --config configs/dapo.py:qwen3_30b_a3b --workdir /tmp/dapo_30b \
        --config.hf_checkpoint=/ckpt/Qwen3-30B-A3B --config.tokenizer_path=/ckpt/Qwen3-30B-A3B

What makes it DAPO (loss, advantage scaling, rollout tricks) is `ALGORITHMS["dapo"]` in
gspo_jax/algorithms.py; every other key, and the sizes, in gspo_jax/config.py. Override any key with
--config.a.b=value, e.g. --config.train.routing_replay=R3 --config.rollout.group_size=16.
"""

from gspo_jax.config import base_config


def get_config(arg: str = "default"):
    """arg: the size, tiny | default | qwen3_30b_a3b."""
    return base_config("dapo", arg or "default")

r"""Dr.GRPO: GRPO Done Right (Liu et al., 2025, Understanding R1-Zero-Like Training).

GRPO without its two length and difficulty biases: advantages are reward minus the group mean,
not divided by the group's std, and each completion's token losses are summed and divided by a
constant — the max completion length (`max_new_tokens`) — instead of by its own length. Clip 0.2,
no KL.

    python scripts/train.py --config configs/dr_grpo.py --workdir /tmp/dr_grpo  # default size
    python scripts/train.py --config configs/dr_grpo.py:tiny --workdir /tmp/dr_grpo_tiny  # tiny
    python scripts/train.py --config configs/dr_grpo.py:qwen3_30b_a3b --workdir /tmp/dr_grpo_30b \
        --config.hf_checkpoint=/ckpt/Qwen3-30B-A3B --config.tokenizer_path=/ckpt/Qwen3-30B-A3B

What makes it Dr.GRPO (loss, advantage scaling, rollout tricks) is `ALGORITHMS["dr_grpo"]` in
gspo_jax/algorithms.py; every other key, and the sizes, in gspo_jax/config.py. Override any key with
--config.a.b=value, e.g. --config.train.routing_replay=R3 --config.rollout.group_size=16.
"""

from gspo_jax.config import base_config


def get_config(arg: str = "default"):
    """arg: the size, tiny | default | qwen3_30b_a3b."""
    return base_config("dr_grpo", arg or "default")

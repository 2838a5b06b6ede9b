r"""CISPO: Clipped IS-weight Policy Optimization (MiniMax-M1, 2025).

REINFORCE weighted by a clipped, stop-gradient token ratio: L = −sg(clip(r, 1 − ε_low, 1 + ε_high))·A·log π.
Unlike the PPO clip, no token ever loses its gradient (rare, high-ratio "fork" tokens keep
learning). Only the upper bound is tuned: ε_high = 0.2, ε_low = 1 (no lower bound). Token-level
mean, no KL.

    python scripts/train.py --config configs/cispo.py --workdir /tmp/cispo  # default size
    python scripts/train.py --config configs/cispo.py:tiny --workdir /tmp/cispo_tiny  # tiny
    python scripts/train.py --config configs/cispo.py:qwen3_30b_a3b --workdir /tmp/cispo_30b \
        --config.hf_checkpoint=/ckpt/Qwen3-30B-A3B --config.tokenizer_path=/ckpt/Qwen3-30B-A3B

What makes it CISPO (loss, advantage scaling, rollout tricks) is `ALGORITHMS["cispo"]` in
gspo_jax/algorithms.py; every other key, and the sizes, in gspo_jax/config.py. Override any key with
--config.a.b=value, e.g. --config.train.routing_replay=R3 --config.rollout.group_size=16.
"""

from gspo_jax.config import base_config


def get_config(arg: str = "default"):
    """arg: the size, tiny | default | qwen3_30b_a3b."""
    return base_config("cispo", arg or "default")

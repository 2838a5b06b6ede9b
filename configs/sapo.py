r"""SAPO: Soft Adaptive Policy Optimization (Qwen team, 2025).

A soft sigmoid gate instead of the hard clip: L = −A·(4/τ)·σ(τ(r − 1)). Its gradient equals the
policy gradient at r = 1 and decays smoothly as r leaves 1, faster for negative advantages
(τ_pos = 1.0, τ_neg = 1.05); nothing is cut off, so the clip fractions stay 0 and
grad_weight_mean shows the damping. Per-sequence token mean, no KL.

    python scripts/train.py --config configs/sapo.py --workdir /tmp/sapo  # default size
    python scripts/train.py --config configs/sapo.py:tiny --workdir /tmp/sapo_tiny  # tiny
    python scripts/train.py --config configs/sapo.py:qwen3_30b_a3b --workdir /tmp/sapo_30b \
        --config.hf_checkpoint=/ckpt/Qwen3-30B-A3B --config.tokenizer_path=/ckpt/Qwen3-30B-A3B

What makes it SAPO (loss, advantage scaling, rollout tricks) is `ALGORITHMS["sapo"]` in
gspo_jax/algorithms.py; every other key, and the sizes, in gspo_jax/config.py. Override any key with
--config.a.b=value, e.g. --config.train.routing_replay=R3 --config.rollout.group_size=16.
"""

from gspo_jax.config import base_config


def get_config(arg: str = "default"):
    """arg: the size, tiny | default | qwen3_30b_a3b."""
    return base_config("sapo", arg or "default")

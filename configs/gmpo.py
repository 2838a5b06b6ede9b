r"""GMPO: Geometric-Mean Policy Optimization (Zhao et al., 2025).

GSPO-like sequence ratio, but each token's log-ratio is first clipped in log space to
(−0.4, 0.4) on the side the advantage's sign selects (a clipped token passes no gradient), then the
ratio is exp of their mean: the geometric mean is robust to outlier token ratios. One loss per
sequence, no KL.

    python scripts/train.py --config configs/gmpo.py --workdir /tmp/gmpo  # default size
    python scripts/train.py --config configs/gmpo.py:tiny --workdir /tmp/gmpo_tiny  # tiny
    python scripts/train.py --config configs/gmpo.py:qwen3_30b_a3b --workdir /tmp/gmpo_30b \
        --config.hf_checkpoint=/ckpt/Qwen3-30B-A3B --config.tokenizer_path=/ckpt/Qwen3-30B-A3B

What makes it GMPO (loss, advantage scaling, rollout tricks) is `ALGORITHMS["gmpo"]` in
gspo_jax/algorithms.py; every other key, and the sizes, in gspo_jax/config.py. Override any key with
--config.a.b=value, e.g. --config.train.routing_replay=R3 --config.rollout.group_size=16.
"""

from gspo_jax.config import base_config


def get_config(arg: str = "default"):
    """arg: the size, tiny | default | qwen3_30b_a3b."""
    return base_config("gmpo", arg or "default")

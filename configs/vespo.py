r"""VESPO: Variational sEquence-level Soft Policy Optimization (Shen et al., 2026, arXiv 2602.10693).

REINFORCE on every token, each sequence's gradient weighted by a gamma kernel of its *unnormalised*
sequence ratio W_i = Π_t π_θ/π_old (no 1/|o|): L = −sg[φ(W_i)]·A_i·log π_θ(y_t),
φ(W) = W^k·e^{λ(1−W)}, with k, λ = 2, 3 for A ≥ 0 and 3, 2 for A < 0 (the paper's code and TRL's
`vespo` loss). φ(1) = 1, so on-policy it is the plain policy gradient; stale sequences are damped
smoothly instead of clipped. Token-level mean, no KL, group-std advantages. A sampler–trainer
correction (loss.is_correction=tis) is folded into W, as in the paper.

    python scripts/train.py --config configs/vespo.py --workdir /tmp/vespo  # default size
    python scripts/train.py --config configs/vespo.py:tiny --workdir /tmp/vespo_tiny  # tiny
    python scripts/train.py --config configs/vespo.py:qwen3_30b_a3b --workdir /tmp/vespo_30b \
        --config.hf_checkpoint=/ckpt/Qwen3-30B-A3B --config.tokenizer_path=/ckpt/Qwen3-30B-A3B

What makes it VESPO (loss, advantage scaling, rollout tricks) is `ALGORITHMS["vespo"]` in
gspo_jax/algorithms.py; every other key, and the sizes, in gspo_jax/config.py. Override any key with
--config.a.b=value, e.g. --config.loss.vespo_lambda_neg=3.0 --config.train.minibatches=4.
"""

from gspo_jax.config import base_config


def get_config(arg: str = "default"):
    """arg: the size, tiny | default | qwen3_30b_a3b."""
    return base_config("vespo", arg or "default")

r"""GSPO-sum: GSPO's sequence ratio without its 1/|o| — the ablation VESPO's critique asks for.

One importance ratio per completion, the plain product of its token ratios
W_i = exp(clamp(Σ_t log π_θ − log π_old)) instead of GSPO's geometric mean, clipped per sequence
with GSPO's own ranges [1 − 3e-4, 1 + 4e-4], one loss per sequence, no KL. Only the 1/|o| differs
from configs/gspo.py: the gradient is W_i·A_i·Σ_t ∇log π_θ (every token of a sequence weighs the
same, long sequences more), and since log W_i = |o_i|·log s_i the same band clips far more often
(watch seq_clip_frac; widen it with --config.loss.eps_low / eps_high).

    python scripts/train.py --config configs/gspo_sum.py --workdir /tmp/gspo_sum  # default size
    python scripts/train.py --config configs/gspo_sum.py:tiny --workdir /tmp/gspo_sum_tiny  # tiny
    python scripts/train.py --config configs/gspo_sum.py:qwen3_30b_a3b --workdir /tmp/gspo_sum_30b \
        --config.hf_checkpoint=/ckpt/Qwen3-30B-A3B --config.tokenizer_path=/ckpt/Qwen3-30B-A3B

What makes it GSPO-sum (loss, advantage scaling, rollout tricks) is `ALGORITHMS["gspo_sum"]` in
gspo_jax/algorithms.py; every other key, and the sizes, in gspo_jax/config.py. Override any key with
--config.a.b=value, e.g. --config.train.routing_replay=R3 --config.rollout.group_size=16.
"""

from gspo_jax.config import base_config


def get_config(arg: str = "default"):
    """arg: the size, tiny | default | qwen3_30b_a3b."""
    return base_config("gspo_sum", arg or "default")

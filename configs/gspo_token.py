r"""GSPO-token: GSPO with per-token gradients (Zheng et al., 2025).

s_{i,t} = sg[s_i]·π_θ(y_t)/sg[π_θ(y_t)]: the value (and clipping) of GSPO's sequence ratio, with
each token's own gradient, so token-level advantages can be used. With one advantage per completion
its value, clipping and gradient equal GSPO's exactly (a test). ε = 3e-4 / 4e-4,
seq_mean_token_mean, no KL.

    python scripts/train.py --config configs/gspo_token.py --workdir /tmp/gspo_token  # default size
    python scripts/train.py --config configs/gspo_token.py:tiny --workdir /tmp/gspo_token_tiny  # tiny
    python scripts/train.py --config configs/gspo_token.py:qwen3_30b_a3b --workdir /tmp/gspo_token_30b \
        --config.hf_checkpoint=/ckpt/Qwen3-30B-A3B --config.tokenizer_path=/ckpt/Qwen3-30B-A3B

What makes it GSPO-token (loss, advantage scaling, rollout tricks) is `ALGORITHMS["gspo_token"]` in
gspo_jax/algorithms.py; every other key, and the sizes, in gspo_jax/config.py. Override any key with
--config.a.b=value, e.g. --config.train.routing_replay=R3 --config.rollout.group_size=16.
"""

from gspo_jax.config import base_config


def get_config(arg: str = "default"):
    """arg: the size, tiny | default | qwen3_30b_a3b."""
    return base_config("gspo_token", arg or "default")

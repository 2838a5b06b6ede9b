r"""GSPO: Group Sequence Policy Optimization (Zheng et al., 2025).

One importance ratio per completion, the geometric mean of its token ratios
s_i = exp(mean_t(log π_θ − log π_old)), clipped per sequence to [1 − 3e-4, 1 + 4e-4] (the paper's
ranges: tiny, because s_i is a length-normalised mean), one loss per sequence, no KL. Every token of
a completion gets the same gradient weight, so a few noisy token ratios — an MoE's routing drift
between π_old and π_θ — cannot dominate the update. Group-std advantages as in GRPO.

    python scripts/train.py --config configs/gspo.py --workdir /tmp/gspo  # default size
    python scripts/train.py --config configs/gspo.py:tiny --workdir /tmp/gspo_tiny  # tiny
    python scripts/train.py --config configs/gspo.py:qwen3_30b_a3b --workdir /tmp/gspo_30b \
        --config.hf_checkpoint=/ckpt/Qwen3-30B-A3B --config.tokenizer_path=/ckpt/Qwen3-30B-A3B \
        --config.task.gsm8k.path=/data/gsm8k/train.parquet --config.task.gsm8k.eval_path=/data/gsm8k/test.jsonl

What makes it GSPO (loss, advantage scaling, rollout tricks) is `ALGORITHMS["gspo"]` in
gspo_jax/algorithms.py; every other key, and the sizes, in gspo_jax/config.py. Override any key with
--config.a.b=value, e.g. --config.train.routing_replay=R3 --config.rollout.group_size=16. The task is
config.task.name, its settings config.task.<name>.*: --config.task.name=countdown --config.prompt_len=40
--config.task.countdown.count=4 (build names the prompt bucket a task needs, and every task's fields).
"""

from gspo_jax.config import base_config


def get_config(arg: str = "default"):
    """arg: the size, tiny | default | qwen3_30b_a3b."""
    return base_config("gspo", arg or "default")

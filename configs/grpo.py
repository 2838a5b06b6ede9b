r"""GRPO: Group Relative Policy Optimization (DeepSeekMath, Shao et al., 2024).

G completions per prompt; each completion's advantage is its reward standardised within the
group (no critic). Per-token importance ratios r = π_θ/π_old under the PPO clip with ε = 0.2 on both
sides, each completion's token losses averaged, then averaged over completions
(seq_mean_token_mean), plus β·KL(π_θ‖π_ref) per token with β = 0.04 and the k3 estimator.

    python scripts/train.py --config configs/grpo.py --workdir /tmp/grpo  # default size
    python scripts/train.py --config configs/grpo.py:tiny --workdir /tmp/grpo_tiny  # tiny
    python scripts/train.py --config configs/grpo.py:qwen3_30b_a3b --workdir /tmp/grpo_30b \
        --config.hf_checkpoint=/ckpt/Qwen3-30B-A3B --config.tokenizer_path=/ckpt/Qwen3-30B-A3B \
        --config.task.gsm8k.path=/data/gsm8k/train.parquet --config.task.gsm8k.eval_path=/data/gsm8k/test.jsonl

What makes it GRPO (loss, advantage scaling, rollout tricks) is `ALGORITHMS["grpo"]` in
gspo_jax/algorithms.py; every other key, and the sizes, in gspo_jax/config.py. Override any key with
--config.a.b=value, e.g. --config.train.routing_replay=R3 --config.rollout.group_size=16. The task is
config.task.name, its settings config.task.<name>.*: --config.task.name=countdown --config.prompt_len=40
--config.task.countdown.count=4 (build names the prompt bucket a task needs, and every task's fields).
"""

from gspo_jax.config import base_config


def get_config(arg: str = "default"):
    """arg: the size, tiny | default | qwen3_30b_a3b."""
    return base_config("grpo", arg or "default")

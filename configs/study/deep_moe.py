r"""The mechanism study: a deeper, finer MoE on long completions, the dials the GSPO and R3 papers say
make routing drift break token-level RL: 8 MoE layers (9 layers, layer 0 dense) of 64 experts top-2 (the
default's active size), sums of five one-digit numbers written out a line per addition (33-39 tokens
a completion, against ~8 for the default task), the sampler in bfloat16, and 4 updates per rollout.

    python scripts/train.py --config configs/study/deep_moe.py:grpo --workdir /tmp/deep_grpo
    python scripts/sweep.py configs/sweeps/mechanism_search.py --workroot results/mechanism_search --parallel 2

The search over this config's dials (depth, experts, completion length, updates per rollout, sampler
precision), with the analysis stated before it ran, is configs/sweeps/mechanism_search.py; what it
found is docs/RESULTS.md's "Where the mechanism bites".

arg: the algorithm (a configs/<name>.py file), e.g. `deep_moe.py:gspo`.
"""

from gspo_jax.config import base_config, task_config


def get_config(arg: str = "grpo"):
    c = base_config(arg or "grpo", "default")
    c.model.update(num_layers=9, num_experts=64, top_k=2)
    # Every demonstration shows its working: "8+6=14\n14+5=19\n19+2=21\n21+3=24\n#### 24".
    c.task = task_config("arithmetic", digits=1, operands=5, ops="+", working=1.0)
    c.max_new_tokens = 44  # the longest worked answer is 39 tokens and EOS: the budget never binds
    # 160 warm-start steps solve 96% of held-out sums (81% sampled), 80 solve 29% (18%): 112 leaves room
    # both to fall and to learn (seed-0 probes, 2026-11-27).
    c.warm_start.steps = 112
    c.rollout.update(num_groups=32, dtype="bfloat16")
    c.train.update(num_iterations=60, minibatches=4, learning_rate=3e-4, end_lr_factor=1.0, eval_every=10)
    return c

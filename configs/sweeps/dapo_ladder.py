"""The DAPO ladder: GRPO, then + overlong filtering, + clip-higher (ε_high 0.28), + token-level loss,
+ dynamic sampling, each rung keeping the ones before (the DAPO paper's ablation: 30 → 36 → 38 → 42
→ 50 on AIME). On countdown with a 14-token budget: its shortest solutions run 8-15 characters, so
a completion that wanders is cut off, and what is done with truncated completions matters. GRPO's KL
term stays on every rung (DAPO drops it; the paper's ladder does not list it as a rung). 5 rungs × 3
seeds: 15 runs.

    python scripts/sweep.py configs/sweeps/dapo_ladder.py --workroot results/dapo_ladder --parallel 2
"""

BASE = "configs/grpo.py"
COMMON = {"task.name": "countdown", "prompt_len": 40, "max_new_tokens": 14, "loss.kl_coef": 0.04}
RUNGS = [
    {},
    {"rollout.overlong_filter": True},
    {"loss.eps_high": 0.28},
    {"loss.aggregation": "token_mean"},
    {"rollout.dynamic_sampling": True, "rollout.max_rounds": 3},
]


def runs():
    ladder = {}
    for rung in RUNGS:
        ladder = {**ladder, **rung}
        for seed in (0, 1, 2):
            yield {**ladder, "seed": seed}

"""The DAPO ladder: GRPO, then + overlong filtering, + clip-higher (ε_high 0.28), + token-level loss,
+ dynamic sampling, each rung keeping the ones before (the DAPO paper's ablation: 30 → 36 → 38 → 42
→ 50 on AIME). GRPO's KL term stays on every rung (DAPO drops it; the paper's ladder does not list it
as a rung). 5 rungs × 3 seeds: 15 runs, 40 minutes at --parallel 2 on the 2-core AVX-512 host.

The task makes length matter: the default arithmetic, half of whose warm-start demonstrations show their
working ("8+6=14\\n14+5=19\\n#### 19", 18-22 tokens, ~93% right when the budget lets them finish) and
half answer at once ("#### 19", 7 tokens, ~40% right), under a 21-token budget that cuts the working of
the 45% of prompts whose sums carry. Probed before the sweep (GRPO, seed 0, 80 iterations): the policy
drops the working within 5 iterations (mean length 13.6 → 9.1 tokens; GRPO's per-sequence mean weighs a
short answer's tokens more) and held-out accuracy goes 46% → 67%; with working on every demonstration
(`working=1.0`) 40-55% of completions were truncated and accuracy stayed at ~50%. Countdown, the first
choice, did not learn at this size (~12-20% held out, flat over 40-80 iterations).

    python scripts/sweep.py configs/sweeps/dapo_ladder.py --workroot results/dapo_ladder --parallel 2
"""

BASE = "configs/grpo.py"
COMMON = {"task.arithmetic.working": 0.5, "max_new_tokens": 21, "train.num_iterations": 100}
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


def CONTROL(arm: dict) -> dict:  # noqa: N802 - added after the sweep ran: each rung against the rung below
    ladder = [{k: v for rung in RUNGS[: i + 1] for k, v in rung.items()} for i in range(len(RUNGS))]
    return ladder[max(ladder.index(arm) - 1, 0)]

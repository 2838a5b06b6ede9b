"""The DAPO ladder redone (the first, configs/sweeps/dapo_ladder.py, read one evaluation at iteration 100
on rising curves, had no soft-overlong rung and no control): GRPO, + overlong filtering, + soft overlong
shaping (L_cache 4 of the 21-token budget, DAPO's 20%), + clip-higher (eps_high 0.28), + the token-level
loss, + dynamic sampling, each rung keeping the ones before; 5 seeds, 200 iterations. The task and budget
are the first ladder's (sums of three digits, half the demonstrations with working, 21 tokens: the budget
cuts the working of sums that carry twice). The control: GRPO, + overlong filtering and the full ladder
under a 32-token budget, which every worked answer fits. 45 runs.

    python scripts/sweep.py configs/sweeps/dapo_ladder_v2.py --workroot results/dapo_ladder_v2 --parallel 2
    python scripts/sweep.py configs/sweeps/dapo_ladder_v2.py --workroot results/dapo_ladder_v2 --report
"""

BASE = "configs/grpo.py"
COMMON = {"task.arithmetic.working": 0.5, "train.num_iterations": 200, "train.eval_every": 20}
BINDING, LOOSE = 21, 32  # completion budgets, tokens: the working of carrying sums is cut / never cut

RUNGS = [
    {},
    {"rollout.overlong_filter": True},
    {"rollout.overlong_cache_len": 4},
    {"loss.eps_high": 0.28},
    {"loss.aggregation": "token_mean"},
    {"rollout.dynamic_sampling": True, "rollout.max_rounds": 3},
]
LADDER = [{k: v for rung in RUNGS[: i + 1] for k, v in rung.items()} for i in range(len(RUNGS))]
CONTROL_RUNGS = (0, 1, len(RUNGS) - 1)  # under the loose budget

ANALYSIS = """\
Stated before the sweep ran (2026-11-27). Outcome: each run's final greedy and sampled held-out accuracy
(the mean of its evaluations at iterations 160, 180 and 200). Each rung is compared with the rung below
it, paired by seed (the control column): a rung helps if the 95% interval of its paired difference is
above 0, hurts if below, and is unresolved otherwise. The paper's ladder holds here if every rung helps
on sampled accuracy. Under the 32-token budget (no completion is cut, so overlong filtering and shaping
do nothing but their side effects) the overlong rung's difference should include 0: if it does and under
21 tokens it is below 0, the cost of filtering is the budget's, not the filter's.\
"""


def CONTROL(arm: dict) -> dict:  # noqa: N802 - the sweep file's CONTROL, as a function: the rung below
    budget = arm["max_new_tokens"]
    rungs = list(range(len(LADDER))) if budget == BINDING else list(CONTROL_RUNGS)
    at = rungs.index(LADDER.index({k: v for k, v in arm.items() if k != "max_new_tokens"}))
    return {"max_new_tokens": budget, **LADDER[rungs[max(at - 1, 0)]]}


def runs():
    out = [{"max_new_tokens": BINDING, **rung, "seed": s} for s in range(5) for rung in LADDER]
    return out + [{"max_new_tokens": LOOSE, **LADDER[i], "seed": s} for s in range(5) for i in CONTROL_RUNGS]

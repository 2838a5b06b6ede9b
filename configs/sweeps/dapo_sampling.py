"""Dynamic sampling at equal rollouts (issue 65, point 5), in the DAPO ladder's regime
(configs/sweeps/dapo_ladder_v2.py: sums of three digits, half the demonstrations with working, a 21-token
budget, 200 iterations): the ladder's fifth rung (overlong filtering and shaping, clip-higher, the
token-level loss) with dynamic sampling (its sixth rung: up to 3 rounds of 32 groups, ~2.0-2.2 drawn per
iteration in its runs, 32 informative groups kept), without it (the fifth rung), and without it drawing
64 groups every iteration, all of them used in the same 2 updates. 5 seeds each, all run here: 15 runs.

    python scripts/sweep.py configs/sweeps/dapo_sampling.py --workroot results/dapo_sampling --parallel 2
    python scripts/sweep.py configs/sweeps/dapo_sampling.py --workroot results/dapo_sampling --report
"""

BASE = "configs/grpo.py"
COMMON = {
    "task.arithmetic.working": 0.5,
    "train.num_iterations": 200,
    "train.eval_every": 20,
    "max_new_tokens": 21,
    "rollout.overlong_filter": True,
    "rollout.overlong_cache_len": 4,
    "loss.eps_high": 0.28,
    "loss.aggregation": "token_mean",
}
ARMS = [
    {"algorithm": "grpo"},  # the fifth rung: the control
    {"algorithm": "grpo", "rollout.dynamic_sampling": True, "rollout.max_rounds": 3},  # the sixth rung
    {"algorithm": "grpo", "rollout.num_groups": 64},  # as many rollouts as dynamic sampling draws, all used
]
CONTROL = {"rollout.dynamic_sampling": None, "rollout.max_rounds": None, "rollout.num_groups": None}
SEEDS = 5

ANALYSIS = """\
Stated before the sweep ran (2026-11-29), as configs/sweeps/dapo_ladder_v2.py reads its runs: a run's
final greedy and sampled held-out accuracy is the mean of its evaluations at iterations 160, 180 and 200;
each arm is paired by seed with the fifth rung (no dynamic sampling, 32 groups), 95% t-interval over 5
seeds; sampled accuracy primary. In the ladder dynamic sampling added +9.1 points over the fifth rung
while drawing about twice the rollouts. The equal-rollouts arm draws 64 groups every iteration (what
dynamic sampling drew on average) and updates on all of them in the same 2 steps per iteration, so each
step holds about as many informative groups as dynamic sampling keeps, and the zero-variance groups
beside them (zero advantage: they add no gradient, only tokens to the token-mean's denominator). Verdict:
- the filter: dynamic sampling's difference is above 0 and the equal-rollouts arm's interval is below it
  (paired, dynamic sampling minus equal rollouts, above 0);
- the sampling: the equal-rollouts arm's difference is above 0 and dynamic sampling minus it includes 0;
- unresolved otherwise, with both intervals.\
"""


def runs():
    return [{**arm, "seed": seed} for seed in range(SEEDS) for arm in ARMS]

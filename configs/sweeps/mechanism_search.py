"""Where routing drift breaks token-level RL for the papers' reason: GRPO without replay in a deeper,
finer MoE on long completions (configs/study/deep_moe.py: 8 MoE layers of 64 experts top-2, 40-token
worked sums, bf16 sampler, 4 updates per rollout), against the same regime made on-policy (one update
per rollout, float32 sampler) and a dense model of the same active size. Stage 1: seed 0 at the
config's lr 3e-4. Stage 2 (added after stage 1's seed 0, see ANALYSIS): seed 0 at lr 1e-4, then seeds
1-4 of the three cells the criterion reads at lr 1e-4, then seeds 1-2 of the closest cell (8 updates per
rollout). 20 runs of 60 iterations.

    python scripts/sweep.py configs/sweeps/mechanism_search.py --workroot results/mechanism_search --parallel 2
    python scripts/sweep.py configs/sweeps/mechanism_search.py --workroot results/mechanism_search --report
"""

BASE = "configs/study/deep_moe.py:{algorithm}"

OFF_POLICY = {"algorithm": "grpo"}  # 4 updates per rollout, bf16 sampler: the study config as it is
MORE_OFF_POLICY = {"algorithm": "grpo", "train.minibatches": 8}
ON_POLICY = {"algorithm": "grpo", "train.minibatches": 1, "rollout.dtype": "float32"}
DENSE = {"algorithm": "grpo", "model.dense_layers": tuple(range(9))}  # MLP width 256 = top-2 × 128: same active size
GENTLE = {"train.learning_rate": 1e-4}  # stage 2

ANALYSIS = """\
Stated before the sweep ran (2026-11-27). Outcome: each run's final sampled held-out accuracy (the mean
of its evaluations at iterations 40, 50 and 60) minus its step-0 (warm-start) sampled accuracy; greedy
alongside. A run collapsed if that is below -10 points (gspo_jax/analysis.py; counts also at 5 and 20).
The mechanism bites in this regime if GRPO off-policy (`grpo`) collapses in >= 4 of 5 seeds while the
on-policy control (`grpo-minibatches=1-dtype=float32`) and the dense model (`grpo-dense_layers=...`)
each collapse in <= 1 of 5, and the paired difference off-policy - on-policy has a 95% interval below 0.
If it does not, the report states the closest cell and the paired difference 5 seeds could detect: a
95% interval excludes 0 when the mean difference exceeds t(4) * sd / sqrt(5) = 1.24 sd of the seeds'
differences. Seeds 0-1 of `grpo-minibatches=8` and `gspo` are leads (more off-policyness; GSPO in the
same cell), not part of the criterion.

Amended 2026-11-27, after stage 1's seed 0 (before any other run): at lr 3e-4 the on-policy control fell
as the off-policy cell did (sampled 37% -> 15-19% by iteration 10-40, against 37% -> 19-21%), so the
step, not the routing, breaks both there, as in the earlier regimes. Stage 2 repeats the cells at lr
1e-4, and the criterion above is read at that rate (cells `grpo-learning_rate=0.0001`, its on-policy
and dense versions), with seeds 1-4 there; stage 1's remaining cells run last, as leads.

Amended 2026-11-27 (third session), with 12 runs done and seeds 3 of the criterion's cells under way:
the search has spent its ~4 CPU-hours (issue 52). By the rule above no cell can meet the criterion any
more (`grpo-learning_rate=0.0001` collapsed in 0 of 3 seeds, so at most 2 of 5). The criterion's cells
still finish their 5 seeds, for the paired difference off-policy - on-policy and its interval; then
seeds 1-2 of 8 updates per rollout at lr 1e-4, the closest cell at seed 0 (sampled -7.2, greedy -21.0),
for its interval. Stage 1's leads at lr 3e-4 are dropped: there the step breaks on-policy runs too.\
"""

# Paired differences against the on-policy control (arms it does not map onto have none).
CONTROL = {"train.minibatches": 1, "rollout.dtype": "float32"}


def runs():
    out = [{**cell, "seed": 0} for cell in (OFF_POLICY, ON_POLICY)]  # stage 1, the criterion's pair
    gentle = [{**cell, **GENTLE} for cell in (OFF_POLICY, ON_POLICY, MORE_OFF_POLICY, DENSE)]
    out += [{**cell, "seed": 0} for cell in gentle]  # stage 2, seed 0
    out += [{**cell, "seed": s} for s in (1, 2, 3, 4) for cell in gentle if cell is not gentle[2]]
    return out + [{**gentle[2], "seed": s} for s in (1, 2)]  # the closest cell (third amendment)

"""Where routing drift breaks token-level RL for the papers' reason: GRPO without replay in a deeper,
finer MoE on long completions (configs/study/deep_moe.py: 8 MoE layers of 64 experts top-2, 40-token
worked sums, bf16 sampler, 4 updates per rollout), against the same regime made on-policy (one update
per rollout, float32 sampler) and a dense model of the same active size. Seed 0 of every cell first,
then seeds 1-4 of the three cells the criterion reads. 19 runs of 60 iterations.

    python scripts/sweep.py configs/sweeps/mechanism_search.py --workroot results/mechanism_search --parallel 2
    python scripts/sweep.py configs/sweeps/mechanism_search.py --workroot results/mechanism_search --report
"""

BASE = "configs/study/deep_moe.py:{algorithm}"

OFF_POLICY = {"algorithm": "grpo"}  # 4 updates per rollout, bf16 sampler: the study config as it is
MORE_OFF_POLICY = {"algorithm": "grpo", "train.minibatches": 8}
ON_POLICY = {"algorithm": "grpo", "train.minibatches": 1, "rollout.dtype": "float32"}
DENSE = {"algorithm": "grpo", "model.dense_layers": tuple(range(9))}  # MLP width 256 = top-2 × 128: same active size
GSPO = {"algorithm": "gspo"}

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
same cell), not part of the criterion.\
"""

# Paired differences against the on-policy control (arms it does not map onto have none).
CONTROL = {"train.minibatches": 1, "rollout.dtype": "float32"}


def runs():
    out = [{**cell, "seed": 0} for cell in (OFF_POLICY, ON_POLICY, DENSE, MORE_OFF_POLICY, GSPO)]
    out += [{**cell, "seed": 1} for cell in (OFF_POLICY, ON_POLICY, DENSE, MORE_OFF_POLICY, GSPO)]
    return out + [{**cell, "seed": s} for s in (2, 3, 4) for cell in (OFF_POLICY, ON_POLICY, DENSE)]

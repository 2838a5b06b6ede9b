"""The mechanism search's on-policy control split into its two changes (issue 65, point 4): in its cell
(configs/study/deep_moe.py at lr 1e-4), GRPO at 4 updates per rollout with the bf16 sampler (the study's
off-policy cell), at 1 update with a float32 sampler (its on-policy control), and the two cells between:
1 update with the bf16 sampler, 4 updates with a float32 sampler. A 2 x 2 of updates per rollout and
sampler precision, 5 seeds each, all run here: 20 runs, seed by seed.

    python scripts/sweep.py configs/sweeps/on_policy_split.py --workroot results/on_policy_split --parallel 2
    python scripts/sweep.py configs/sweeps/on_policy_split.py --workroot results/on_policy_split --report
"""

BASE = "configs/study/deep_moe.py:{algorithm}"
COMMON = {"train.learning_rate": 1e-4}  # the mechanism search's stage-2 rate (its GENTLE)

CELLS = [
    {"algorithm": "grpo", "train.minibatches": 4, "rollout.dtype": "bfloat16"},  # off-policy: the control
    {"algorithm": "grpo", "train.minibatches": 1, "rollout.dtype": "bfloat16"},  # on-policy updates only
    {"algorithm": "grpo", "train.minibatches": 4, "rollout.dtype": "float32"},  # a float32 sampler only
    {"algorithm": "grpo", "train.minibatches": 1, "rollout.dtype": "float32"},  # both: the search's control
]
CONTROL = {"train.minibatches": 4, "rollout.dtype": "bfloat16"}
SEEDS = 5

ANALYSIS = """\
Stated before the sweep ran (2026-11-29), by gspo_jax/study/analysis.py's rule: a run's final sampled and
greedy accuracy is the mean of its evaluations at iterations 40, 50 and 60; each cell is paired by seed
with the off-policy cell (4 updates, bf16 sampler), 95% t-interval over 5 seeds; sampled accuracy primary.
The mechanism search found the on-policy control ending above the off-policy cell (paired sampled
+4.6 +- 3.1, 5 seeds). Here: off-policyness alone is 1 update / bf16 minus 4 updates / bf16; the sampler's
mismatch alone is 4 updates / float32 minus 4 updates / bf16; both together is the search's difference,
rerun. Each effect is "there" if its interval is above 0, "absent" if it includes 0 and the interval's
half-width is below 3 points (what 5 seeds could detect), unresolved otherwise. Their sum against the
both-changed cell's difference is reported as the interaction, with its interval from the same pairs.\
"""


def runs():
    return [{**cell, "seed": seed} for seed in range(SEEDS) for cell in CELLS]

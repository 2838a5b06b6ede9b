"""Routing drift against the MoE's shape and the update schedule, one axis at a time from the study
point (configs/study/moe_drift.py: 4 layers, 8 experts top-2, 8 minibatches per rollout): depth 2 / 4 /
8 / 16 layers; 8 / 32 / 64 experts at the same active size (top-2 of 128-wide experts: each token's
expert compute is fixed, only the choice widens); 1 / 2 / 4 / 8 minibatches per rollout. GRPO and
GSPO, 3 seeds: 54 runs of 20 iterations. Drift is compared over the first iterations, where the
rate is constant and the policy has not yet collapsed; 20 (not 60) keeps the sweep inside 2 hours
on 2 cores with the 16-layer and 64-expert arms and their warm starts.

    python scripts/sweep.py configs/sweeps/drift_architecture.py --workroot results/drift_architecture --parallel 2
"""

BASE = "configs/study/moe_drift.py:{algorithm}"
COMMON = {"train.num_iterations": 20}
AXES = {
    "model.num_layers": [2, 4, 8, 16],
    "model.num_experts": [8, 32, 64],
    "train.minibatches": [1, 2, 4, 8],
}
CENTER = {"model.num_layers": 4, "model.num_experts": 8, "train.minibatches": 8}  # the study config's


def runs():
    for algorithm in ("grpo", "gspo"):
        arms = [{}]  # the study point itself, once
        arms += [{key: v} for key, values in AXES.items() for v in values if v != CENTER[key]]
        for arm in arms:
            for seed in (0, 1, 2):
                yield {"algorithm": algorithm, **arm, "seed": seed}


# Added after the sweep ran (gspo_jax/study/analysis.py's rule): each arm against the study point of its objective.
CONTROL = dict.fromkeys(AXES)  # every axis key unset: the centre arm

"""Dense against MoE at the same active parameter count, in the high-drift regime: the study's MoE
(4 layers, layer 0 dense, 8 experts top-2 of width 128) against the same model with every layer dense
(an MLP of width 256 = 2 × 128: the same weights per token, no router to drift). GRPO and GSPO, 3
seeds: 12 runs. If GRPO's trouble is routing, the dense arm should not have it.

    python scripts/sweep.py configs/sweeps/dense_vs_moe.py --workroot results/dense_vs_moe --parallel 2
"""

from gspo_jax.study.sweeps import grid

BASE = "configs/study/moe_drift.py:{algorithm}"


def runs():
    return grid({"model.dense_layers": [(0,), (0, 1, 2, 3)]}, algorithm=["grpo", "gspo"], seed=[0, 1, 2])


# Added after the sweep ran (gspo_jax/study/analysis.py's rule): the dense arm against the MoE of its objective.
CONTROL = {"model.dense_layers": (0,)}

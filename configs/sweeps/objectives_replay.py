"""Objectives × routing replay in the high-drift regime (configs/study/moe_drift.py): GRPO, DAPO, GSPO,
GSPO-token, CISPO, SAPO, GMPO, VESPO and PPO (the critic baseline), each with no replay, R2 (π_old's
routing, recomputed by the trainer) and R3 (the bf16 sampler's routing), over 3 seeds: 81 runs.
The report's arms answer: which objectives collapse when a tenth of the expert slots move per
iteration, and does replaying routing rescue them (the R3 paper's claim for GRPO), as GSPO claims to
need no replay.

    python scripts/sweep.py configs/sweeps/objectives_replay.py --workroot results/objectives_replay --parallel 2
    python scripts/sweep.py configs/sweeps/objectives_replay.py --workroot results/objectives_replay --report
"""

from gspo_jax.study.sweeps import grid

BASE = "configs/study/moe_drift.py:{algorithm}"
OBJECTIVES = ["grpo", "dapo", "gspo", "gspo_token", "cispo", "sapo", "gmpo", "vespo", "ppo"]


def runs():
    return grid({"train.routing_replay": ["none", "R2", "R3"]}, algorithm=OBJECTIVES, seed=[0, 1, 2])


# Added after the sweep ran (gspo_jax/study/analysis.py's rule): each replay arm against its objective without.
CONTROL = {"train.routing_replay": "none"}

"""GRPO and GSPO, each without routing replay, with R2 (π_old's routing, recomputed by the trainer) and
with R3 (the bf16 sampler's routing), over 3 seeds, in the regime where one iteration moves ~10% of
the expert slots and the policy still learns (configs/study/many_experts.py): 18 runs. Does the
policy learn in every seed, held out, greedy and sampled; does GRPO need replay there and GSPO not
(the GSPO paper's claim); how do drift, clipping and mismatch differ. ~65 minutes at --parallel 2 on
2 cores.

    python scripts/sweep.py configs/sweeps/many_experts.py --workroot results/many_experts --parallel 2
    python scripts/sweep.py configs/sweeps/many_experts.py --workroot results/many_experts --report
"""

from gspo_jax.study.sweeps import grid

BASE = "configs/study/many_experts.py:{algorithm}"


def runs():
    return grid({"train.routing_replay": ["none", "R2", "R3"]}, algorithm=["grpo", "gspo"], seed=[0, 1, 2])


# Added after the sweep ran (with gspo_jax/study/analysis.py's rule): each replay arm against no replay.
CONTROL = {"train.routing_replay": "none"}

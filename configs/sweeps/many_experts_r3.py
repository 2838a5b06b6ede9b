"""The `many_experts` sweep's R3 arms (GRPO and GSPO × seeds 0–2: 6 runs) rerun after R3 was made
consistent (π_old scored under the sampler's routing, the routing the update replays; issue 51). The
committed `results/many_experts/` R3 runs scored π_old under the trainer's live routing, so their ratio
was not 1 at θ_old; docs/RESULTS.md puts the two side by side against the same no-replay and R2 arms.
~30 minutes at --parallel 2 on 2 cores.

    python scripts/sweep.py configs/sweeps/many_experts_r3.py --workroot results/many_experts_r3 --parallel 2
    python scripts/sweep.py configs/sweeps/many_experts_r3.py --workroot results/many_experts_r3 --report
"""

from gspo_jax.study.sweeps import grid

BASE = "configs/study/many_experts.py:{algorithm}"


def runs():
    return grid({"train.routing_replay": ["R3"]}, algorithm=["grpo", "gspo"], seed=[0, 1, 2])

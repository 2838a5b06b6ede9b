"""Does bounded staleness cost anything here? (issue 66, point 6): the README's main job (configs/<algorithm>.py
at the default size) with `rollout.staleness` k = 0, 1, 2 and 4, for GRPO and GSPO, 5 seeds each: 40 runs,
seed by seed. AReaL (arXiv 2505.24298) and PipelineRL report that a lag of 1-2 policy versions costs
nothing; on a sparse MoE policy each version also moves the routing, which `stale_*` measures.

    python scripts/sweep.py configs/sweeps/staleness.py --workroot results/staleness --parallel 2
    python scripts/sweep.py configs/sweeps/staleness.py --workroot results/staleness --report
"""

BASE = "configs/{algorithm}.py"
ALGORITHMS = ("grpo", "gspo")
LAGS = (0, 1, 2, 4)
CONTROL = {"rollout.staleness": 0}
SEEDS = 5

ANALYSIS = """\
Stated before the sweep ran (2026-11-29), by gspo_jax/study/analysis.py's rule: a run's final sampled and
greedy accuracy is the mean of its last three evaluations (iterations 130, 140 and 150); within each
algorithm every lag is paired by seed with k = 0, 95% t-interval over 5 seeds; sampled accuracy primary.
A lag "costs nothing" if its interval lies inside [-3, +3] points (the equivalence margin: what 5 seeds
of the main job can resolve), "costs" if the interval lies below 0, and is unresolved otherwise; the
claim "bounded staleness of 1-2 costs nothing" holds here if k = 1 and k = 2 both cost nothing for both
algorithms. The routing drift each lag adds is the run's mean over iterations of stale_router_flip_rate
(the share of router choices today's policy makes differently from the behaviour policy's on its batch)
and stale_logratio_routing_abs, reported per lag with the same interval (k = 0 has none: it is on-policy).
Nothing here measures time: these runs share one mesh (mesh.rollout_devices = 0).\
"""


def runs():
    return [{"algorithm": a, "rollout.staleness": k, "seed": s} for s in range(SEEDS) for a in ALGORITHMS for k in LAGS]

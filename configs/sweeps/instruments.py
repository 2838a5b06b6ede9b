"""Every MoE-RL instrument beside GRPO and GSPO, without and with replay, in the regime where 64 experts
move ~10% of the routed slots per iteration and the policy learns (configs/study/many_experts.py: bf16
sampler, 2 minibatches per rollout): no replay, R2, R3 (consistent: π_old under the replayed routing),
R3W (weight replay), RSPO's router-shift ratio, IcePop (GRPO: token ratios; GSPO's sequence ratio has
no token to mask), the geometric-mean sequence mask, DeepSeek-V3.2's off-policy sequence masking, a
frozen router without load-balancing and z losses (NeMo-RL's RL setting), and bounded staleness 1.
10 arms × 2 objectives × 3 seeds less GSPO's IcePop = 57 runs; ~3.5 hours at --parallel 2 on 2 cores (the many_experts
runs took 400–760 s each). Ready for the study (issue 52), not yet run.

The analysis, stated before the sweep runs, is gspo_jax/study/analysis.py's rule: a run's final accuracy,
greedy and sampled, is the mean of its last 3 held-out evaluations; each arm gives mean ± sd and a 95%
interval over seeds, and its paired difference per seed to the same objective without any instrument
(CONTROL), with its 95% interval.

    python scripts/sweep.py configs/sweeps/instruments.py --workroot results/instruments --parallel 2
    python scripts/sweep.py configs/sweeps/instruments.py --workroot results/instruments --report
"""

BASE = "configs/study/many_experts.py:{algorithm}"

# Each arm's overrides, by objective (None: the arm does not apply to that objective).
ARMS = {
    "none": {},
    "R2": {"train.routing_replay": "R2"},
    "R3": {"train.routing_replay": "R3"},
    "R3W": {"train.routing_replay": "R3W"},
    "rspo": {"loss.router_shift": True},
    "icepop": {"loss.icepop": True},  # the peers' band, [0.5, 5]
    "geo_mask": {"loss.geo_mask_delta": 0.01},  # SkyRL's recommended [0.99, 1.01]
    "off_policy_mask": {"loss.off_policy_mask_delta": 0.01},
    "frozen_router": {"train.freeze_router": True, "model.lb_loss_coef": 0.0, "model.z_loss_coef": 0.0},
    "staleness_1": {"rollout.staleness": 1},
}
SEQUENCE_LEVEL = {"icepop"}  # arms a sequence-level ratio (GSPO) refuses


def CONTROL(arm: dict) -> dict:  # noqa: N802 - the sweep file's CONTROL: the objective with nothing added
    return {"algorithm": arm["algorithm"]}


def runs():
    for name, arm in ARMS.items():
        for algorithm in ("grpo", "gspo"):
            if algorithm == "gspo" and name in SEQUENCE_LEVEL:
                continue
            for seed in (0, 1, 2):
                yield {"algorithm": algorithm, **arm, "seed": seed}

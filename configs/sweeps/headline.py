"""The headline grid in the mechanism study's regime (configs/study/deep_moe.py: 8 MoE layers of 64
experts top-2, 33-39-token completions, bf16 sampler, 4 updates per rollout): GRPO and GSPO x no replay,
R2, consistent R3 (5 seeds each), weight replay R3W, RSPO's router-shift ratio, IcePop (GRPO: token
ratios) and the geometric-mean sequence mask (3 seeds each). 2 x (3 x 5 + 3 x 3) + 3 = 51 runs. To run
once configs/sweeps/mechanism_search.py has said whether this regime is where the mechanism bites (or
is the closest cell): if the search moves the regime, the study config moves and this grid with it.

    python scripts/sweep.py configs/sweeps/headline.py --workroot results/headline --parallel 2
    python scripts/sweep.py configs/sweeps/headline.py --workroot results/headline --report
"""

BASE = "configs/study/deep_moe.py:{algorithm}"

HEADLINE = {"none": {}, "R2": {"train.routing_replay": "R2"}, "R3": {"train.routing_replay": "R3"}}
INSTRUMENTS = {
    "R3W": {"train.routing_replay": "R3W"},
    "rspo": {"loss.router_shift": True},
    "icepop": {"loss.icepop": True},  # GRPO only: GSPO's sequence ratio has no token to mask
    "geo_mask": {"loss.geo_mask_delta": 0.01},
}

ANALYSIS = """\
Stated before the sweep ran (2026-11-27), by gspo_jax/analysis.py's rule: a run's final sampled and
greedy accuracy is the mean of its last 3 evaluations (iterations 40, 50, 60). Each arm is compared
with the same objective without replay or instrument (CONTROL), paired by seed, with a 95% t-interval.
The claims this grid tests, each with its verdict and interval in docs/RESULTS.md's claims table:
GRPO needs replay and GSPO does not (the GSPO paper): GRPO's R2 and R3 differences above 0 and GSPO's
including 0; R3 stops GRPO's collapse (the R3 paper): GRPO without replay collapses in most seeds and
with R3 in few, its paired difference above 0; and whether R3W, RSPO, IcePop or the geometric mask do
what replay does. Sampled accuracy is primary; greedy is reported beside it.\
"""


def CONTROL(arm: dict) -> dict:  # noqa: N802 - the sweep file's CONTROL: the objective with nothing added
    return {"algorithm": arm["algorithm"]}


def runs():
    out = []
    for seed in range(5):
        out += [{"algorithm": a, **arm, "seed": seed} for arm in HEADLINE.values() for a in ("grpo", "gspo")]
    for seed in range(3):
        for name, arm in INSTRUMENTS.items():
            out += [{"algorithm": a, **arm, "seed": seed} for a in ("grpo", "gspo") if (a, name) != ("gspo", "icepop")]
    return out

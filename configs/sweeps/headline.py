"""The headline grid in the mechanism study's regime (configs/study/deep_moe.py: 8 MoE layers of 64
experts top-2, 33-39-token completions, bf16 sampler; 8 updates per rollout here): GRPO and GSPO x no replay,
R2, consistent R3 (5 seeds each), weight replay R3W, RSPO's router-shift ratio, IcePop (GRPO: token
ratios) and the geometric-mean sequence mask (3 seeds each), at lr 1e-4 (COMMON, the search's closest
cell). 2 x (3 x 5 + 3 x 3) + 3 = 51 runs. Run after configs/sweeps/mechanism_search.py's 8-update cell
had 3 seeds (ANALYSIS's amendment set 8 updates per rollout from them).

    python scripts/sweep.py configs/sweeps/headline.py --workroot results/headline --parallel 2
    python scripts/sweep.py configs/sweeps/headline.py --workroot results/headline --report
"""

BASE = "configs/study/deep_moe.py:{algorithm}"
# The search's closest cell (configs/sweeps/mechanism_search.py): at the config's lr 3e-4 the step breaks
# on-policy runs too, so every run here takes lr 1e-4. Updates per rollout: 4 or 8, by the rule in
# ANALYSIS's amendment, set before any run of this grid.
COMMON = {"train.learning_rate": 1e-4, "train.minibatches": 8}

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
what replay does. Sampled accuracy is primary; greedy is reported beside it.

Amended 2026-11-27 (third session), before any run of this grid: the regime is the search's closest cell,
at lr 1e-4 (COMMON), where the search found off-policy GRPO (4 updates per rollout) ending below the
on-policy control without collapsing (paired sampled -4.6 +- 3.1, 5 seeds). The updates per rollout are
chosen by this rule once the search's 8-update cell has 3 seeds: 8 if its mean sampled gain is below
the 4-update cell's and its paired difference to on-policy has a 95% interval below 0, else 4.
Applied the same day, before any run: the 8-update cell's 3 seeds gained -5.8 +- 1.3 sampled (the
4-update cell -2.5 +- 1.0), paired to on-policy -6.6 +- 1.4 (-10.1 to -3.0): 8 updates per rollout.\
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

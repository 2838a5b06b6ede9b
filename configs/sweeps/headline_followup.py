"""The headline cell's open questions (issue 65, points 3 and 6), in the headline grid's regime
(configs/sweeps/headline.py: configs/study/deep_moe.py at lr 1e-4, 8 updates per rollout):
- why GSPO collapsed in 5 of 5 seeds there: GSPO with its clip range 10x and 30x the paper's, and GSPO
  at 1, 2 and 4 updates per rollout, against GSPO as the grid ran it (rerun here: every pair shares
  this code);
- RSPO as published: GMPO and GMPO + the router-shift ratio, and GSPO + the router-shift ratio.
5 seeds each, 9 arms: 45 runs, seed by seed so that a partial sweep is balanced.

    python scripts/sweep.py configs/sweeps/headline_followup.py --workroot results/headline_followup --parallel 2
    python scripts/sweep.py configs/sweeps/headline_followup.py --workroot results/headline_followup --report
"""

BASE = "configs/study/deep_moe.py:{algorithm}"
COMMON = {"train.learning_rate": 1e-4}  # the headline grid's rate; its 8 updates per rollout are per arm

EIGHT = {"train.minibatches": 8}  # the headline grid's updates per rollout
GSPO_ARMS = [
    {"algorithm": "gspo", **EIGHT},  # the control: GSPO as the headline grid ran it
    {"algorithm": "gspo", **EIGHT, "loss.eps_low": 3e-3, "loss.eps_high": 4e-3},  # 10x the paper's range
    {"algorithm": "gspo", **EIGHT, "loss.eps_low": 9e-3, "loss.eps_high": 1.2e-2},  # 30x
    {"algorithm": "gspo", "train.minibatches": 1},  # on-policy: every ratio is 1, nothing is clipped
    {"algorithm": "gspo", "train.minibatches": 2},
    {"algorithm": "gspo", "train.minibatches": 4},
]
RSPO_ARMS = [
    {"algorithm": "gmpo", **EIGHT},
    {"algorithm": "gmpo", **EIGHT, "loss.router_shift": True},  # RSPO as the paper's abstract names it
    {"algorithm": "gspo", **EIGHT, "loss.router_shift": True},
]
SEEDS = 5

ANALYSIS = """\
Stated before the sweep ran (2026-11-29), by gspo_jax/study/analysis.py's rule, as the headline grid reads
its runs: a run's final sampled and greedy accuracy is the mean of its evaluations at iterations 40, 50
and 60; a run collapsed if its final sampled accuracy is more than 10 points below its step-0 accuracy.
Each arm is paired by seed with its control (CONTROL: GSPO at 8 updates per rollout for every GSPO arm,
GMPO for GMPO + router shift), 95% t-interval over the 5 seeds. Sampled accuracy is primary.

GSPO's collapse (point 3). In the headline grid GSPO at the paper's clip range (3e-4, 4e-4) clipped 27-42%
of completions per update (sequence ratios 0.88-1.06 against a band of +-0.04%: its log-ratio is a mean
over ~36 tokens here, not ~1,000). The two wider ranges bracket that spread: 10x (+-0.3-0.4%) and 30x
(+-0.9-1.2%). Verdict, in this order:
- clip range: the control collapses in >= 4 of 5 seeds again, and a wider range collapses in <= 1 of 5
  with a paired difference above 0;
- sequence ratio off-policy: no width does that, but 1 or 2 updates per rollout do (ratios closer to 1);
- neither (GSPO's objective in this cell, or a defect): 1 update per rollout (on-policy, every ratio 1,
  nothing clipped) collapses too. tests/test_train.py's
  test_each_minibatch_of_an_update_equals_an_independent_computation checks the multi-minibatch path's
  ratios, clipping and loss against numpy, so a defect must lie outside what it covers.
If the rerun control does not collapse in >= 4 of 5 seeds, the collapse was not this code's behaviour at
these seeds (the expert dispatch changed its float32 summation order since, issue 65 point 1), and the
verdict says so instead.

RSPO as published (point 6): GMPO + router shift against GMPO, and GSPO + router shift against GSPO, each
paired; RSPO helps here if the interval is above 0, hurts if below, unresolved otherwise. The headline
grid's 3 seeds of GSPO + router shift (+4.7) are the lead this tests at 5 seeds. γ is taken on the full
softmax (`loss.router_shift_probs="softmax"`, the paper's equation).\
"""


def CONTROL(arm: dict) -> dict:  # noqa: N802 - the sweep file's CONTROL, as a function of an arm
    if arm["algorithm"] == "gmpo":
        return {"algorithm": "gmpo", **EIGHT}
    return dict(GSPO_ARMS[0])


def runs():
    return [{**arm, "seed": seed} for seed in range(SEEDS) for arm in GSPO_ARMS + RSPO_ARMS]

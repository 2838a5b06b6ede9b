"""The claims table's headline rows (configs/sweeps/claims.py, read by gspo_jax/study/claims.py) on synthetic
runs: every number over the seeds all their arms share, "Pending" until the grid has its pre-registered seeds,
then the verdict the intervals give. The rows' older sweeps are read from the committed results/."""

import shutil
from pathlib import Path

import pytest

from gspo_jax.config_files import load_file
from gspo_jax.study import analysis, claims, drift_law, report, sweeps
from gspo_jax.study.report import ACCURACY, SAMPLED, RunResult

ROOT = Path(__file__).resolve().parents[1]
study = load_file(ROOT / "configs" / "sweeps" / "claims.py")  # the study's claims: its arms, sweeps and rows
ARMS = [f"{o}{s}" for o in ("grpo", "gspo") for s in ("", "-replay=R2", "-replay=R3")]


def run(arm: str, seed: int, start: float, final: float) -> RunResult:
    """A finished run whose held-out accuracy (greedy and sampled alike) goes from `start` to `final`."""
    r = sweeps.Run(index=0, name=f"{arm}-seed={seed}", arm=arm, config="c", overrides={sweeps.SEED: seed})
    points = ((0, start), (10, final), (20, final), (30, final))
    records = [{"step": s, ACCURACY: a, SAMPLED: a, "seq_clip_frac": 0.3, "clip_frac": 0.01} for s, a in points]
    return RunResult(r, "done", records)


class Synthetic(claims.Results):
    """The committed results, with the headline grid replaced by `grid` (arm -> seed -> (start, final))."""

    def __init__(self, grid: dict[str, dict[int, tuple[float, float]]]):
        super().__init__(ROOT)
        self.grid = grid

    def arms(self, name):
        if name != study.HEADLINE:
            return super().arms(name)
        return {a: [run(a, s, *v) for s, v in seeds.items()] for a, seeds in self.grid.items() if seeds}


def grid(seeds: int, final: dict[str, float], start: float = 0.5) -> dict:
    """Every arm of `final` over `seeds` seeds, its final accuracy `final[arm]` plus a seed's own wobble."""
    return {a: {s: (start, f + 0.01 * ((s * 7 + len(a)) % 5)) for s in range(seeds)} for a, f in final.items()}


def test_every_number_is_over_the_seeds_all_arms_share_and_the_verdict_waits_for_five():
    g = grid(3, dict.fromkeys(ARMS, 0.5))
    del g["grpo-replay=R3"][2]  # seeds 0 and 1 only
    g["grpo"][2] = (0.5, 0.0)  # seed 2 of GRPO fell 50 points: not in a number while R3 lacks the seed
    here, verdict, limits = study._replay_needed(Synthetic(g))
    assert "2 seeds)" in here and verdict == "Pending: the headline grid has 2 of 5 seeds"
    two = claims.iv(claims.gain([run("grpo", s, *g["grpo"][s]) for s in (0, 1)]))
    assert f"without replay GRPO {two.text()}," in here and two.n == 2
    assert limits.startswith("2 of 5 seeds in the headline grid")
    g["gspo"] = {}  # an arm with no finished run: nothing of the grid is reported yet
    here, verdict, _ = study._replay_needed(Synthetic(g))
    assert not here.startswith("Headline") and verdict == "Pending: the headline grid has 0 of 5 seeds"


@pytest.mark.parametrize(
    "grpo_replay, gspo_replay, want",
    [
        (0.7, 0.5, "Reproduced: replay helps GRPO and makes no difference to GSPO"),
        (0.5, 0.5, "Not reproduced: GRPO with R2 includes 0, GRPO with R3 includes 0, GSPO with R2 includes 0"),
        (0.7, 0.3, "Not reproduced: GRPO with R2 above 0, GRPO with R3 above 0, GSPO with R2 below 0"),
    ],
)
def test_with_five_seeds_the_replay_verdict_follows_the_intervals(grpo_replay, gspo_replay, want):
    final = {"grpo": 0.5, "gspo": 0.5}
    final.update({f"grpo-replay={r}": grpo_replay for r in ("R2", "R3")})
    final.update({f"gspo-replay={r}": gspo_replay for r in ("R2", "R3")})
    res = Synthetic(grid(5, final))
    _, verdict, limits = study._replay_needed(res)
    assert verdict.startswith(want)
    # a null result with its power: each GRPO interval's half-width, the smallest difference it resolves
    arms = res.arms(study.HEADLINE)
    resolved = limits.split("differences beyond ±")[1].split(" (GRPO)")[0]
    for r in ("R2", "R3"):
        d = claims.paired(claims.final(arms[f"grpo-replay={r}"]), claims.final(arms["grpo"]))
        assert f"{100 * (d.hi - d.lo) / 2:.1f}" in resolved.split("–"), (resolved, d)


@pytest.mark.parametrize(
    "none, r3, want",
    [
        (0.2, 0.5, "Reproduced: R3 stops the collapse"),  # 30 points down without replay, none with R3
        (0.2, 0.2, "Not reproduced: GRPO collapses with R3 too"),
        (0.48, 0.5, "Not tested: GRPO without replay collapsed in 0/5"),
    ],
)
def test_with_five_seeds_the_r3_verdict_reads_the_collapses_and_the_paired_difference(none, r3, want):
    final = dict.fromkeys(ARMS, 0.5) | {"grpo": none, "grpo-replay=R3": r3}
    here, verdict, _ = study._r3_collapse(Synthetic(grid(5, final)))
    assert verdict.startswith(want)
    assert "GSPO in the same grid (beside the pre-registered test, 5 seeds): collapsed in 0/5" in here


def test_the_instruments_verdict_names_what_helps_and_what_hurts_once_each_has_three_seeds():
    final = dict.fromkeys(ARMS, 0.5)
    instruments = {f"{o}-{s}": 0.5 for s in study.INSTRUMENTS for o in ("grpo", "gspo")}
    del instruments["gspo-icepop=True"]  # GSPO has no token ratio to mask
    instruments |= {"grpo-replay=R3W": 0.7, "gspo-router_shift=True": 0.3}
    g = grid(3, final | instruments)
    g.update({a: dict(list(g[a].items())[:2]) for a in instruments if a != "grpo-replay=R3W"})  # 2 seeds there
    here, verdict, _ = study._instruments(Synthetic(g))
    assert verdict == "Pending: the headline grid has 2 of 3 seeds" and "weight replay (R3W) on GRPO +" in here
    _, verdict, _ = study._instruments(Synthetic(grid(3, final | instruments)))
    assert verdict == "Helps: weight replay (R3W) (GRPO); hurts: RSPO's router-shift ratio (GSPO)"


LADDER_SWEEP = ROOT / "configs" / "sweeps" / f"{study.DAPO}.py"


class Ladder(claims.Results):
    """The committed results, with the DAPO ladder replaced by synthetic runs of the sweep file's own arms:
    accuracy `acc(budget, rung, seed)`, for the seeds `seeds(budget, rung)`; dapo_sampling has no runs
    (its part of the verdict reads "pending", whatever is committed)."""

    def __init__(self, acc, seeds=lambda budget, rung: range(5)):
        super().__init__(ROOT)
        self.acc, self.seeds = acc, seeds

    def arms(self, name):
        if name == study.SAMPLING:
            return {}
        if name != study.DAPO:
            return super().arms(name)
        out = {}
        for r in sweeps.load_sweep(LADDER_SWEEP, ROOT).runs:
            own, seed = r.arm_overrides, r.overrides[sweeps.SEED]
            budget, rung = own["max_new_tokens"], sum(key in own for key, _ in study.RUNGS)
            if seed in self.seeds(budget, rung):
                a = self.acc(budget, rung, seed)
                extra = {"truncation_rate": 0.1, "generation_rounds": 2.0 if rung == len(study.RUNGS) else 1.0}
                records = [{"step": s, ACCURACY: a, SAMPLED: a, **extra} for s in (0, 10, 20, 30)]
                records[0] |= {ACCURACY: 0.4, SAMPLED: 0.4}
                out.setdefault(r.arm, []).append(RunResult(r, "done", records))
        return out


def wobble(seed: int, rung: int) -> float:
    return 0.004 * ((seed * 7 + rung * 3) % 5)


def test_the_dapo_row_reads_the_sweep_files_rungs_and_budgets():
    ladder = load_file(LADDER_SWEEP)
    assert (study.BINDING, study.LOOSE) == (ladder.BINDING, ladder.LOOSE)
    assert [key for key, _ in study.RUNGS] == [next(iter(rung)) for rung in ladder.RUNGS[1:]]
    assert study.CONTROL_RUNGS == ladder.CONTROL_RUNGS


def test_the_dapo_row_pairs_each_rung_to_the_one_below_over_shared_seeds_and_waits_for_five():
    res = Ladder(lambda b, i, s: 0.5 + 0.02 * i + wobble(s, i), lambda b, i: range(4 if i == 3 else 5))
    here, verdict, limits = study._dapo(res)
    assert verdict == "Pending: the ladder has 4 of 5 seeds, the control 5 of 5"
    assert limits.startswith("4 of 5 seeds on the ladder, 5 of 5 on the control")
    # + clip-higher (rung 3) − + soft overlong shaping (rung 2), by hand over seeds 0-3
    diffs = [0.02 + wobble(s, 3) - wobble(s, 2) for s in range(4)]
    want = analysis.interval(diffs)
    assert f"+ clip-higher {want.text()} (" in here and "21-token budget (4 seeds" in here
    assert "Control, 32-token budget (5 seeds)" in here and "the 21-token budget cuts 10.0%" in limits
    assert "dynamic sampling draws 2.0 rounds" in limits


@pytest.mark.parametrize(
    "step, filter_at_21, want",
    [
        (
            0.05,
            0.05,
            "Reproduced: every rung helps; overlong filtering where nothing is cut (32 tokens): includes 0; "
            "dynamic sampling's gain at equal rollouts: pending",
        ),
        (
            0.05,
            -0.05,
            "Not reproduced: + soft overlong shaping, + clip-higher, + token-level loss, + dynamic sampling help; "
            "+ overlong filtering hurts; overlong filtering where nothing is cut (32 tokens): includes 0 (its cost is "
            "the budget's); dynamic sampling's gain at equal rollouts: pending",
        ),
        (
            0.0,
            0.0,
            "Not reproduced: no rung helps; overlong filtering where nothing is cut (32 tokens): includes 0; "
            "dynamic sampling's gain at equal rollouts: pending",
        ),
    ],
)
def test_with_five_seeds_the_dapo_verdict_follows_each_rungs_interval(step, filter_at_21, want):
    def acc(budget, rung, seed):
        ups = [0.0, filter_at_21 if budget == study.BINDING else 0.0] + [step] * (len(study.RUNGS) - 1)
        if budget == study.LOOSE and rung == 1:  # filtering at 32 tokens: GRPO's seed plus noise of mean ~0
            return 0.5 + wobble(seed, 0) + 0.01 * (-1) ** seed
        return 0.5 + sum(ups[: rung + 1]) + wobble(seed, rung)

    _, verdict, limits = study._dapo(Ladder(acc))
    assert verdict == want
    assert "they resolve paired sampled differences beyond ±" in limits


def test_a_claims_file_gives_its_claims_in_order_and_one_without_them_is_refused(tmp_path):
    loaded = claims.load(ROOT / "configs" / "sweeps" / "claims.py")
    assert [(c.claim, c.sweeps) for c in loaded] == [(c.claim, c.sweeps) for c in study.CLAIMS]
    (tmp_path / "none.py").write_text("CLAIMS = ()\n")
    with pytest.raises(ValueError, match="must define CLAIMS"):
        claims.load(tmp_path / "none.py")


# ------------------------------------------------------------------ the LoRA rows (configs/sweeps/lora.py)

LORA_SWEEP = ROOT / "configs" / "sweeps" / "lora.py"


class LoraGrid(claims.Results):
    """The LoRA sweep's runs, each arm's final sampled accuracy `acc(arm, seed)` from a shared start of 0.5
    and its drift `drift(arm, seed)`, for the seeds in `seeds`."""

    def __init__(self, acc, drift, seeds=range(5)):
        super().__init__(ROOT)
        self.acc, self.drift, self.seeds = acc, drift, seeds

    def arms(self, name):
        assert name == study.LORA
        out = {}
        for r in sweeps.load_sweep(LORA_SWEEP, ROOT).runs:
            seed = r.overrides[sweeps.SEED]
            if seed in self.seeds:
                a, d = self.acc(r.arm, seed), self.drift(r.arm, seed)
                records = [{"step": 0, ACCURACY: 0.5, SAMPLED: 0.5}]
                records += [{"step": s, ACCURACY: a, SAMPLED: a, "drift_slot_change_rate": d} for s in (10, 20, 30)]
                out.setdefault(r.arm, []).append(RunResult(r, "done", records))
        return out


def test_the_lora_rows_name_the_sweeps_arms():
    assert {r.arm for r in sweeps.load_sweep(LORA_SWEEP, ROOT).runs} == {"gspo", *study.LORA_ARMS}


def test_the_lora_rows_wait_for_five_seeds_then_apply_the_margin_and_the_drift_rule():
    shift = {"gspo": 0.0, **dict(zip(study.LORA_ARMS, (0.01, -0.2, 0.03, -0.1), strict=True))}
    spread = {"gspo": 0.0, **dict(zip(study.LORA_ARMS, (0.004, 0.01, 0.3, 0.004), strict=True))}
    acc = lambda arm, seed: 0.8 + shift[arm] + spread[arm] * (seed - 2)  # noqa: E731
    drift = lambda arm, seed: (0.02 if arm == "gspo" else 0.03) + 0.001 * ((seed * 3) % 5)  # noqa: E731

    here, verdict, limits = study._lora_matches(LoraGrid(acc, drift, seeds=range(4)))
    assert verdict == "Pending: the LoRA sweep has 4 of 5 seeds" and limits.startswith("4 seeds, which resolve")
    want = analysis.interval(
        [shift["gspo-rank=1-targets=attention,experts-learning_rate=0.003"] + 0.004 * (s - 2) for s in range(4)]
    )
    assert f"rank 1 {want.text()} (" in here

    _, verdict, _ = study._lora_matches(LoraGrid(acc, drift))
    # rank 1 +1 ± small: within ±5; rank 8 -20: below 0; rank 32 +3 with a wide spread: not settled;
    # attention-only -10: below 0.
    assert verdict.split("; ") == [
        "rank 1 matches (within ±5)",
        "rank 8 falls short (below 0)",
        verdict.split("; ")[2],
        "rank 32 attention-only falls short (below 0)",
    ]
    assert verdict.split("; ")[2].startswith("rank 32 not settled (±")

    here, verdict, _ = study._lora_drift(LoraGrid(acc, drift))
    assert verdict == "rank 1 higher; rank 8 higher; rank 32 higher; rank 32 attention-only higher"
    assert "full fine-tuning 2.0–2.4%" in here and "paired +1.00 ± 0.00 (+1.00 to +1.00) points" in here
    _, verdict, _ = study._lora_drift(LoraGrid(acc, lambda arm, seed: 0.02 + 0.001 * ((seed * 3) % 5)))
    assert verdict.count("not resolved") == 4  # no difference: an interval on 0


class SweepGrid(claims.Results):
    """The committed results, with the sweeps in `acc` replaced by synthetic runs of their sweep files' own
    arms: final accuracy `acc[sweep](arm, seed)` from a start of 0.5, for the seeds in `seeds`."""

    def __init__(self, acc, seeds=range(5)):
        super().__init__(ROOT)
        self.acc, self.seeds = acc, seeds

    def arms(self, name):
        if name not in self.acc:
            return super().arms(name)
        out = {}
        for r in sweeps.load_sweep(ROOT / "configs" / "sweeps" / f"{name}.py", ROOT).runs:
            seed = r.overrides[sweeps.SEED]
            if seed in self.seeds:
                out.setdefault(r.arm, []).append(run(r.arm, seed, 0.5, self.acc[name](r.arm, seed)))
        return out


def test_the_new_rows_name_their_sweeps_arms():
    arms = lambda name: {r.arm for r in sweeps.load_sweep(ROOT / "configs" / "sweeps" / f"{name}.py", ROOT).runs}
    assert arms(study.FOLLOWUP) == {study.GSPO_CONTROL, *study.GSPO_VARIANTS, *study.RSPO_PAIRS, "gmpo-minibatches=8"}
    assert arms(study.SPLIT) == {study.SPLIT_CONTROL, *study.SPLIT_ARMS}
    assert arms(study.SAMPLING) == set(study.SAMPLING_ARMS)


def jitter(arm: str, seed: int) -> float:
    return 0.005 * ((seed * 7 + len(arm)) % 5)


@pytest.mark.parametrize(
    "steady, want",
    [
        ({"eps_low=0.003"}, "The clip range: clip range 10× stops the collapse"),
        (
            {"gspo-minibatches=1", "gspo-minibatches=2"},
            "The sequence ratio off-policy: 1 update per rollout and 2 updates each stop the collapse, "
            "no wider clip range does",
        ),
        (
            {"gspo-minibatches=2"},
            "The sequence ratio off-policy: 2 updates stops the collapse, no wider clip range does",
        ),
        (set(), "Neither: GSPO collapses on-policy too (every ratio 1, nothing clipped)"),
        ({"control"}, "Not this code's behaviour: the rerun control collapsed in 0/5"),
    ],
)
def test_the_gspo_collapse_verdict_follows_the_preregistered_order(steady, want):
    def acc(arm, seed):  # a collapsed run ends 30 points below its start of 0.5; a steady one 10 above
        ok = (
            any(k in arm for k in steady)
            and "router_shift" not in arm
            or (arm == study.GSPO_CONTROL and "control" in steady)
        )
        return (0.6 if ok else 0.2) + jitter(arm, seed)

    here, verdict, limits = study._gspo_collapse(SweepGrid({study.FOLLOWUP: acc}))
    assert verdict == want and limits.startswith("5 of 5 seeds; they resolve")
    assert "Headline cell, GSPO rerun (5 seeds)" in here and "collapsed in 5/5" in here  # the headline grid's
    _, pending, _ = study._gspo_collapse(SweepGrid({study.FOLLOWUP: acc}, seeds=range(3)))
    assert pending == "Pending: `headline_followup` has 3 of 5 seeds of every arm"


def test_the_rspo_row_pairs_each_with_its_objective_alone():
    lift = {"gmpo-minibatches=8-router_shift=True": 0.1, "gspo-minibatches=8-router_shift=True": 0.0}
    # each arm's seeds wobble ±0.01 around its lift (the jitter's five values are 0 to 0.02, mean 0.01)
    acc = lambda arm, seed: 0.5 + lift.get(arm, 0.0) + (jitter(arm, seed) - 0.01) * (arm in lift)  # noqa: E731
    here, verdict, _ = study._rspo(SweepGrid({study.FOLLOWUP: acc}))
    assert verdict == "GMPO + router shift (RSPO as published) helps; GSPO + router shift unresolved"
    want = analysis.interval([0.09 + jitter("gmpo-minibatches=8-router_shift=True", s) for s in range(5)])
    assert f"GMPO + router shift (RSPO as published) {want.text()} (0/5 collapsed; alone 0/5)" in here


def test_the_mechanism_row_splits_the_on_policy_control_with_its_interaction():
    effect = {"grpo-minibatches=1-dtype=bfloat16": 0.03, "grpo-minibatches=4-dtype=float32": 0.01}
    both = "grpo-minibatches=1-dtype=float32"
    acc = lambda arm, seed: 0.5 + (0.05 if arm == both else effect.get(arm, 0.0)) + jitter(arm, seed)  # noqa: E731
    here, _, limits = study._mechanism(SweepGrid({study.SPLIT: acc}))
    inter = analysis.interval(
        [
            jitter(both, s)
            - jitter(study.SPLIT_CONTROL, s)
            + 0.01
            - sum(jitter(a, s) - jitter(study.SPLIT_CONTROL, s) for a in effect)
            for s in range(5)
        ]
    )
    assert f"; interaction {inter.text()}" in here and "Split in its two changes (`on_policy_split`, 5 seeds" in here
    assert "the control's two changes split in `on_policy_split` (5 of 5 seeds)" in limits


@pytest.mark.parametrize(
    "more, want",
    [
        (0.0, "the filter's"),
        (0.09, "the sampling's"),
        (0.18, "unresolved by the rule (not foreseen there): as many rollouts gain more than dynamic sampling"),
    ],
)
def test_dynamic_sampling_at_equal_rollouts_names_the_filter_or_the_sampling(more, want):
    lift = {"grpo-dynamic_sampling=True-max_rounds=3": 0.09, "grpo-num_groups=64": more}
    acc = lambda arm, seed: 0.5 + lift.get(arm, 0.0) + jitter(arm, seed)  # noqa: E731
    text, verdict = study._dapo_sampling(SweepGrid({study.SAMPLING: acc}))
    assert verdict == want and "Dynamic sampling at equal rollouts (`dapo_sampling`, 5 seeds)" in text


@pytest.mark.parametrize(
    "cost, want",
    [
        (0.0, "GRPO k=1 costs nothing (within ±3); GRPO k=2 costs nothing (within ±3)"),
        (-0.1, "GRPO k=1 costs (below 0); GRPO k=2 costs (below 0)"),
    ],
)
def test_the_staleness_row_pairs_each_lag_with_k0_and_applies_the_margin(cost, want):
    """k = 4 is reported, not judged; GSPO's lags here cost a wide, unsettled amount."""
    assert {r.arm for r in sweeps.load_sweep(ROOT / "configs/sweeps/staleness.py", ROOT).runs} == {
        f"{a}-staleness={k}" for a in ("grpo", "gspo") for k in (0, 1, 2, 4)
    }

    def acc(arm, seed):
        lag = int(arm.rsplit("=", 1)[1])
        if arm.startswith("grpo"):
            return 0.6 + (cost if lag else 0.0) + jitter(arm, seed) * (lag == 0)
        return 0.6 + (0.2 * (seed - 2) if lag else 0.0)

    here, verdict, limits = study._staleness(SweepGrid({study.STALENESS: acc}))
    assert verdict.startswith(want + "; GSPO k=1 not settled (±") and "k=4" not in verdict
    want_k1 = analysis.interval([cost - jitter("grpo-staleness=0", s) for s in range(5)])
    assert f"GRPO k=1 − k=0 {want_k1.text()}; GRPO k=2" in here and "GSPO k=4 − k=0" in here
    assert limits.startswith("5 seeds, which resolve paired differences beyond ±")
    _, pending, _ = study._staleness(SweepGrid({study.STALENESS: acc}, seeds=range(2)))
    assert pending == "Pending: the staleness sweep has 2 of 5 seeds"
    _, _, one = study._staleness(SweepGrid({study.STALENESS: acc}, seeds=range(1)))
    assert one.startswith("1 seed, which give no interval yet (the margin is ±3)")  # not "±0.0": one seed has none


class WithDriftLaw(claims.Results):
    """The committed results, with drift_scaling read from `root` (runs made to follow a known law)."""

    def __init__(self, root: Path):
        super().__init__(ROOT)
        self.root = root

    def arms(self, name):
        if name != study.DRIFT_LAW:
            return super().arms(name)
        out = {}
        for r in report.collect(sweeps.load_sweep(ROOT / "configs" / "sweeps" / "drift_scaling.py", ROOT), self.root):
            if r.status == "done":
                out.setdefault(r.run.arm, []).append(r)
        return out


def test_the_drift_rows_set_the_drift_laws_qwen3_value_beside_the_papers(tmp_path):
    """On runs that follow a known law exactly, the two drift rows print its Qwen3-30B-A3B value (a
    zero-width interval) and place it against the papers' ~10% and 94%; with a dial's cells missing, pending."""
    from test_drift_law import truth, write_workroot

    write_workroot(tmp_path, noise=0.0)
    w = claims.pct(truth(drift_law.QWEN3, "drift_slot_change_rate"))  # every metric follows the same law
    assert w == "90.7%"  # logit(0.2) + 0.8 ln 6 + 0.3 ln 2 + 0.5 ln 4 + 0.4 ln(1000/36)
    here, verdict, _ = study._drift(WithDriftLaw(tmp_path))
    assert "Drift law (`drift_scaling`, 51 of 51 runs) at Qwen3-30B-A3B" in here
    assert f"slots moved per iteration {w} ({w} to {w}; center cell 20.0%)" in here
    assert verdict.endswith("; at Qwen3-30B-A3B's scale (the drift law) above the reported 10%")
    _, verdict, _ = study._mismatch(WithDriftLaw(tmp_path))
    assert verdict.endswith(
        "routers at Qwen3-30B-A3B's scale (the drift law) above the reported 10%; "
        "tokens at Qwen3-30B-A3B's scale (the drift law) below the reported 94%"  # 90.7% < 94%
    )
    shutil.rmtree(tmp_path / "runs" / "grpo-num_layers=2-seed=2")  # a seed short: the value as it stands
    here, verdict, _ = study._drift(WithDriftLaw(tmp_path))
    assert "(`drift_scaling`, 50 of 51 runs) at Qwen3-30B-A3B (48 MoE layers, 128 experts, top-8" in here
    assert verdict.endswith("at Qwen3-30B-A3B's scale: pending (50 of 51 runs)")
    assert f"slots moved per iteration {w} (no interval yet; center cell 20.0%)" in here
    for d in tmp_path.joinpath("runs").iterdir():
        if "top_k" in d.name:
            shutil.rmtree(d)
    here, verdict, _ = study._drift(WithDriftLaw(tmp_path))
    assert "Drift law (`drift_scaling`): 41 of 51 runs" in here
    assert verdict.endswith("at Qwen3-30B-A3B's scale: pending (41 of 51 runs)")


def test_finished_runs_that_git_does_not_track_are_named(tmp_path):
    """What `scripts/claims.py` warns of: a finished run under results/ whose metrics are not committed
    (a committed one, a running one, an ignored one and a non-checkout are not named)."""
    import json
    import subprocess

    def run(name: str, status: str) -> None:
        d = tmp_path / "results" / "s" / "runs" / name
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text("{}\n")
        (d / sweeps.STATE_FILE).write_text(json.dumps({"status": status}))

    assert claims.uncommitted_runs(tmp_path) == []  # not a git checkout
    git = lambda *a: subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *a], cwd=tmp_path, check=True)  # noqa: E731
    git("init", "-q")
    run("committed", "done")
    git("add", "results")
    git("commit", "-qm", "runs")
    run("finished", "done")
    run("running", "running")
    run("ignored", "done")
    (tmp_path / ".gitignore").write_text("results/s/runs/ignored/\n")
    assert claims.uncommitted_runs(tmp_path) == ["results/s/runs/finished"]

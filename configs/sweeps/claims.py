"""The study's claims: docs/RESULTS.md's claims table, a row per claim of the papers, each with the sweeps
that test it and how its row reads them (the arms, the seeds pre-registered, the rule its verdict
follows). Not a sweep: gspo_jax.study.claims reads its CLAIMS and builds the table from results/.

    python scripts/claims.py --check    # exit 1 if docs/RESULTS.md's table is not the one this file gives
"""

from __future__ import annotations

from collections.abc import Sequence

from gspo_jax.study import drift_law, sweeps
from gspo_jax.study.analysis import Interval
from gspo_jax.study.claims import (
    Claim,
    Results,
    collapses,
    final,
    gain,
    iv,
    mean,
    paired,
    pct,
    plain,
    run_means,
    seed_of,
    shared_seeds,
    sign,
    span,
    widths,
)
from gspo_jax.study.report import ACCURACY, RunResult

DRIFT_LAW = "drift_scaling"  # configs/sweeps/drift_scaling.py: drift against depth, experts, top-k and length


def _at_qwen3(res: Results, reported: dict[str, tuple[str, float]]) -> tuple[str, dict[str, str]]:
    """(a sentence, metric -> verdict) of each metric of `reported` (its words, the value a paper reports for
    its own model) extrapolated by the drift law (gspo_jax.study.drift_law, as `scripts/drift_law.py` fits
    it) to Qwen3-30B-A3B, each set beside what the paper reports. Until every run of the sweep is in (the
    seeds its analysis states) the value is shown as it stands and the verdict is pending."""
    runs = [r for rs in res.arms(DRIFT_LAW).values() for r in rs]
    total = len(sweeps.load_sweep(res.repo / "configs" / "sweeps" / f"{DRIFT_LAW}.py", res.repo).runs)
    pts = drift_law.points(runs)
    laws = {m: drift_law.law(pts, m) for m in reported}
    pending = {m: f"at Qwen3-30B-A3B's scale: pending ({len(runs)} of {total} runs)" for m in reported}
    if any(w is None for w in laws.values()):
        return f". Drift law (`{DRIFT_LAW}`): {len(runs)} of {total} runs", pending
    values, verdicts = [], {}
    for m, (words, paper) in reported.items():
        w = laws[m]
        # Before every seed is in, a cell of one seed makes the bootstrap interval zero-wide: none is shown.
        spread = f"{pct(w.qwen3_lo)} to {pct(w.qwen3_hi)}; " if len(runs) == total else "no interval yet; "
        values.append(f"{words} {pct(w.qwen3)} ({spread}center cell {pct(w.center)})")
        place = "within" if w.qwen3_lo <= paper <= w.qwen3_hi else "below" if w.qwen3_hi < paper else "above"
        verdicts[m] = f"at Qwen3-30B-A3B's scale (the drift law) {place} the reported {pct(paper, 0)}"
    head = f". Drift law (`{DRIFT_LAW}`, {len(runs)} of {total} runs) at Qwen3-30B-A3B "
    head += "(48 MoE layers, 128 experts, top-8, ~1,000 tokens): "
    return head + "; ".join(values), verdicts if len(runs) == total else pending


def _drift(res: Results) -> tuple[str, str, str]:
    main = run_means([r for rs in res.arms("main_job").values() for r in rs], "drift_slot_change_rate")
    arch = {
        a: mean(run_means(res.arm("drift_architecture", a), "drift_slot_change_rate"))
        for a in ("grpo-minibatches=1", "grpo", "grpo-num_experts=64")
    }
    many = run_means(
        res.arm("many_experts", "grpo-replay=none") + res.arm("many_experts", "gspo-replay=none"),
        "drift_slot_change_rate",
    )
    here = (
        f"Slots moved per iteration (2 updates): {span(main)} in the main job (8 experts, 3 MoE layers). In the "
        f"study regime (`drift_architecture`, GRPO): one update {pct(arch['grpo-minibatches=1'])}, 8 updates "
        f"{pct(arch['grpo'])}, 8 updates with 64 experts {pct(arch['grpo-num_experts=64'])}. With 64 experts at a "
        f"step that learns (`many_experts`, no replay): {span(many)} per iteration"
    )
    ok = arch["grpo"] >= 0.08 or min(many) >= 0.05
    law, at_scale = _at_qwen3(res, {"drift_slot_change_rate": ("slots moved per iteration", 0.10)})
    verdict = (
        "Reached with 8 updates or 64 experts" if ok else "Not reached"
    ) + f"; {at_scale['drift_slot_change_rate']}"
    limits = "3 seeds per arm; 1–15 MoE layers, not 48; drift is per iteration, not per update"
    limits += "; the law: 10-iteration runs, one dial moved at a time, its fit extrapolated past the cells measured"
    return here + law, verdict, limits


HEADLINE = "headline"  # configs/sweeps/headline.py: the grid in the mechanism search's closest cell
HEADLINE_SEEDS = 5  # pre-registered on GRPO and GSPO x {none, R2, R3}; 3 on the instruments
INSTRUMENT_SEEDS = 3
REPLAYS = ("R2", "R3")


def _arm_name(objective: str, replay: str) -> str:
    return objective if replay == "none" else f"{objective}-replay={replay}"


def _headline(res: Results, arms: Sequence[str]) -> tuple[int, dict[str, list[RunResult]]]:
    """`shared_seeds` of `arms` in the headline grid."""
    return shared_seeds(res.arms(HEADLINE), arms)


def _pending(k: int, of: int) -> str:
    return f"Pending: the headline grid has {k} of {of} seeds"


def _replay_needed(res: Results) -> tuple[str, str, str]:
    arms = [_arm_name(o, rp) for o in ("grpo", "gspo") for rp in ("none", *REPLAYS)]
    k, h = _headline(res, arms)
    here, verdict = "", _pending(k, HEADLINE_SEEDS)
    if k:
        g = {o: iv(gain(h[o])) for o in ("grpo", "gspo")}
        d = {(o, rp): paired(final(h[_arm_name(o, rp)]), final(h[o])) for o in ("grpo", "gspo") for rp in REPLAYS}
        dg = {(o, rp): paired(final(h[_arm_name(o, rp)], ACCURACY), final(h[o], ACCURACY)) for o, rp in d}
        here = (
            f"Headline grid (the mechanism search's closest cell: 8 MoE layers of 64 experts, 8 updates per rollout, "
            f"{k} seed{'s' if k > 1 else ''}): sampled gain without replay GRPO {g['grpo'].text()}, GSPO "
            f"{g['gspo'].text()}; paired to no replay, final sampled (greedy): "
            + "; ".join(
                f"{rp} GRPO {d['grpo', rp].text()} ({dg['grpo', rp].text()}), GSPO {d['gspo', rp].text()} "
                f"({dg['gspo', rp].text()})"
                for rp in REPLAYS
            )
            + ". "
        )
        if k >= HEADLINE_SEEDS:
            signs = {key: sign(i) for key, i in d.items()}
            grpo_needs = all(signs["grpo", rp] == "above 0" for rp in REPLAYS)
            gspo_not = all(signs["gspo", rp] == "includes 0" for rp in REPLAYS)
            verdict = (
                "Reproduced: replay helps GRPO and makes no difference to GSPO"
                if grpo_needs and gspo_not
                else "Not reproduced: " + ", ".join(f"{o.upper()} with {rp} {signs[o, rp]}" for o, rp in d)
            )
    here += _replay_needed_earlier(res)
    limits = f"{k} of {HEADLINE_SEEDS} seeds in the headline grid; "
    if k > 1:  # a null result with its power: the smallest paired difference these seeds would resolve
        limits += (
            f"they resolve paired sampled differences beyond ±{_resolution(d, 'grpo')} (GRPO) and "
            f"±{_resolution(d, 'gspo')} (GSPO) points; "
        )
    if k:  # a confound of the GSPO arms: how much its narrow sequence clip range cuts at 8 updates
        limits += (
            f"GSPO clips {span(run_means(h['gspo'], 'seq_clip_frac'), 0)} of completions per update there (the "
            "paper's clip range, at 8 updates per rollout), GRPO "
            f"{span(run_means(h['grpo'], 'clip_frac'), 1)} of tokens; "
        )
    limits += (
        "60 iterations from a warm start, widths 64–128, not 48 layers of 128 experts; earlier sweeps: 3 seeds "
        "per arm, 3 MoE layers, ~8-token completions"
    )
    return here, verdict, limits


def _resolution(d: dict[tuple[str, str], Interval], objective: str) -> str:
    """The half-widths of `objective`'s paired intervals, in points: the smallest difference its seeds resolve."""
    return widths([i for (o, _), i in d.items() if o == objective])


def _replay_needed_earlier(res: Results) -> str:
    """The smaller regimes first tested (3 MoE layers, ~8-token completions): context for the headline grid."""
    me = {(o, rp): res.arm("many_experts", f"{o}-replay={rp}") for o in ("grpo", "gspo") for rp in ("none", "R2")}
    r3 = {o: res.arm("many_experts_r3", f"{o}-replay=R3") for o in ("grpo", "gspo")}
    g = {o: iv(gain(me[o, "none"])) for o in ("grpo", "gspo")}
    d2 = {o: paired(final(me[o, "R2"]), final(me[o, "none"])) for o in ("grpo", "gspo")}
    d3 = {o: paired(final(r3[o]), final(me[o, "none"])) for o in ("grpo", "gspo")}
    return (
        f"Earlier, `many_experts` (3 MoE layers, ~10% drift): GRPO {g['grpo'].text()}, GSPO {g['gspo'].text()} "
        f"without replay; paired to no replay, R2 {d2['grpo'].text()} (GRPO), {d2['gspo'].text()} (GSPO); "
        f"consistent R3 {d3['grpo'].text()} (GRPO), {d3['gspo'].text()} (GSPO)"
        + (": no difference excludes 0" if all(sign(i) == "includes 0" for i in (*d2.values(), *d3.values())) else "")
    )


def _clipping(res: Results) -> tuple[str, str, str]:
    def ratio(name, grpo, gspo):
        return mean(run_means(res.arm(name, gspo), "seq_clip_frac")), mean(run_means(res.arm(name, grpo), "clip_frac"))

    rows = {
        "main job": ratio("main_job", "grpo", "gspo"),
        "`many_experts`": ratio("many_experts", "grpo-replay=none", "gspo-replay=none"),
        "`objectives_replay`": ratio("objectives_replay", "grpo-replay=none", "gspo-replay=none"),
    }
    here = "GSPO's completions clipped against GRPO's tokens: " + "; ".join(
        f"{k} {pct(s)} against {pct(t, 2)} ({s / t:.0f}×)" for k, (s, t) in rows.items()
    )
    learn = paired(final(res.arm("main_job", "gspo")), final(res.arm("main_job", "grpo")))
    here += f". GSPO − GRPO final sampled accuracy, main job: {learn.text()}"
    times = [s / t for s, t in rows.values()]
    better = "yes" if learn.lo > 0 else "not resolved" if learn.hi > 0 else "no"
    verdict = f"Clips {min(times):.0f}–{max(times):.0f}× more; learns better: {better}"
    return here, verdict, "3 seeds; a completion-level against a token-level fraction"


def _mismatch(res: Results) -> tuple[str, str, str]:
    def rates(name, arms):
        rs = [r for a in arms for r in res.arm(name, a)]
        return run_means(rs, "mismatch_router_flip_rate"), run_means(rs, "mismatch_token_any_flip")

    few = rates("objectives_replay", ["grpo-replay=none", "gspo-replay=none"])
    many = rates("many_experts", ["grpo-replay=none", "gspo-replay=none"])
    here = (
        f"bf16 sampler against the float32 trainer: {span(few[0])} of router choices, {span(few[1])} of tokens with a "
        f"flipped layer (8 experts, `objectives_replay`); {span(many[0])} and {span(many[1])} with 64 experts "
        "(`many_experts`)"
    )
    reported = {
        "mismatch_router_flip_rate": ("router choices that differ", 0.10),
        "mismatch_token_any_flip": ("tokens with a differing router", 0.94),
    }
    law, at_scale = _at_qwen3(res, reported)
    routers, tokens = at_scale["mismatch_router_flip_rate"], at_scale["mismatch_token_any_flip"]
    verdict = "Same order for routers with 64 experts; far fewer tokens; " + (
        routers if routers == tokens else f"routers {routers}; tokens {tokens}"
    )
    limits = "one engine (this sampler in bf16), 3 MoE layers, ~8-token completions; the law: as in the first row"
    return here + law, verdict, limits


def _r3_collapse(res: Results) -> tuple[str, str, str]:
    k, h = _headline(res, ["grpo", "grpo-replay=R3"])
    here, verdict = "", _pending(k, HEADLINE_SEEDS)
    if k:
        none, r3 = h["grpo"], h["grpo-replay=R3"]
        d, dg = paired(final(r3), final(none)), paired(final(r3, ACCURACY), final(none, ACCURACY))
        greedy = {name: iv(gain(rs, ACCURACY)) for name, rs in (("none", none), ("R3", r3))}
        here = (
            f"Headline grid ({k} seed{'s' if k > 1 else ''}): GRPO collapsed in {collapses(none)} without replay and "
            f"{collapses(r3)} with consistent R3; R3 − none, final sampled {d.text()}, greedy {dg.text()}. Read on "
            f"greedy accuracy GRPO does fall by more than the rule's 10 points: gain {greedy['none'].text()} without "
            f"replay, {greedy['R3'].text()} with R3. "
        )
        if k >= HEADLINE_SEEDS:
            most = sum(r.collapsed() for r in none) > len(none) / 2
            stops = sum(r.collapsed() for r in r3) <= 1 and d.lo > 0
            verdict = (
                ("Reproduced: R3 stops the collapse" if stops else "Not reproduced: GRPO collapses with R3 too")
                if most
                else f"Not tested: GRPO without replay collapsed in {collapses(none)} (the rule needs most seeds); "
                f"R3 − none {sign(d)}"
            )
    kg, g = _headline(res, ["gspo", "gspo-replay=R3"])
    if kg:  # not the pre-registered test (GRPO's), but where this grid's runs do collapse
        d_gspo = paired(final(g["gspo-replay=R3"]), final(g["gspo"]))
        here += (
            f"GSPO in the same grid (beside the pre-registered test, {kg} seed{'s' if kg > 1 else ''}): collapsed in "
            f"{collapses(g['gspo'])} without replay and {collapses(g['gspo-replay=R3'])} with R3; R3 − none, final "
            f"sampled {d_gspo.text()}. "
        )
    obj = {rp: res.arm("objectives_replay", f"grpo-replay={rp}") for rp in ("none", "R3")}
    none, r3 = res.arm("many_experts", "grpo-replay=none"), res.arm("many_experts_r3", "grpo-replay=R3")
    here += (
        f"Earlier, `objectives_replay`: GRPO collapsed in {collapses(obj['none'])} without replay and "
        f"{collapses(obj['R3'])} with R3, where the step causes it (the dense model falls too); `many_experts`: "
        f"GRPO collapsed in {collapses(none)} without replay; consistent R3 − none, final sampled "
        f"{paired(final(r3), final(none)).text()}"
    )
    limits = f"{k} of {HEADLINE_SEEDS} seeds in the headline grid; "
    if k > 1:
        limits += f"they resolve a paired sampled difference beyond ±{100 * (d.hi - d.lo) / 2:.1f} points; "
    limits += (
        "the collapse rule (pre-registered): final sampled accuracy > 10 points below the warm start; "
        "objectives_replay's R3 scored π_old live-routed"
    )
    return here, verdict, limits


INSTRUMENTS = {  # headline arm suffix -> what it is
    "replay=R3W": "weight replay (R3W)",
    "router_shift=True": "RSPO's router-shift ratio",
    "icepop=True": "IcePop",
    "geo_mask_delta=0.01": "the geometric sequence mask",
}


def _instruments(res: Results) -> tuple[str, str, str]:
    """What the instruments beyond replay do in the headline grid, each paired to its objective alone."""
    arms = [(o, suffix) for suffix in INSTRUMENTS for o in ("grpo", "gspo") if (o, suffix) != ("gspo", "icepop=True")]
    k, _ = _headline(res, [f"{o}-{suffix}" for o, suffix in arms])
    done = res.arms(HEADLINE)  # each instrument over the seeds it has, paired to its objective's
    parts, diffs = [], {}
    for o, suffix in arms:
        rs = done.get(f"{o}-{suffix}", [])
        if rs and o in done:
            diffs[o, suffix] = d = paired(final(rs), final(done[o]))
            parts.append(f"{INSTRUMENTS[suffix]} on {o.upper()} {d.text()} ({collapses(rs)} collapsed)")
    here = (
        "Headline grid, final sampled accuracy paired to the objective alone: " + "; ".join(parts)
        if parts
        else "Headline grid: no instrument run has finished yet"
    )
    verdict = _pending(k, INSTRUMENT_SEEDS)
    if k >= INSTRUMENT_SEEDS:
        better = [f"{INSTRUMENTS[s]} ({o.upper()})" for (o, s), d in diffs.items() if sign(d) == "above 0"]
        worse = [f"{INSTRUMENTS[s]} ({o.upper()})" for (o, s), d in diffs.items() if sign(d) == "below 0"]
        verdict = ("Helps: " + ", ".join(better) if better else "None helps: no interval above 0") + (
            ("; hurts: " + ", ".join(worse)) if worse else ""
        )
    limits = (
        f"{k} of {INSTRUMENT_SEEDS} seeds on every instrument; the headline grid's regime and confounds (the replay "
        "row)"
    )
    return here, verdict, limits


FOLLOWUP = "headline_followup"  # configs/sweeps/headline_followup.py: the headline cell's open questions
FOLLOWUP_SEEDS = 5  # pre-registered
GSPO_CONTROL = "gspo-minibatches=8"  # GSPO as the headline grid ran it, rerun beside its variants
GSPO_VARIANTS = {  # arm -> what it changes
    "gspo-minibatches=8-eps_low=0.003-eps_high=0.004": "clip range 10×",
    "gspo-minibatches=8-eps_low=0.009-eps_high=0.012": "clip range 30×",
    "gspo-minibatches=1": "1 update per rollout",
    "gspo-minibatches=2": "2 updates",
    "gspo-minibatches=4": "4 updates",
}


def _steady(rs: Sequence[RunResult], d: Interval) -> bool:
    """The ANALYSIS's "stops the collapse": at most 1 of the seeds collapsed, and the paired interval above 0."""
    return sum(r.collapsed() for r in rs) <= 1 and d.lo > 0


def _gspo_collapse(res: Results) -> tuple[str, str, str]:
    """Why GSPO collapsed in the headline cell, by headline_followup's pre-registered ANALYSIS (issue 65, point 3)."""
    k, h = shared_seeds(res.arms(FOLLOWUP), [GSPO_CONTROL, *GSPO_VARIANTS])
    verdict = f"Pending: `{FOLLOWUP}` has {k} of {FOLLOWUP_SEEDS} seeds of every arm"
    here = f"`{FOLLOWUP}` has no seed of every arm yet. "
    d: dict[str, Interval] = {}
    if k:
        ctrl = h[GSPO_CONTROL]
        d = {a: paired(final(h[a]), final(ctrl)) for a in GSPO_VARIANTS}
        here = (
            f"Headline cell, GSPO rerun ({k} seed{'s' if k > 1 else ''}): at the paper's clip range and 8 updates per "
            f"rollout collapsed in {collapses(ctrl)}, clipping {span(run_means(ctrl, 'seq_clip_frac'), 0)} of "
            "completions; paired to it, final sampled: "
            + "; ".join(f"{what} {d[a].text()} ({collapses(h[a])} collapsed)" for a, what in GSPO_VARIANTS.items())
            + ". "
        )
        if k >= FOLLOWUP_SEEDS:
            wide = [what for a, what in GSPO_VARIANTS.items() if "eps" in a and _steady(h[a], d[a])]
            fewer = [what for a, what in list(GSPO_VARIANTS.items())[2:4] if _steady(h[a], d[a])]
            on_policy = h["gspo-minibatches=1"]
            if sum(r.collapsed() for r in ctrl) < 4:
                verdict = f"Not this code's behaviour: the rerun control collapsed in {collapses(ctrl)}"
            elif wide:
                verdict = "The clip range: " + ", ".join(wide) + " stops the collapse"
            elif fewer:
                stop = " and ".join(fewer) + (" each stop" if len(fewer) > 1 else " stops")
                verdict = f"The sequence ratio off-policy: {stop} the collapse, no wider clip range does"
            elif sum(r.collapsed() for r in on_policy) >= 4:
                verdict = "Neither: GSPO collapses on-policy too (every ratio 1, nothing clipped)"
            else:
                verdict = "Unresolved: no arm meets the rule"
    g = res.arms(HEADLINE)
    if "gspo" in g:
        here += f"The headline grid's GSPO (before e7f042c's dispatch): collapsed in {collapses(g['gspo'])}"
    limits = f"{k} of {FOLLOWUP_SEEDS} seeds; "
    if k > 1:
        limits += f"they resolve paired sampled differences beyond ±{widths(list(d.values()))} points; "
    limits += (
        "the control rerun here: the expert dispatch changed its float32 summation order since the headline grid "
        "(issue 65, point 1); a defect on the multi-minibatch path is ruled out only as far as "
        "tests/test_train.py's independent computation covers it"
    )
    return here, verdict, limits


RSPO_PAIRS = {  # arm -> (its control, what it is)
    "gmpo-minibatches=8-router_shift=True": ("gmpo-minibatches=8", "GMPO + router shift (RSPO as published)"),
    "gspo-minibatches=8-router_shift=True": (GSPO_CONTROL, "GSPO + router shift"),
}


def _rspo(res: Results) -> tuple[str, str, str]:
    """RSPO as its paper names it, and the headline grid's lead at 5 seeds (issue 65, point 6)."""
    done = res.arms(FOLLOWUP)
    k, h = shared_seeds(done, [key for pair in RSPO_PAIRS.items() for key in (pair[0], pair[1][0])])
    verdict = f"Pending: `{FOLLOWUP}` has {k} of {FOLLOWUP_SEEDS} seeds of every arm"
    here, d = f"`{FOLLOWUP}` has no seed of every arm yet", {}
    if k:
        d = {a: paired(final(h[a]), final(h[c])) for a, (c, _) in RSPO_PAIRS.items()}
        here = (
            f"Headline cell ({k} seed{'s' if k > 1 else ''}), final sampled paired to the objective alone: "
            + "; ".join(
                f"{what} {d[a].text()} ({collapses(h[a])} collapsed; alone {collapses(h[c])})"
                for a, (c, what) in RSPO_PAIRS.items()
            )
        )
        if k >= FOLLOWUP_SEEDS:
            words = {"above 0": "helps", "below 0": "hurts", "includes 0": "unresolved"}
            verdict = "; ".join(f"{what} {words[sign(d[a])]}" for a, (_, what) in RSPO_PAIRS.items())
    limits = f"{k} of {FOLLOWUP_SEEDS} seeds; "
    if k > 1:
        limits += f"they resolve paired sampled differences beyond ±{widths(list(d.values()))} points; "
    limits += (
        "γ on the full softmax at π_old's experts (`loss.router_shift_probs`), floor 0.8 (the paper's value is not "
        "stated); the headline cell's regime (8 MoE layers of 64 experts, 8 updates per rollout, ~36 tokens)"
    )
    return here, verdict, limits


DAPO = "dapo_ladder_v2"  # configs/sweeps/dapo_ladder_v2.py: six rungs at a binding budget, a control at a loose one
DAPO_SEEDS = 5  # pre-registered
BINDING, LOOSE = 21, 32  # the sweep file's completion budgets, tokens
RUNGS = (  # the key each rung adds to the ones before, in the sweep file's order, and its name
    ("rollout.overlong_filter", "+ overlong filtering"),
    ("rollout.overlong_cache_len", "+ soft overlong shaping"),
    ("loss.eps_high", "+ clip-higher"),
    ("loss.aggregation", "+ token-level loss"),
    ("rollout.dynamic_sampling", "+ dynamic sampling"),
)
RUNG_NAMES = ("GRPO", *(name for _, name in RUNGS))
CONTROL_RUNGS = (0, 1, len(RUNGS))  # under the loose budget: GRPO, + overlong filtering, the full ladder


def _ladder(res: Results, budget: int, rungs: Sequence[int]) -> tuple[int, list[list[RunResult]]]:
    """(k, runs per rung): the seeds every one of `rungs` under `budget` has finished, and each rung's runs of
    those seeds only. An arm's rung is how many of the ladder's keys it sets."""
    found: dict[int, list[RunResult]] = {}
    for rs in res.arms(DAPO).values():
        own = rs[0].run.arm_overrides
        if own.get("max_new_tokens") == budget:
            found[sum(key in own for key, _ in RUNGS)] = rs
    k, runs = shared_seeds(found, rungs)
    return k, list(runs.values())


def _dapo(res: Results) -> tuple[str, str, str]:
    """The DAPO ladder by its sweep file's pre-registered ANALYSIS: each rung paired to the one below."""
    k, ladder = _ladder(res, BINDING, range(len(RUNG_NAMES)))
    kc, control = _ladder(res, LOOSE, CONTROL_RUNGS)
    here, steps = "", []
    if k:
        acc = [(iv(final(rs)), iv(final(rs, ACCURACY))) for rs in ladder]
        steps = [paired(final(b), final(a)) for a, b in zip(ladder, ladder[1:], strict=False)]
        greedy = [paired(final(b, ACCURACY), final(a, ACCURACY)) for a, b in zip(ladder, ladder[1:], strict=False)]
        iterations = ladder[0][0].run.overrides["train.num_iterations"]
        here = (
            f"{BINDING}-token budget ({k} seed{'s' if k > 1 else ''}, {iterations} iterations), final sampled (greedy) "
            "accuracy: "
            + " → ".join(
                f"{n} {100 * s.mean:.1f}% ({100 * g.mean:.1f}%)" for n, (s, g) in zip(RUNG_NAMES, acc, strict=True)
            )
            + ". Each rung − the one below, sampled (greedy): "
            + "; ".join(f"{n} {s.text()} ({g.text()})" for n, s, g in zip(RUNG_NAMES[1:], steps, greedy, strict=True))
            + ". "
        )
    if kc:
        names = [RUNG_NAMES[i] if i < len(RUNGS) else "the full ladder" for i in CONTROL_RUNGS]
        ctrl = [paired(final(b), final(a)) for a, b in zip(control, control[1:], strict=False)]
        here += (
            f"Control, {LOOSE}-token budget ({kc} seed{'s' if kc > 1 else ''}): sampled GRPO "
            f"{100 * iv(final(control[0])).mean:.1f}%; "
            + "; ".join(f"{n} − {m} {d.text()}" for n, m, d in zip(names[1:], names, ctrl, strict=False))
            + ". "
        )
    here += _dapo_earlier(res)
    equal, filt_verdict = _dapo_sampling(res)
    here += equal
    verdict = f"Pending: the ladder has {k} of {DAPO_SEEDS} seeds, the control {kc} of {DAPO_SEEDS}"
    if k >= DAPO_SEEDS and kc >= DAPO_SEEDS:
        signs = [sign(s) for s in steps]
        helps = [n for n, s in zip(RUNG_NAMES[1:], signs, strict=True) if s == "above 0"]
        hurts = [n for n, s in zip(RUNG_NAMES[1:], signs, strict=True) if s == "below 0"]
        if len(helps) == len(RUNGS):
            verdict = "Reproduced: every rung helps"
        else:
            verb = lambda names, one, many: ", ".join(names) + (one if len(names) == 1 else many)  # noqa: E731
            verdict = "Not reproduced: " + (verb(helps, " helps", " help") if helps else "no rung helps")
            verdict += ("; " + verb(hurts, " hurts", " hurt")) if hurts else ""
        filt = sign(paired(final(control[1]), final(control[0])))
        verdict += f"; overlong filtering where nothing is cut ({LOOSE} tokens): {filt}"
        if filt == "includes 0" and signs[0] == "below 0":
            verdict += " (its cost is the budget's)"
        verdict += f"; dynamic sampling's gain at equal rollouts: {filt_verdict}"
    limits = f"{k} of {DAPO_SEEDS} seeds on the ladder, {kc} of {DAPO_SEEDS} on the control; "
    if k > 1:
        limits += f"they resolve paired sampled differences beyond ±{widths(steps)} points; "
    if k:
        rounds = run_means(ladder[-1], "generation_rounds")
        limits += (
            f"dynamic sampling draws {plain(rounds)} rounds of rollouts per iteration to fill its batch with groups "
            "whose rewards differ (the rungs below draw 1): the same update size, more sampling; "
            f"the {BINDING}-token budget cuts {span(run_means(ladder[0], 'truncation_rate'))} of GRPO's completions"
        )
        limits += f", the {LOOSE}-token {span(run_means(control[0], 'truncation_rate'))}; " if kc else "; "
    limits += (
        "the default model (3 MoE layers of 8 experts) on sums of three digits, not a 32B model on AIME; soft "
        "overlong shaping comes before clip-higher here, after it in the paper"
    )
    return here, verdict, limits


SAMPLING = "dapo_sampling"  # configs/sweeps/dapo_sampling.py: the fifth rung with and without dynamic sampling
SAMPLING_ARMS = ("grpo", "grpo-dynamic_sampling=True-max_rounds=3", "grpo-num_groups=64")


def _dapo_sampling(res: Results) -> tuple[str, str]:
    """(a sentence, the verdict) of dynamic sampling against drawing as many rollouts (issue 65, point 5)."""
    k, h = shared_seeds(res.arms(SAMPLING), SAMPLING_ARMS)
    if not k:
        return f". Dynamic sampling at equal rollouts (`{SAMPLING}`): no seed of every arm yet", "pending"
    rung5, dyn, more = (h[a] for a in SAMPLING_ARMS)
    d_dyn, d_more = paired(final(dyn), final(rung5)), paired(final(more), final(rung5))
    d_filter = paired(final(dyn), final(more))
    text = (
        f". Dynamic sampling at equal rollouts (`{SAMPLING}`, {k} seed{'s' if k > 1 else ''}), paired to the fifth "
        f"rung: dynamic sampling {d_dyn.text()}, 64 groups every iteration {d_more.text()}; dynamic sampling − 64 "
        f"groups {d_filter.text()}"
    )
    if k < DAPO_SEEDS:
        return text, f"pending ({k} of {DAPO_SEEDS} seeds)"
    if d_dyn.lo > 0 and d_filter.lo > 0:
        return text, "the filter's"
    if d_more.lo > 0 and sign(d_filter) == "includes 0":
        return text, "the sampling's"
    if d_more.lo > 0 and d_filter.hi < 0:  # beyond the rule's two verdicts: said as such, not folded into one
        return text, "unresolved by the rule (not foreseen there): as many rollouts gain more than dynamic sampling"
    return text, "unresolved"


def _dapo_earlier(res: Results) -> str:
    """The first ladder (one greedy evaluation at iteration 100 on rising curves): context for the redone one."""
    arms = list(res.arms("dapo_ladder"))
    finals = [final(res.arm("dapo_ladder", a), ACCURACY) for a in arms]
    steps = [paired(b, a) for a, b in zip(finals, finals[1:], strict=False)]
    resolved = [s for s in steps if sign(s) != "includes 0"]
    return f"Earlier, `dapo_ladder` ({min(len(f) for f in finals)} seeds, 100 iterations, no soft-overlong rung): " + (
        "no rung's paired greedy difference excluded 0" if not resolved else f"{len(resolved)} rungs resolved"
    )


def _mechanism(res: Results) -> tuple[str, str, str]:
    """The search for a regime where off-policy routing drift breaks GRPO (issue 52, point 3)."""
    name, lr = "mechanism_search", "learning_rate=0.0001"
    arms = res.arms(name)
    off, on = res.arm(name, f"grpo-{lr}"), res.arm(name, f"grpo-minibatches=1-dtype=float32-{lr}")
    dense = res.arm(name, next(a for a in arms if a.startswith("grpo-dense_layers") and a.endswith(lr)))
    more = res.arm(name, f"grpo-minibatches=8-{lr}")
    step = (res.arm(name, "grpo"), res.arm(name, "grpo-minibatches=1-dtype=float32"))
    g = {k: iv(gain(rs)) for k, rs in (("off", off), ("on", on), ("dense", dense), ("more", more))}
    start = lambda rs: mean([a["start"] for r in rs if (a := r.accuracy(ACCURACY))])  # noqa: E731
    d, dg = paired(final(off), final(on)), paired(final(off, ACCURACY), final(on, ACCURACY))
    dm = paired(final(more), final(on))
    here = (
        "`mechanism_search` (9 layers, 8 MoE of 64 experts top-2; 33–39-token worked sums; bf16 sampler; lr 1e-4, "
        f"60 iterations), sampled gain: GRPO off-policy (4 updates per rollout) {g['off'].text()}, collapsed "
        f"{collapses(off)}; on-policy (1 update, float32 sampler) {g['on'].text()}, {collapses(on)}; dense of the "
        f"same active size {g['dense'].text()}, {collapses(dense)}. Off − on-policy, paired: sampled {d.text()}, "
        f"greedy {dg.text()}. 8 updates per rollout: sampled gain {g['more'].text()}, − on-policy {dm.text()} "
        f"({len(more)} seed{'s' if len(more) > 1 else ''}). At lr 3e-4 on- and off-policy fall alike (sampled gain "
        f"{iv(gain(step[1])).text()} and {iv(gain(step[0])).text()}, seed 0)"
    )
    found = (
        sum(r.collapsed() for r in off) >= 4
        and all(sum(r.collapsed() for r in rs) <= 1 for rs in (on, dense))
        and d.hi < 0
    )
    if found:
        verdict = "Found: off-policy GRPO collapses where the on-policy and dense runs do not"
    else:
        verdict = "Not found: no collapse off-policy by the pre-registered rule"
        if d.hi < 0:
            verdict += "; off-policy ends below on-policy (sampled interval below 0), a small effect"
    split, split_limit = _on_policy_split(res)
    here += split
    limits = (
        f"{d.n} seeds in the criterion's cells (resolving a paired difference beyond ±{100 * (d.hi - d.lo) / 2:.1f} "
        f"points); {split_limit}; the dense "
        f"model's warm start is {100 * (start(off) - start(dense)):.0f} points lower (greedy); 60 iterations, widths "
        "64–128; the search: 20 runs, ~6 CPU-hours"
    )
    return here, verdict, limits


SPLIT = "on_policy_split"  # configs/sweeps/on_policy_split.py: updates per rollout x sampler precision
SPLIT_SEEDS = 5  # pre-registered
SPLIT_ARMS = {  # arm -> what it changes from the off-policy cell (4 updates, bf16 sampler)
    "grpo-minibatches=1-dtype=bfloat16": "1 update per rollout alone",
    "grpo-minibatches=4-dtype=float32": "a float32 sampler alone",
    "grpo-minibatches=1-dtype=float32": "both (the search's on-policy control)",
}
SPLIT_CONTROL = "grpo-minibatches=4-dtype=bfloat16"


def _on_policy_split(res: Results) -> tuple[str, str]:
    """(a sentence, a limit) for the on-policy control split in its two changes (issue 65, point 4)."""
    k, h = shared_seeds(res.arms(SPLIT), [SPLIT_CONTROL, *SPLIT_ARMS])
    if not k:
        return (
            f". The control split in its two changes (`{SPLIT}`): no seed of every cell yet",
            "the on-policy control changes two things (updates per rollout, sampler precision)",
        )
    d = {a: paired(final(h[a]), final(h[SPLIT_CONTROL])) for a in SPLIT_ARMS}
    alone = [a for a in SPLIT_ARMS if "alone" in SPLIT_ARMS[a]]
    # the interaction: both − (each alone summed), per seed
    by = {a: final(h[a]) for a in [SPLIT_CONTROL, *SPLIT_ARMS]}
    base, both = by[SPLIT_CONTROL], by["grpo-minibatches=1-dtype=float32"]
    inter = iv(
        {s: both[s] - base[s] - sum(by[a][s] - base[s] for a in alone) for s in base if all(s in by[a] for a in by)}
    )
    text = (
        f". Split in its two changes (`{SPLIT}`, {k} seed{'s' if k > 1 else ''}, rerun here), final sampled paired to "
        "the off-policy cell: "
        + "; ".join(f"{SPLIT_ARMS[a]} {d[a].text()}" for a in SPLIT_ARMS)
        + f"; interaction {inter.text()}"
    )
    return text, f"the control's two changes split in `{SPLIT}` ({k} of {SPLIT_SEEDS} seeds)"


LORA = "lora"  # configs/sweeps/lora.py: GSPO full fine-tuning against LoRA, the main job's regime
LORA_SEEDS = 5  # pre-registered
LORA_MARGIN = 0.05  # the equivalence margin stated in its ANALYSIS: +-5 points of sampled gain
LORA_ARMS = {  # arm -> what it is (the sweep file's ARMS, as the sweep names its runs)
    "gspo-rank=1-targets=attention,experts-learning_rate=0.003": "rank 1",
    "gspo-rank=8-targets=attention,experts-learning_rate=0.003": "rank 8",
    "gspo-rank=32-targets=attention,experts-learning_rate=0.003": "rank 32",
    "gspo-rank=32-targets=attention-learning_rate=0.003": "rank 32 attention-only",
}


def _equivalence(d: Interval, margin: float, within: str, below: str) -> str:
    """A sweep's equivalence rule: `within` its ±margin, `below` 0 wholly, or neither (with the interval's
    half-width)."""
    if d.lo >= -margin and d.hi <= margin:
        return f"{within} (within ±{100 * margin:.0f})"
    if d.hi < 0:
        return f"{below} (below 0)"
    return f"not settled (±{100 * (d.hi - d.lo) / 2:.1f})"


def _lora_equivalence(d: Interval) -> str:
    return _equivalence(d, LORA_MARGIN, "matches", "falls short")


def _lora(res: Results) -> tuple[int, dict[str, list[RunResult]], str]:
    """(k, arm -> runs, the verdict until every pre-registered seed is in): over the seeds all arms share."""
    k, h = shared_seeds(res.arms(LORA), ["gspo", *LORA_ARMS])
    return k, h, f"Pending: the LoRA sweep has {k} of {LORA_SEEDS} seeds"


def _lora_matches(res: Results) -> tuple[str, str, str]:
    k, h, verdict = _lora(res)
    if not k:
        return "", verdict, ""
    d = {a: paired(gain(h[a]), gain(h["gspo"])) for a in LORA_ARMS}
    dg = {a: paired(gain(h[a], ACCURACY), gain(h["gspo"], ACCURACY)) for a in LORA_ARMS}
    here = (
        f"Full fine-tuning's sampled gain {iv(gain(h['gspo'])).text()}. LoRA − full, sampled gain (greedy): "
        + "; ".join(f"{LORA_ARMS[a]} {d[a].text()} ({dg[a].text()}, {collapses(h[a])} collapsed)" for a in LORA_ARMS)
    )
    if k >= LORA_SEEDS:
        verdict = "; ".join(f"{LORA_ARMS[a]} {_lora_equivalence(d[a])}" for a in LORA_ARMS)
    limits = (
        f"{k} seeds, which resolve paired sampled differences beyond ±{widths(list(d.values()))} points (the "
        "margin is ±5); GSPO, 3 MoE layers × 8 experts (top-2), ~8-token completions, 200 iterations; the "
        "learning rate 10× full fine-tuning's at every rank, not tuned per rank; the router frozen"
    )
    return here, verdict, limits


def _lora_drift(res: Results) -> tuple[str, str, str]:
    k, h, verdict = _lora(res)
    if not k:
        return "", verdict, ""
    drift = lambda rs: {seed_of(r): r.mean("drift_slot_change_rate") for r in rs}  # noqa: E731
    d = {a: paired(drift(h[a]), drift(h["gspo"])) for a in LORA_ARMS}
    here = "Expert slots moved per iteration: full fine-tuning " + span(list(drift(h["gspo"]).values()))
    for a in LORA_ARMS:
        here += f"; {LORA_ARMS[a]} {span(list(drift(h[a]).values()))}, paired {d[a].text(digits=2)} points"
    if k >= LORA_SEEDS:
        words = {"above 0": "higher", "below 0": "lower", "includes 0": "not resolved"}
        verdict = "; ".join(f"{LORA_ARMS[a]} {words[sign(d[a])]}" for a in LORA_ARMS)
    limits = (
        f"{k} seeds; per iteration (2 updates), at 10× full fine-tuning's learning rate: a LoRA step is not a full "
        "step's size, so rank and step size are confounded; 3 MoE layers × 8 experts"
    )
    return here, verdict, limits


STALENESS = "staleness"  # configs/sweeps/staleness.py: the main job at k = 0, 1, 2, 4 policy versions behind
STALENESS_SEEDS = 5  # pre-registered
STALENESS_MARGIN = 0.03  # the equivalence margin stated in its ANALYSIS: +-3 points of final sampled accuracy
LAGS = (1, 2, 4)


def _staleness_arm(algorithm: str, k: int) -> str:
    return f"{algorithm}-staleness={k}"


def _costs(d: Interval) -> str:
    return _equivalence(d, STALENESS_MARGIN, "costs nothing", "costs")


def _staleness(res: Results) -> tuple[str, str, str]:
    arms = [_staleness_arm(a, k) for a in ("grpo", "gspo") for k in (0, *LAGS)]
    k, h = shared_seeds(res.arms(STALENESS), arms)
    verdict = f"Pending: the staleness sweep has {k} of {STALENESS_SEEDS} seeds"
    if not k:
        return "", verdict, ""
    d = {
        (a, lag): paired(final(h[_staleness_arm(a, lag)]), final(h[_staleness_arm(a, 0)]))
        for a in ("grpo", "gspo")
        for lag in LAGS
    }
    flips = {key: run_means(h[_staleness_arm(*key)], "stale_router_flip_rate") for key in d}
    flipped = lambda key: f" (stale router flips {span(flips[key])})" if flips[key] else ""  # noqa: E731
    here = "; ".join(f"{a.upper()} k={lag} − k=0 {d[a, lag].text()}{flipped((a, lag))}" for a, lag in d)
    if k >= STALENESS_SEEDS:
        verdict = "; ".join(f"{a.upper()} k={lag} {_costs(d[a, lag])}" for a, lag in d if lag <= 2)
    resolve = (
        f"resolve paired differences beyond ±{widths(list(d.values()))} points" if k >= 2 else "give no interval yet"
    )
    limits = (
        f"{k} seed{'s' * (k > 1)}, which {resolve} (the margin is ±3); "
        "the main job (3 MoE layers × 8 experts, ~8-token completions, 150 iterations); one mesh: the lag's "
        "off-policyness, not an asynchronous trainer's timing"
    )
    return here, verdict, limits


CLAIMS = (
    Claim(
        "One update changes ~10% of the experts a token is routed to",
        "GSPO",
        _drift,
        ("main_job", "drift_architecture", "many_experts", DRIFT_LAW),
    ),
    Claim(
        "GRPO needs routing replay to converge on an MoE; GSPO does not",
        "GSPO",
        _replay_needed,
        (HEADLINE, "many_experts", "many_experts_r3"),
    ),
    Claim(
        "GSPO clips about two orders of magnitude more than GRPO, yet learns better",
        "GSPO",
        _clipping,
        ("main_job", "many_experts", "objectives_replay"),
    ),
    Claim(
        "~10% of routers and 94% of tokens disagree between the inference engine and the trainer",
        "R3",
        _mismatch,
        ("objectives_replay", "many_experts", DRIFT_LAW),
    ),
    Claim(
        "Replaying the engine's routing (R3) stops GRPO's collapse",
        "R3",
        _r3_collapse,
        (HEADLINE, "objectives_replay", "many_experts", "many_experts_r3"),
    ),
    Claim(
        "GSPO's sequence-level ratio keeps a sparse MoE policy stable off-policy (here it collapsed: clip range, "
        "sequence ratio, or defect?)",
        "GSPO",
        _gspo_collapse,
        (FOLLOWUP,),
    ),
    Claim(
        "RSPO (GMPO with the router-shift ratio) trains an MoE policy stably and better",
        "RSPO",
        _rspo,
        (FOLLOWUP,),
    ),
    Claim(
        "Weight replay, RSPO's router-shift ratio, IcePop and the geometric sequence mask steady an MoE policy",
        "RSPO, IcePop",
        _instruments,
        (HEADLINE,),
    ),
    Claim(
        "Token-level IS breaks an off-policy sparse-MoE policy through routing drift, where an on-policy or dense "
        "one holds",
        "GSPO, R3",
        _mechanism,
        ("mechanism_search", SPLIT),
    ),
    Claim(
        "Each DAPO ingredient adds to the last (30 → 36 → 38 → 42 → 50)", "DAPO", _dapo, (DAPO, "dapo_ladder", SAMPLING)
    ),
    Claim(
        "Bounded staleness of 1–2 policy versions costs nothing",
        "AReaL, PipelineRL",
        _staleness,
        (STALENESS,),
    ),
    Claim(
        "LoRA RL at rank 1 matches full fine-tuning (when the experts get adapters; attention-only falls short)",
        "LoRA Without Regret",
        _lora_matches,
        (LORA,),
    ),
    Claim(
        "Low-rank updates with a frozen router move routing less than full fine-tuning",
        "none (asked here)",
        _lora_drift,
        (LORA,),
    ),
)

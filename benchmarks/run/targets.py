"""Issue 12's targets judged from a run's results: each figure, its target, and whether it was met."""

from __future__ import annotations

from benchmarks.run.iterations import SPLIT


def targets(results: dict) -> list[tuple[str, str, str, bool]]:
    """(figure, measured, target, met) for each of issue 12's targets whose section ran."""
    rows = []
    add = lambda figure, value, target, met: rows.append((figure, value, target, bool(met)))
    for name, r in results.get("train", {}).items():  # `tiny` (the smoke test) stands in for the default config
        bar = 0.35 if name == "bench" else 0.20
        add(f"train-step MFU, {name}", f"{r['mfu']:.1%}", f">= {bar:.0%}", r["mfu"] >= bar)
    if "loss" in results:
        worst = max(r["share_of_train_step"] for r in results["loss"]["by_objective"].values())
        add("policy_loss share of a train step (worst objective)", f"{worst:.1%}", "<= 3%", worst <= 0.03)
    if "sampler" in results:
        s = results["sampler"]
        tps = {r["batch"]: r["tokens_per_s"] for r in s["by_batch"]}
        add(
            f"sampler at batch {s['batch']} against the naive decoder",
            f"{s['speedup_vs_naive']:.1f}x",
            ">= 15x",
            s["speedup_vs_naive"] >= 15,
        )
        top = max(b for b in tps if b <= 128)
        rising = all(tps[a] < tps[b] for a, b in zip(sorted(tps), sorted(tps)[1:]) if b <= top)
        add(f"decode tokens/s rising with batch up to {top}", "yes" if rising else "no", "yes", rising)
    if "iteration" in results:
        it = results["iteration"]
        on, split = it["drift_on"], it["drift_on"]["split"]
        add("one RL iteration, `iteration` shape, drift on", f"{on['seconds']:.2f} s", "<= 3 s", on["seconds"] <= 3)
        largest = max(SPLIT, key=split.get)
        add("its largest part", largest.removesuffix("_seconds"), "rollout", largest == "rollout_seconds")
        compiles = sum(r["compiles_after_warmup"] for k, r in it.items() if k != "compilation_cache")
        add("compiles during iterations 2..5", str(compiles), "0", compiles == 0)
        cold, warm = on["seconds_to_first_iteration"], it["compilation_cache"]["seconds_to_first_iteration_warm"]
        add("first finished iteration, empty compilation cache", f"{cold:.1f} s", "<= 10 s", cold <= 10)
        add("first finished iteration, cache filled by a previous run", f"{warm:.1f} s", "<= 10 s", warm <= 10)
    if "diagnostics" in results:
        share = results["diagnostics"]["share"]
        add("drift + routing diagnostics, share of an iteration", f"{share:.1%}", "<= 15%", share <= 0.15)
    return rows


def print_targets(results: dict) -> None:
    rows = targets(results)
    if not rows:
        return
    width = max(len(r[0]) for r in rows)
    print(f"\n{'figure':{width}}  {'measured':>10}  {'target':>9}  met")
    for figure, value, target, met in rows:
        print(f"{figure:{width}}  {value:>10}  {target:>9}  {'yes' if met else 'no'}")

"""Expert-routing drift between checkpoints: each snapshot routes one fixed probe set (held-out prompts
with completions sampled once by one snapshot), and every pair is compared (slot change, flip rates per
layer, Jaccard, router KL / TV). Reads the run only, so it works on a finished run and on a running one
(a save still in flight, with no commit marker, is left out).

Usage:
  python scripts/drift.py WORKDIR                             # every finished step -> WORKDIR-drift/
  python scripts/drift.py WORKDIR --steps 10,20,40 --out /tmp/drift
  python scripts/drift.py --a runs/grpo:100 --b runs/gspo/checkpoints/100   # two checkpoints, one model
  python scripts/drift.py WORKDIR --probe /tmp/drift/probe.npz  # score the same probe set again

Writes, in --out (default: beside the run, WORKDIR-drift/; never into the run unless --out says so):
  drift.json          every pair's metrics: pairs[metric][i][j] compares snapshot i (old) with j (new);
                      from_first and from_previous, the curves
  drift_heatmap.png   flip rate of each MoE layer (rows) from the first snapshot, per snapshot (columns)
  drift_curve.png     slot change, flip rates, router TV and KL from the first and from the previous snapshot
  probe.npz           the probe set (--probe reuses it); routings.npz: each snapshot's top-k [S, L, N, K]
and prints a table. Exit codes: 0 done; 2 refused, one line on stderr (no config.json, fewer than two
finished steps, an unknown step, a dense model, two different models, a bad probe file).
"""

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # this project never uses PyTorch

import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from gspo_jax import snapshots  # noqa: E402
from gspo_jax.exit_codes import EXIT_REFUSED  # noqa: E402
from gspo_jax.plots import save_figure  # noqa: E402
from gspo_jax.validation import ConfigError  # noqa: E402

# The printed table's columns, as (metric, header).
COLUMNS = (
    ("slot_change_rate", "slot_chg"),
    ("router_flip_rate", "flip"),
    ("token_any_flip", "any_flip"),
    ("flips_per_token", "flips/tok"),
    ("jaccard", "jaccard"),
    ("router_kl", "kl"),
    ("router_tv", "tv"),
)
RATES = ("slot_change_rate", "router_flip_rate", "token_any_flip", "router_tv")


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    parser.add_argument("workdir", nargs="?", help="a run's workdir: compare its finished checkpoints")
    parser.add_argument("--steps", help="comma-separated steps of WORKDIR (default: every finished one)")
    parser.add_argument("--a", help="first checkpoint, WORKDIR:STEP or WORKDIR/checkpoints/STEP (with --b)")
    parser.add_argument("--b", help="second checkpoint, the same model as --a")
    parser.add_argument("--out", help="output directory (default: WORKDIR-drift beside the run)")
    parser.add_argument("--probe", help="reuse this probe set (a probe.npz this script wrote)")
    parser.add_argument("--probe_step", type=int, help="the snapshot that samples the probe (default: the first)")
    parser.add_argument("--num_prompts", type=int, help="held-out prompts in the probe set (default 64)")
    parser.add_argument("--seed", type=int, help="picks the prompts and the sampling key (default 0)")
    parser.add_argument("--temperature", type=float, help="probe sampling temperature (default: the run's; 0 greedy)")
    parser.add_argument("--batch_size", type=int, default=64, help="rows per forward (default %(default)s)")
    args = parser.parse_args(argv)
    if (args.workdir is None) == (args.a is None and args.b is None) or (args.a is None) != (args.b is None):
        parser.error("give WORKDIR, or --a and --b (not both)")
    return args


def checkpoint(text: str) -> tuple[Path, int]:
    """(workdir, step) from WORKDIR:STEP or WORKDIR/checkpoints/STEP."""
    head, _, tail = text.rpartition(":")
    if head and tail.isdigit():
        return Path(head), int(tail)
    path = Path(text)
    if path.name.isdigit() and path.parent.name == snapshots.CHECKPOINT_DIR:
        return path.parent.parent, int(path.name)
    raise ConfigError(f"{text!r} is not a checkpoint: expected WORKDIR:STEP or WORKDIR/{snapshots.CHECKPOINT_DIR}/STEP")


def choose(args) -> tuple[list[snapshots.Snapshot], snapshots.Snapshot, Path]:
    """The snapshots to compare, the one that samples the probe, and the output directory."""
    if args.workdir is not None:
        run = snapshots.open_run(args.workdir)
        requested = None
        if args.steps:
            try:
                requested = [int(s) for s in args.steps.split(",") if s.strip()]
            except ValueError:
                raise ConfigError(f"--steps={args.steps!r}: expected comma-separated step numbers") from None
        chosen = snapshots.select(run, requested)
        probe_step = chosen[0].step if args.probe_step is None else args.probe_step
        probe_from = snapshots.select(run, [probe_step], minimum=1)[0]
        out = run.workdir.parent / f"{run.workdir.name}-drift"
        return chosen, probe_from, Path(args.out) if args.out else out
    if args.steps or args.probe_step is not None:
        raise ConfigError("--steps and --probe_step go with WORKDIR; with --a / --b the probe comes from --a")
    (wa, sa), (wb, sb) = checkpoint(args.a), checkpoint(args.b)
    a = snapshots.open_run(wa)
    b = a if wb.resolve() == wa.resolve() else snapshots.open_run(wb)
    snapshots.check_comparable(a, b)
    pair = [snapshots.select(r, [s], minimum=1)[0] for r, s in ((a, sa), (b, sb))]
    pair = [snapshots.Snapshot(s.run, s.step, f"{s.run.workdir.name}:{s.step}") for s in pair]
    out = a.workdir.parent / f"{a.workdir.name}-{sa}-drift-{b.workdir.name}-{sb}"
    return pair, pair[0], Path(args.out) if args.out else out


def make_or_load_probe(args, probe_from: snapshots.Snapshot) -> snapshots.Probe:
    """The --probe file, or a new probe set sampled by `probe_from`."""
    if args.probe:
        probe = snapshots.Probe.load(args.probe)
    else:
        probe = snapshots.make_probe(
            probe_from.run,
            snapshots.load_params(probe_from.run, probe_from.step),
            step=probe_from.step,
            num_prompts=64 if args.num_prompts is None else args.num_prompts,
            seed=args.seed or 0,
            temperature=args.temperature,
            batch_size=args.batch_size,
        )
    probe.check_fits(probe_from.run)
    return probe


def table(report: dict) -> str:
    """Per snapshot: every metric from the first snapshot, then flip rate and KL from the previous one."""
    first, prev = report["from_first"], report["from_previous"]
    width = max(8, *(len(s["label"]) for s in report["snapshots"]))
    lines = [
        f"{'':>{width}}  {'from the first':<{10 * len(COLUMNS)}}| from the previous",
        f"{'snapshot':>{width}} " + "".join(f"{h:>10}" for _, h in COLUMNS) + f" |{'flip':>10}{'kl':>10}",
    ]
    for i, snap in enumerate(report["snapshots"]):
        cells = "".join(f"{first[k][i]:10.4g}" for k, _ in COLUMNS)
        tail = "".join(
            f"{'-':>10}" if v is None else f"{v:10.4g}" for v in (prev[k][i] for k in ("router_flip_rate", "router_kl"))
        )
        lines.append(f"{snap['label']:>{width}} {cells} |{tail}")
    return "\n".join(lines)


def x_axis(report: dict) -> tuple[list, str]:
    """Step numbers when every snapshot is of one run, else positions labelled on the axis."""
    snaps = report["snapshots"]
    if len({s["workdir"] for s in snaps}) == 1:
        return [s["step"] for s in snaps], "step"
    return list(range(len(snaps))), "snapshot"


def plot_heatmap(report: dict, path: Path) -> Path:
    """Flip rate from the first snapshot, MoE layer × snapshot."""
    rate_LS = np.array(report["from_first"]["flip_rate_per_layer"]).T
    labels = [s["label"] for s in report["snapshots"]]
    size = (max(4.0, 0.5 * len(labels) + 2), max(3.0, 0.25 * rate_LS.shape[0] + 1.5))
    fig = Figure(figsize=size, layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(rate_LS, aspect="auto", origin="lower", cmap="viridis", vmin=0.0, interpolation="nearest")
    every = max(1, len(labels) // 20)
    ax.set_xticks(range(0, len(labels), every), labels[::every], rotation=45 if every > 1 or len(labels) > 8 else 0)
    layers = report["moe_layers"]
    every = max(1, len(layers) // 24)
    ax.set_yticks(range(0, len(layers), every), layers[::every])
    xlabel = x_axis(report)[1]
    ax.set(title=f"Router flip rate from {xlabel} {labels[0]}", xlabel=xlabel, ylabel="MoE layer")
    fig.colorbar(image, ax=ax, label="flip rate")
    return save_figure(fig, path)


def plot_curve(report: dict, path: Path) -> Path:
    """Rates (top) and router KL (bottom), from the first snapshot (left) and from the previous (right)."""
    xs, xlabel = x_axis(report)
    fig = Figure(figsize=(10.0, 6.5), layout="constrained")
    axes = fig.subplots(2, 2, sharex=True)
    for col, (name, series) in enumerate((("first", report["from_first"]), ("previous", report["from_previous"]))):
        for key in RATES:
            pts = [(x, v) for x, v in zip(xs, series[key]) if v is not None]
            axes[0, col].plot(*zip(*pts), marker=".", label=key)
        pts = [(x, v) for x, v in zip(xs, series["router_kl"]) if v is not None]
        axes[1, col].plot(*zip(*pts), marker=".", color="C4", label="router_kl")
        axes[0, col].set(title=f"from the {name} snapshot", ylabel="rate")
        axes[1, col].set(xlabel=xlabel, ylabel="router KL")
        for ax in axes[:, col]:
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
    for ax in axes[1]:
        if xlabel == "snapshot":
            ax.set_xticks(xs, [s["label"] for s in report["snapshots"]])
        else:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return save_figure(fig, path)


def drift(args) -> dict:
    """Everything the module docstring says; returns the report (drift.json's content)."""
    given = [f for f in ("num_prompts", "seed", "temperature", "probe_step") if getattr(args, f) is not None]
    if args.probe and given:
        raise ConfigError(f"--probe gives the probe set: --{', --'.join(given)} would not be used")
    if args.batch_size < 1 or (args.num_prompts is not None and args.num_prompts < 1):
        raise ConfigError(f"--batch_size={args.batch_size} and --num_prompts={args.num_prompts} must be >= 1")
    chosen, probe_from, out = choose(args)
    probe = make_or_load_probe(args, probe_from)
    skipped = lambda s, e: print(f"warning: step {s.step} of {s.run.workdir} is gone ({e}); skipped", file=sys.stderr)
    kept, routings = snapshots.route_snapshots(chosen, probe, batch_size=args.batch_size, on_skip=skipped)
    if len(kept) < 2:
        raise ConfigError(f"fewer than two snapshots left to compare: {[s.label for s in kept]}")
    report = snapshots.drift_report(kept, snapshots.drift_matrix(routings), probe)

    out.mkdir(parents=True, exist_ok=True)
    if not (args.probe and Path(args.probe).resolve() == (out / snapshots.PROBE_FILE).resolve()):
        probe.save(out / snapshots.PROBE_FILE)
    np.savez(out / "routings.npz", topk_SLNK=np.stack([r.topk_LNK for r in routings]), labels=[s.label for s in kept])
    (out / "drift.json").write_text(json.dumps(report, indent=1))
    B, source = probe.tokens_BT.shape[0], f"{Path(probe.meta['workdir']).name}:{probe.meta['step']}"
    print(f"routing drift on {B} probe sequences ({probe.num_tokens} completion tokens, sampled by {source})")
    print(table(report))
    plots = plot_heatmap(report, out / "drift_heatmap.png"), plot_curve(report, out / "drift_curve.png")
    for path in (out / "drift.json", *plots):
        print(f"wrote {path}")
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        drift(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A sweep's report: every run's metrics.jsonl aggregated per arm (the runs that differ only in seed)
into `<workroot>/report.md` and PNG figures, on a finished sweep or a partly finished one.

Metric keys are discovered from the rows: a diagnostic no run logged is "—", never a guess. Figures
are built with `matplotlib.figure.Figure` and saved through its Agg canvas (no pyplot), as gspo_jax.plots.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from gspo_jax import provenance
from gspo_jax.plots import save_figure, series
from gspo_jax.study import analysis, sweeps
from gspo_jax.writers import read_metrics

ACCURACY = "eval_accuracy"  # held-out greedy accuracy: what the report ranks arms by
SAMPLED = "eval_accuracy_sampled"  # held-out accuracy at the rollout's sampling settings, where logged
COLLAPSE_DROP = analysis.COLLAPSE_DROP  # collapsed: final accuracy this far below the step-0 one
LOSS_KEYS = ("loss", "total_loss")  # ... or one of these non-finite at some step
# Diagnostics in the arm table, where logged: mean over a run's training steps, then over its seeds.
DIAGNOSTICS = (
    ("clip_frac", "token clip fraction"),
    ("seq_clip_frac", "sequence clip fraction"),
    ("drift_slot_change_rate", "routing drift: expert slots changed π_θ vs π_old"),
    ("drift_router_flip_rate", "routing drift: router top-k flips"),
    ("mismatch_kl_k3", "sampler–trainer mismatch: KL (k3)"),
    ("mismatch_router_flip_rate", "sampler–trainer mismatch: router flips"),
    ("approx_kl", "KL(π_old‖π_θ) (k3)"),
    ("kl_ref", "KL to π_ref"),
)
CLIP_KEYS = ("clip_frac", "seq_clip_frac", "clip_frac_flipped", "clip_frac_unflipped")
FLIPPED_KEYS = ("grad_share_flipped", "flipped_frac")  # the flipped tokens' share of the loss gradient, of tokens
_PER_LAYER = re.compile(r"^(drift_\w+?)_layer(\d+)$")


@dataclass
class RunResult:
    run: sweeps.Run
    status: str
    records: list[dict]
    attempts: list[dict] = field(default_factory=list)
    tail: list[str] = field(default_factory=list)
    device: str = ""  # where its starts ran (gspo_jax.provenance); "" for runs made before that was kept

    @property
    def last_step(self) -> int | None:
        return self.records[-1]["step"] if self.records else None

    def values(self, key: str) -> list[float]:
        return [v for v in series(self.records, key)[1] if math.isfinite(v)]

    def mean(self, key: str) -> float | None:
        """Mean over the training steps (step 0 is the warm start's evaluation only)."""
        vs = [v for s, v in zip(*series(self.records, key), strict=True) if s > 0 and math.isfinite(v)]
        return sum(vs) / len(vs) if vs else None

    def accuracy(self, key: str = ACCURACY) -> dict[str, float] | None:
        """final (gspo_jax.study.analysis's rule: the mean of the last 3 evaluations after step 0), last (the
        last evaluation), best, start (step 0) and auc (the trapezoid area under the held-out accuracy
        curve `key` over its step span, divided by that span: the curve's mean)."""
        points = [(s, v) for s, v in zip(*series(self.records, key), strict=True) if math.isfinite(v)]
        if not points:
            return None
        steps, acc = [s for s, _ in points], [v for _, v in points]
        area = sum((b - a) * (x + y) / 2 for a, b, x, y in zip(steps, steps[1:], acc, acc[1:]))
        auc = area / (steps[-1] - steps[0]) if len(steps) > 1 else acc[0]
        start = acc[0] if steps[0] == 0 else math.nan
        return dict(final=analysis.final_value(points), last=acc[-1], best=max(acc), start=start, auc=auc)

    def collapse_key(self) -> str:
        """The accuracy the collapse rule reads: the sampled one where logged, else the greedy one."""
        return SAMPLED if self.values(SAMPLED) else ACCURACY

    def collapsed(self, drop: float = COLLAPSE_DROP) -> bool:
        acc = self.accuracy(self.collapse_key())
        non_finite = any(not math.isfinite(v) for k in LOSS_KEYS for v in series(self.records, k)[1])
        start, final = (acc["start"], acc["final"]) if acc else (math.nan, math.nan)
        return analysis.collapsed(start, final, non_finite, drop)

    def seconds(self) -> float | None:
        return sum(a["seconds"] for a in self.attempts) if self.attempts else None


def collect(sweep: sweeps.Sweep, root: Path) -> list[RunResult]:
    results = []
    for run in sweep.runs:
        run_dir = sweeps.workdir(root, run)
        state = sweeps.read_state(run_dir)
        attempts, tail = state.get("attempts", []), state.get("tail", [])
        device = provenance.devices_of(run_dir)
        results.append(RunResult(run, sweeps.status(run_dir), read_metrics(run_dir), attempts, tail, device))
    return results


def _arms(results: Sequence[RunResult]) -> dict[str, list[RunResult]]:
    arms: dict[str, list[RunResult]] = {}
    for r in results:
        arms.setdefault(r.run.arm, []).append(r)
    return arms


def analysis_text(sweep: sweeps.Sweep, root: str | Path) -> str:
    """The report's analysis section alone (what `scripts/sweep.py --report` prints)."""
    results = collect(sweep, Path(root))
    return "\n".join(analysis_section(sweep, results, _arms(results))) + "\n"


def compare(sweep: sweeps.Sweep, root: str | Path, other: str | Path) -> str:
    """Each run finished in both workroots: its final greedy and sampled accuracy in each and the
    difference (a rerun of a committed sweep into a fresh workroot against the committed one)."""
    here = {r.run.name: r for r in collect(sweep, Path(root)) if r.status == "done"}
    there = {r.run.name: r for r in collect(sweep, Path(other)) if r.status == "done"}
    rows, diffs = [], []
    for name in (n for n in here if n in there):
        row = [f"`{name}`"]
        for key in (ACCURACY, SAMPLED):
            a, b = here[name].accuracy(key), there[name].accuracy(key)
            if a and b:
                diffs.append(a["final"] - b["final"])
                row += [f"{100 * a['final']:.1f}", f"{100 * b['final']:.1f}", f"{100 * diffs[-1]:+.1f}"]
            else:
                row += ["—", "—", "—"]
        rows.append(row)
    lines = [f"# {sweep.name}: {root} against {other}", ""]
    lines += _table(
        ["run", *(f"{k} {c}" for k in ("greedy", "sampled") for c in ("here", "there", "difference"))], rows
    )
    if diffs:
        worst = max(abs(d) for d in diffs)
        lines += ["", f"{len(rows)} runs in both; final accuracies differ by {100 * worst:.1f} points at most, "]
        lines[-1] += f"{100 * float(np.mean(np.abs(diffs))):.1f} on average."
    else:
        lines += ["", "No run is finished in both workroots."]
    return "\n".join(lines) + "\n"


def write_report(sweep: sweeps.Sweep, root: str | Path) -> Path:
    """Writes `<root>/report.md` and its figures (`<root>/report/*.png`); returns the report's path."""
    root = Path(root)
    results = collect(sweep, root)
    arms = _arms(results)
    figures = _figures(arms, root / "report")
    text = _markdown(sweep, root, results, arms, figures)
    path = root / "report.md"
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return path


# ------------------------------------------------------------------ markdown


def _fmt(values: Sequence[float], digits: int = 3) -> str:
    """mean ± sample standard deviation over seeds; '—' with none, the mean alone with one."""
    vs = [v for v in values if v is not None and math.isfinite(v)]
    if not vs:
        return "—"
    mean = f"{np.mean(vs):.{digits}g}"
    return f"{mean} ± {np.std(vs, ddof=1):.2g}" if len(vs) > 1 else mean


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return [_row(header), _row(["---"] * len(header)), *(_row(r) for r in rows)]


def _markdown(sweep, root: Path, results, arms, figures: Sequence[Path]) -> str:
    statuses = ("done", "failed", "stopped", "unfinished", "not started")
    counts = {s: sum(r.status == s for r in results) for s in statuses}
    lines = [
        f"# Sweep report: {sweep.name}",
        "",
        f"Base config `{sweep.base}`; workroot `{root}`; written {sweeps.now()}.",
        "",
        f"{len(results)} runs: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n) + ".",
        "",
    ]
    lines += analysis_section(sweep, results, arms)
    lines += _arms_section(results, arms)
    lines += _diagnostics_section(results, arms)
    lines += _runs_section(results)
    if figures:
        lines += _figures_section(root, figures)
    return "\n".join(lines) + "\n"


def analysis_section(sweep, results: Sequence[RunResult], arms: Mapping[str, list[RunResult]]) -> list[str]:
    """The pre-registered analysis (gspo_jax.study.analysis): the sweep's own statement, then each arm's
    final accuracy with its 95% interval, paired differences to the control arm, and collapse counts."""
    lines = ["## Analysis", ""]
    if sweep.analysis:
        lines += [sweep.analysis, ""]
    lines += [
        f"The rule (gspo_jax/study/analysis.py): a run's final accuracy is the mean of its last {analysis.FINAL_EVALS} "
        "held-out evaluations after step 0, greedy and sampled; the gain is that minus step 0. Per arm: mean ± sd "
        "over its finished seeds and the 95% t-interval of the mean, in points.",
        "",
    ]
    done = {arm: [r for r in rs if r.status == "done"] for arm, rs in arms.items()}
    keys = [k for k in (ACCURACY, SAMPLED) if any(r.values(k) for r in results)]
    rows = []
    for arm, rs in done.items():
        accs = {k: [a for a in (r.accuracy(k) for r in rs) if a] for k in keys}
        row = [f"`{arm}`", str(len(rs))]
        for k in keys:
            final = analysis.interval([a["final"] for a in accs[k]])
            gain = analysis.interval([a["final"] - a["start"] for a in accs[k]])
            row += [final.text(signed=False) if final else "—", gain.text() if gain else "—"]
        rows.append(row)
    names = {ACCURACY: "greedy", SAMPLED: "sampled"}
    lines += _table(["arm", "seeds", *(f"{names[k]} {c}" for k in keys for c in ("final", "gain"))], rows)
    lines += _paired_section(sweep, done, keys)
    return lines + _collapse_section(done)


def _by_seed(rs: Sequence[RunResult], key: str) -> dict[int, float]:
    out = {}
    for r in rs:
        acc = r.accuracy(key)
        if acc is not None:
            out[r.run.overrides.get(sweeps.SEED, 0)] = acc["final"]
    return out


def _paired_section(sweep, done: Mapping[str, list[RunResult]], keys: Sequence[str]) -> list[str]:
    """Each arm's final accuracy minus its control's, per seed, and the 95% interval over seeds."""
    if not sweep.control:
        return []
    lines = ["", "### Paired differences to the control arm", ""]
    lines += ["Final accuracy (the rule above) minus the control arm's of the same seed, in points; per seed, then "]
    lines[-1] += "mean ± sd and the 95% t-interval of the mean difference."
    lines += [""]
    rows = []
    for arm, control in sweep.control.items():
        row = [f"`{arm}`", f"`{control}`"]
        for k in keys:
            diffs, iv = analysis.paired(_by_seed(done.get(arm, []), k), _by_seed(done.get(control, []), k))
            row += [", ".join(f"{100 * d:+.1f}" for d in diffs.values()) or "—", iv.text() if iv else "—"]
        rows.append(row)
    names = {ACCURACY: "greedy", SAMPLED: "sampled"}
    header = ["arm", "control", *(f"{names[k]} {c}" for k in keys for c in ("per seed", "mean (95% CI)"))]
    return lines + _table(header, rows)


def _collapse_section(done: Mapping[str, list[RunResult]]) -> list[str]:
    """How many runs collapse under the rule and under a looser and a stricter threshold."""
    drops = analysis.COLLAPSE_DROPS
    lines = ["", "### Collapse", ""]
    lines += [
        f"A run collapsed if its final accuracy is more than {100 * COLLAPSE_DROP:.0f} points below its step-0 "
        f"accuracy, or a logged {' / '.join(f'`{k}`' for k in LOSS_KEYS)} is non-finite; the accuracy is the sampled "
        f"one where the run logged it, else the greedy one. Counts at {', '.join(f'{100 * d:.0f}' for d in drops)} "
        "points (looser, the rule, stricter).",
        "",
    ]
    rows = []
    for arm, rs in done.items():
        read = sorted({"sampled" if r.collapse_key() == SAMPLED else "greedy" for r in rs}) or ["—"]
        rows.append([f"`{arm}`", "/".join(read), *(f"{sum(r.collapsed(d) for r in rs)}/{len(rs)}" for d in drops)])
    return lines + _table(["arm", "accuracy read", *(f"> {100 * d:.0f} points" for d in drops)], rows)


def _arms_section(results: Sequence[RunResult], arms: Mapping[str, list[RunResult]]) -> list[str]:
    """Accuracy, collapses and wall time per arm, over its finished runs (with sampled accuracy and the
    gains where a run logged it)."""
    lines = [
        "## Arms",
        "",
        f"Per arm (the runs that differ only in seed), over its finished runs: mean ± sample standard deviation "
        f"over seeds (one seed: the value alone). Accuracy is held-out greedy accuracy (`{ACCURACY}`); final is "
        f"the mean of the last {analysis.FINAL_EVALS} evaluations after step 0; AUC is the area under its curve "
        "divided by the step span (the curve's mean). Collapsed: by the rule above. Wall time: the run's "
        "attempts, summed.",
        "",
    ]
    sampled = any(r.values(SAMPLED) for r in results)
    if sampled:
        lines[-2] += (
            f" Sampled: held-out accuracy at the rollout's temperature, top-k and top-p (`{SAMPLED}`), at step 0 "
            "and at the end, and the gain (final − step 0) of each accuracy, mean ± sd over seeds."
        )
    rows = []
    for arm, rs in arms.items():
        done = [r for r in rs if r.status == "done"]
        acc = [a for a in (r.accuracy() for r in done) if a is not None]
        row = [
            f"`{arm}`",
            f"{len(done)}/{len(rs)}",
            _fmt([a["start"] for a in acc]),
            _fmt([a["final"] for a in acc]),
            _fmt([a["best"] for a in acc]),
            _fmt([a["auc"] for a in acc]),
        ]
        if sampled:
            acc_s = [a for a in (r.accuracy(SAMPLED) for r in done) if a is not None]
            row += [
                _fmt([a["final"] - a["start"] for a in acc]),
                _fmt([a["start"] for a in acc_s]),
                _fmt([a["final"] for a in acc_s]),
                _fmt([a["final"] - a["start"] for a in acc_s]),
            ]
        row += [
            f"{sum(r.collapsed() for r in done)}/{len(done)}" if done else "—",
            _fmt([r.seconds() for r in done], 3),
        ]
        rows.append(row)
    header = ["arm", "finished", "step-0 acc", "final acc", "best acc", "AUC"]
    if sampled:
        header += ["gain", "step-0 sampled", "final sampled", "sampled gain"]
    return lines + _table([*header, "collapsed", "wall time (s)"], rows)


def _diagnostics_section(results: Sequence[RunResult], arms: Mapping[str, list[RunResult]]) -> list[str]:
    """The `DIAGNOSTICS` some run logged, per arm; those none did, named."""
    present = [(k, d) for k, d in DIAGNOSTICS if any(r.values(k) for r in results)]
    absent = [k for k, _ in DIAGNOSTICS if k not in dict(present)]
    lines = ["", "## Diagnostics", "", "Mean over a run's training steps, then mean ± sd over the arm's seeds."]
    lines += [""] + [f"- `{k}`: {d}" for k, d in present]
    if absent:
        lines += [f"- not logged by any run: {', '.join(f'`{k}`' for k in absent)}"]
    lines += [""]
    rows = [
        [f"`{arm}`", *(_fmt([r.mean(k) for r in rs if r.status == "done"]) for k, _ in present)]
        for arm, rs in arms.items()
    ]
    return lines + _table(["arm", *(f"`{k}`" for k, _ in present)], rows)


def _runs_section(results: Sequence[RunResult]) -> list[str]:
    """Every run's status, progress and wall time (and device, where runs recorded it: a wall time is
    read against its machine); the unfinished named, each failure's last log lines."""
    lines = ["", "## Runs", ""]
    rows, devices = [], any(r.device for r in results)
    for r in results:
        acc = r.accuracy()
        rows.append(
            [
                f"`{r.run.name}`",
                r.status,
                "—" if r.last_step is None else str(r.last_step),
                "—" if acc is None else f"{acc['final']:.3g}",
                str(len(r.attempts)),
                "—" if r.seconds() is None else f"{r.seconds():.0f}",
                *([r.device or "—"] if devices else []),
            ]
        )
    header = ["run", "status", "last step", "final acc", "attempts", "wall time (s)", *(["device"] if devices else [])]
    lines += _table(header, rows)
    missing = [r.run.name for r in results if r.status != "done"]
    if missing:
        lines += ["", "Not finished (left out of the arm tables): " + ", ".join(f"`{n}`" for n in missing) + "."]
    for r in results:
        if r.status == "failed":
            lines += ["", f"### `{r.run.name}` failed (exit {r.attempts[-1]['rc']}), last lines of its log", "", "```"]
            lines += [*r.tail, "```"]
    return lines


def _figures_section(root: Path, figures: Sequence[Path]) -> list[str]:
    """The figures, linked relative to the report."""
    lines = ["", "## Figures", "", "Every run with metrics, finished or not. Lines: the mean over an arm's"]
    lines[-1] += " seeds; bands: their range (min to max)."
    lines += [""]
    return lines + [f"![{p.stem}]({p.relative_to(root).as_posix()})" for p in figures]


# ------------------------------------------------------------------ figures


def _band(results: Sequence[RunResult], key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(steps, mean, min, max) of `key` over the runs, at each step some run logged it finitely."""
    by_step: dict[int, list[float]] = {}
    for r in results:
        for s, v in zip(*series(r.records, key), strict=True):
            if math.isfinite(v):
                by_step.setdefault(s, []).append(v)
    steps = sorted(by_step)
    vals = [np.asarray(by_step[s]) for s in steps]
    return (
        np.asarray(steps),
        np.asarray([v.mean() for v in vals]),
        np.asarray([v.min() for v in vals]),
        np.asarray([v.max() for v in vals]),
    )


LINESTYLES = ("-", "--", ":", "-.")


def _styles(arms: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Each arm's line: its colour from its algorithm (the name's first part), its line style from the
    rest (e.g. `replay=R3`), so 27 arms read as 9 colours × 3 styles rather than cycling 10 colours."""
    heads = list(dict.fromkeys(a.split("-", 1)[0] for a in arms))
    rests = list(dict.fromkeys(a.partition("-")[2] for a in arms))
    if len(rests) > len(LINESTYLES):  # too many variants for line styles: one colour per arm
        heads, rests = list(arms), [""]
    cmap = matplotlib.colormaps["tab10" if len(heads) <= 10 else "tab20"]
    style = {}
    for a in arms:
        head, rest = (a, "") if rests == [""] else (a.split("-", 1)[0], a.partition("-")[2])
        style[a] = dict(color=cmap(heads.index(head) % cmap.N), linestyle=LINESTYLES[rests.index(rest)])
    return style


LEGEND_INSIDE = 40  # longest arm name (characters) a panel's own legend takes without hiding curves


def _legend_place(arms: Sequence[str]) -> str:
    """Where the arms' legend goes: in each panel (a few short names), below the panels (a few long
    ones, e.g. a ladder's growing names) or beside them (many)."""
    if len(arms) > 6:
        return "right"
    return "below" if max(map(len, arms), default=0) > LEGEND_INSIDE else "panel"


def _legend(fig: Figure, axes: Sequence[Any], arms: Sequence[str]) -> None:
    """The arms' legend, placed by `_legend_place`, so no curve is hidden."""
    place = _legend_place(arms)
    if place == "panel":
        for ax in axes:
            if ax.get_visible() and ax.has_data():
                ax.legend(fontsize="small")
        return
    handles, labels = next((ax.get_legend_handles_labels() for ax in axes if ax.has_data()), ([], []))
    if place == "below":
        fig.legend(handles, labels, loc="outside lower center", fontsize="small")
    else:
        fig.legend(handles, labels, loc="outside right upper", fontsize="small", ncols=math.ceil(len(arms) / 30))


def _figure(panels: int, arms: Sequence[str]) -> tuple[Figure, np.ndarray]:
    """A figure of `panels` panels, two to a row, grown for a legend beside or below them."""
    cols, rows = min(panels, 2), math.ceil(panels / 2)
    place, n = _legend_place(arms), len(arms)
    extra_w = 3.2 * math.ceil(n / 30) if place == "right" else 0.0
    extra_h = 0.25 * n + 0.3 if place == "below" else 0.0
    width = max(6.4 * cols + extra_w, 0.075 * max(map(len, arms), default=0) if place == "below" else 0.0)
    fig = Figure(figsize=(width, max(4.0 * rows, 0.2 * min(n, 30) + 1.0) + extra_h), layout="constrained")
    return fig, fig.subplots(rows, cols, squeeze=False).ravel()


def _curves(arms: Mapping[str, list[RunResult]], keys: Sequence[str], title: str, ylabel: str) -> Figure | None:
    """One panel per key with data: each arm's mean curve over its seeds, their range as a band."""
    keys = [k for k in keys if any(r.values(k) for rs in arms.values() for r in rs)]
    if not keys:
        return None
    fig, axes = _figure(len(keys), list(arms))
    style = _styles(list(arms))
    for ax, key in zip(axes, keys, strict=False):
        for arm, rs in arms.items():
            steps, mean, low, high = _band(rs, key)
            if len(steps):
                ax.plot(steps, mean, **style[arm], label=arm, marker="." if len(steps) < 30 else None)
                ax.fill_between(
                    steps, low, high, color=style[arm]["color"], alpha=0.2 if len(arms) <= 6 else 0.06, linewidth=0
                )
        ax.set(title=key, xlabel="step", ylabel=ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax in axes[len(keys) :]:
        ax.set_visible(False)
    _legend(fig, axes, list(arms))
    fig.suptitle(title)
    return fig


def _per_layer(arms: Mapping[str, list[RunResult]]) -> Figure | None:
    """Per-layer drift keys (`drift_<what>_layer<i>`): each arm's mean over steps and seeds, by layer."""
    families: dict[str, set[int]] = {}
    for rs in arms.values():
        for r in rs:
            for key in {k for rec in r.records for k in rec}:
                if m := _PER_LAYER.match(key):
                    families.setdefault(m[1], set()).add(int(m[2]))
    if not families:
        return None
    fig, axes = _figure(len(families), list(arms))
    style = _styles(list(arms))
    for ax, (family, layers) in zip(axes, sorted(families.items()), strict=False):
        layers = sorted(layers)
        for arm, rs in arms.items():
            means = [[m for r in rs if (m := r.mean(f"{family}_layer{j}")) is not None] for j in layers]
            ys = [np.mean(m) if m else np.nan for m in means]
            ax.plot(layers, ys, **style[arm], marker="o", label=arm)
        ax.set(title=family, xlabel="MoE layer", ylabel="mean over steps", xticks=layers)
        ax.grid(alpha=0.3)
    for ax in axes[len(families) :]:
        ax.set_visible(False)
    _legend(fig, axes, list(arms))
    fig.suptitle("Routing drift per layer (π_θ vs π_old)")
    return fig


def _figures(arms: Mapping[str, list[RunResult]], out: Path) -> list[Path]:
    figures = {
        "accuracy": _curves(arms, (ACCURACY, SAMPLED), "Held-out accuracy", "accuracy"),
        "clip_fraction": _curves(arms, CLIP_KEYS, "Clip fraction", "fraction"),
        "drift": _curves(arms, ("drift_slot_change_rate", "drift_router_flip_rate"), "Routing drift", "rate"),
        "drift_per_layer": _per_layer(arms),
        "flipped_share": _curves(arms, FLIPPED_KEYS, "Routing-flipped tokens: share of the loss gradient", "share"),
    }
    written = []
    out.mkdir(parents=True, exist_ok=True)
    for name, fig in figures.items():
        if fig is None:
            (out / f"{name}.png").unlink(missing_ok=True)  # an earlier report's, now without data
            continue
        written.append(save_figure(fig, out / f"{name}.png", dpi=100))
    return written

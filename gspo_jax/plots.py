"""PNG plots of a run's `metrics.jsonl`: reward, accuracy, clip fractions, KL and routing drift, plus
an overlay of one metric across runs (e.g. GRPO vs DAPO vs GSPO reward).

Figures are built with `matplotlib.figure.Figure` and saved through its Agg canvas, never through
pyplot, so this works headless and leaves the process's matplotlib backend alone.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gspo_jax.writers import read_metrics

if TYPE_CHECKING:
    from matplotlib.figure import Figure

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FigureSpec:
    name: str
    title: str
    keys: tuple[str, ...]
    ylabel: str
    log_when_wide: bool = False  # log-scale y when positive values span more than 2 decades


FIGURES: tuple[FigureSpec, ...] = (
    FigureSpec("reward", "Reward", ("reward_mean", "eval_accuracy"), "reward"),
    FigureSpec("accuracy", "Accuracy", ("accuracy", "eval_accuracy", "eval_accuracy_sampled"), "accuracy"),
    # GSPO clips whole sequences, so its clip fraction runs ~100x GRPO's token clip fraction.
    FigureSpec(
        "clip_fraction",
        "Clip fraction",
        ("clip_frac", "clip_frac_low", "clip_frac_high", "seq_clip_frac"),
        "fraction",
        log_when_wide=True,
    ),
    FigureSpec("kl", "KL", ("approx_kl", "kl_ref"), "KL"),
    FigureSpec(
        "routing_drift",
        "Expert-routing drift (π_θ vs π_old)",
        ("drift_slot_change_rate", "drift_router_flip_rate"),
        "rate",
    ),
)


def series(records: Sequence[Mapping], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that hold a numeric `key`; NaN stays (a gap in the line)."""
    steps, values = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            steps.append(r["step"])
            values.append(float(v))
    return steps, values


def plot_run(workdir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> list[Path]:
    """Writes one PNG per figure in `FIGURES` that has data; returns their paths.

    Defaults to `<workdir>/plots/`. Missing keys are skipped; a figure with no data is not written.
    """
    records = read_metrics(workdir)
    out = Path(out_dir) if out_dir is not None else Path(workdir) / "plots"
    written = []
    for spec in FIGURES:
        lines = {k: series(records, k) for k in spec.keys}
        lines = {k: s for k, s in lines.items() if _has_data(s)}
        if not lines:
            continue
        fig = _line_figure(lines, spec.title, spec.ylabel, spec.log_when_wide)
        written.append(save_figure(fig, out / f"{spec.name}.png"))
    return written


def plot_comparison(workdirs: Mapping[str, str | os.PathLike], key: str, out_path: str | os.PathLike) -> Path | None:
    """Overlays `key` from several runs (`{label: workdir}`) in one PNG; None if no run has it."""
    lines = {label: series(read_metrics(d), key) for label, d in workdirs.items()}
    missing = [label for label, s in lines.items() if not _has_data(s)]
    if missing:
        log.warning("%s: no %r in runs %s", out_path, key, missing)
    lines = {label: s for label, s in lines.items() if _has_data(s)}
    if not lines:
        return None
    fig = _line_figure(lines, key, key, log_when_wide=False)
    return save_figure(fig, Path(out_path))


def _has_data(line: tuple[list, list]) -> bool:
    return any(math.isfinite(v) for v in line[1])


def _line_figure(lines: Mapping[str, tuple[list, list]], title: str, ylabel: str, log_when_wide: bool) -> Figure:
    from matplotlib.figure import Figure  # here: matplotlib costs every run's start ~1 s, plots only its end

    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    ax = fig.subplots()
    for label, (steps, values) in lines.items():
        ax.plot(steps, values, label=label, marker="." if len(steps) < 30 else None)
    positive = [v for _, vs in lines.values() for v in vs if v > 0 and math.isfinite(v)]
    if log_when_wide and positive and max(positive) / min(positive) > 100:
        ax.set_yscale("log")
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def save_figure(fig: Figure, path: Path, dpi: int = 120) -> Path:
    """Writes `fig` as a PNG at `path` (its folder created if need be); returns the path. Every figure
    of the project is saved here: the run's plots, scripts/drift.py's and the sweep report's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path

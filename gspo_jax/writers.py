"""Metric logging from process 0: one JSON line per step in `<workdir>/metrics.jsonl`, held-out
completions (one line each) in `<workdir>/samples.jsonl`, per-expert loads in `<workdir>/routing.jsonl`, and the
scalars and text as TensorBoard events in `<workdir>/tb`.

JSONL is the source of truth (plots are made from it); TensorBoard is optional (tensorboardX, no
TensorFlow). Non-finite floats are written as the strings "nan", "inf" and "-inf" so every line is
strict JSON yet a diverging run's NaN stays distinguishable from a missing value; `read_metrics`
turns them back into floats.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
ROUTING_FILE = "routing.jsonl"  # per step: {"load_old": [L][E], "load_new": [L][E]} (routing.expert_load)
TB_DIR = "tb"
_RESERVED = ("step", "time")
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class MetricWriter:
    """Appends metrics and completions to JSONL (+ TensorBoard); a no-op unless `enabled`.

    `enabled` defaults to `jax.process_index() == 0`, so every process may call it unconditionally.
    Files are opened for appending, so a resumed run continues the same files (see `read_metrics`).
    """

    def __init__(
        self,
        workdir: str | os.PathLike,
        *,
        tensorboard: bool = True,
        enabled: bool | None = None,
        trackers: Sequence[Any] = (),
    ):
        """`trackers` (`trackers.open_trackers`): W&B / MLflow runs that get every row and sample table too,
        and are closed with the writer (finished, or not when it closes on an exception)."""
        self.workdir = Path(workdir)
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self._files: dict[str, Any] = {}
        self._tb = None
        self._trackers = list(trackers) if self.enabled else []
        if not self.enabled:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            try:  # optional dependency: without it, JSONL only
                from tensorboardX import SummaryWriter
            except ImportError:
                log.warning("tensorboardX is not installed: writing JSONL metrics only.")
            else:
                self._tb = SummaryWriter(logdir=str(self.workdir / TB_DIR))

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Writes one record `{"step", "time", **metrics}`; values are scalars (Python/numpy/jax)."""
        if not self.enabled:
            return
        clash = [k for k in metrics if k in _RESERVED]
        if clash:
            raise ValueError(f"metric names {clash} are reserved")
        values = {k: _to_number(k, v) for k, v in jax.device_get(dict(metrics)).items()}
        self._append(METRICS_FILE, {"step": int(step), "time": time.time(), **values})
        if self._tb is not None:  # an undefined metric (NaN: e.g. no flipped tokens yet) is a gap in its chart
            for k, v in values.items():
                if not math.isnan(v):  # an infinity is a real blow-up: charted
                    self._tb.add_scalar(k, v, int(step))
            self._tb.flush()
        for tracker in self._trackers:
            tracker.log(int(step), values)

    def write_samples(self, step: int, samples: list[Mapping[str, Any]]) -> None:
        """Records completions, one line each (`{"step", "time", **sample}`, e.g. prompt, completion,
        reward), and in TensorBoard one text entry of them all."""
        if not self.enabled or not samples:
            return
        now = time.time()
        for sample in samples:
            self._append(SAMPLES_FILE, {"step": int(step), "time": now, **sample})
        if self._tb is not None:
            text = "\n\n".join("  \n".join(f"**{k}**: `{v!r}`" for k, v in x.items()) for x in samples)
            self._tb.add_text("samples", text, int(step))
            self._tb.flush()
        for tracker in self._trackers:
            tracker.log_samples(int(step), samples)

    def write_routing(self, step: int, record: Mapping[str, Any]) -> None:
        """Records per-step arrays too big for scalar metrics (e.g. each MoE layer's expert loads)."""
        if not self.enabled:
            return
        self._append(ROUTING_FILE, {"step": int(step), "time": time.time(), **record})

    def close(self, finished: bool = True) -> None:
        """Closes the files and TensorBoard, and ends the trackers' runs as finished or not."""
        for f in self._files.values():
            f.close()
        self._files.clear()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        trackers, self._trackers = self._trackers, []
        for tracker in trackers:
            tracker.close(finished)

    def __enter__(self) -> MetricWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(finished=exc_type is None)

    def _append(self, name: str, record: dict) -> None:
        f = self._files.get(name)
        if f is None:
            f = self._files[name] = _open_for_append(self.workdir / name)
        f.write(json.dumps(_encode_non_finite(record), allow_nan=False) + "\n")
        f.flush()


def read_metrics(workdir: str | os.PathLike) -> list[dict]:
    """Reads `metrics.jsonl` into one merged record per step, ascending by step.

    Records of the same step within a run are merged (later keys win), so train and eval metrics
    written separately end up together. A step lower than the previous record's marks a resumed run:
    it supersedes every earlier record at that step or later, so a crash-and-resume leaves neither
    duplicated steps nor stale metrics from the abandoned tail. Unparseable lines (a write cut off
    by a crash) are skipped with a warning.
    """
    path = Path(workdir) / METRICS_FILE
    if not path.exists():
        return []
    by_step: dict[int, dict] = {}
    last_step = None
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                step = int(record["step"])
            except (ValueError, KeyError, TypeError):
                log.warning("%s:%d: skipping unreadable line", path, lineno)
                continue
            if last_step is not None and step < last_step:  # a resumed run rewinds
                by_step = {s: r for s, r in by_step.items() if s < step}
            last_step = step
            by_step.setdefault(step, {}).update(_decode_non_finite(record))
    return [by_step[s] for s in sorted(by_step)]


def _to_number(name: str, value: Any) -> int | float:
    arr = np.asarray(value)
    if arr.ndim != 0 or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == bool):
        raise TypeError(
            f"metric {name!r} must be a real scalar, got {type(value).__name__} "
            f"with shape {arr.shape} and dtype {arr.dtype}"
        )
    if np.issubdtype(arr.dtype, np.complexfloating):
        raise TypeError(f"metric {name!r} is complex")
    return int(arr) if np.issubdtype(arr.dtype, np.integer) or arr.dtype == bool else float(arr)


def _encode_non_finite(record: dict) -> dict:
    return {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


def _decode_non_finite(record: dict) -> dict:
    return {k: (_NON_FINITE[v] if isinstance(v, str) and v in _NON_FINITE else v) for k, v in record.items()}


def _open_for_append(path: Path):
    """Opens for appending, first ending a line a crash left unfinished so records never fuse."""
    needs_newline = False
    if path.exists() and path.stat().st_size:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            needs_newline = f.read(1) != b"\n"
    f = open(path, "a", encoding="utf-8")  # noqa: SIM115 - the writer owns it until close()
    if needs_newline:
        f.write("\n")
    return f

"""Progress of a run: a tqdm bar on a terminal; in a log file (a TPU worker's, a scheduler's) one plain
line every `every` iterations instead of a single line of carriage returns, prefixed with the process."""

from __future__ import annotations

import sys
import time
from typing import TextIO

import jax
from tqdm.auto import tqdm

SHOWN = ("reward_mean", "accuracy", "eval_accuracy", "eval_accuracy_sampled")


class Progress:
    """`update(metrics)` once per finished iteration; `close()` at the end (or use it as a context)."""

    def __init__(
        self, total: int, initial: int, desc: str, *, every: int = 1, enabled: bool = True, stream: TextIO | None = None
    ):
        self.total, self.done, self.desc, self.every = total, initial, desc, max(int(every), 1)
        self.enabled = enabled
        self.stream = sys.stderr if stream is None else stream
        self.prefix = f"[process {jax.process_index()}] " if jax.process_count() > 1 else ""
        is_tty = getattr(self.stream, "isatty", lambda: False)()
        if stream is None:  # a job's output redirected to a file is a log, even if stderr is not
            is_tty = is_tty and sys.stdout.isatty()
        self._bar = None
        if enabled and is_tty and jax.process_index() == 0:
            self._bar = tqdm(total=total, initial=initial, desc=desc, unit="it", file=self.stream)
        self._t0 = time.perf_counter()
        self._since = initial

    def update(self, metrics: dict[str, float]) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", acc=f"{metrics['accuracy']:.3f}")
            return
        if not self.enabled or (self.done % self.every and self.done != self.total):
            return
        rate = (time.perf_counter() - self._t0) / max(self.done - self._since, 1)
        shown = " ".join(f"{k}={metrics[k]:.4f}" for k in SHOWN if k in metrics)
        print(f"{self.prefix}{self.desc} {self.done}/{self.total} {shown} {rate:.2f}s/it", file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

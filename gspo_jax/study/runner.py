"""Runs a sweep's runs as scripts/train.py child processes, N at a time, each on its own share of the
CPUs; skips finished runs, resumes stopped ones, records failures without stopping the others, and
on SIGTERM / SIGINT / SIGHUP stops every child at its next iteration boundary (a checkpoint each).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TextIO

from gspo_jax import workdir
from gspo_jax.exit_codes import EXIT_DONE, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_STOPPED
from gspo_jax.study import sweeps
from gspo_jax.workdir import Lock

TAIL_LINES = 20
# Thread pools that read these size themselves from them; unknown names are ignored, so they are safe
# whatever the installed libraries (unlike XLA flags, which abort a process whose XLA does not know them).
THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
# Of one accelerator's memory, what N runs at once share: JAX's client settings (environment variables
# JAX reads, not XLA flags) stop the first run from preallocating the device and cap each at its share.
SHARED_DEVICE_MEMORY = 0.9


def device_memory_env(parallel: int, environ: dict[str, str]) -> dict[str, str]:
    """What each of `parallel` > 1 runs at once is given so that they fit one GPU together: no
    preallocation, and at most SHARED_DEVICE_MEMORY / N of the device each. A setting already in
    `environ` (the user's) is kept; CPUs ignore both; a TPU chip takes one process, so there shard
    a sweep over slices (`--shard`) instead."""
    if parallel <= 1:
        return {}
    share = dict(
        XLA_PYTHON_CLIENT_PREALLOCATE="false", XLA_PYTHON_CLIENT_MEM_FRACTION=f"{SHARED_DEVICE_MEMORY / parallel:.3f}"
    )
    return {k: v for k, v in share.items() if k not in environ}


class SweepLock(Lock):
    """`gspo_jax.workdir.Lock` on `<workroot>/.sweep.lock` (one per shard): a second sweep process on
    the same runs is refused, while shards of one sweep may share a workroot."""

    def __init__(self, root: str | os.PathLike, shard: tuple[int, int] | None = None):
        super().__init__(root)
        self.path = Path(root) / (f".sweep.shard-{shard[0]}-of-{shard[1]}.lock" if shard else ".sweep.lock")


def cpu_slots(parallel: int) -> list[list[int]] | None:
    """The CPUs of each of `parallel` slots: disjoint contiguous blocks of this process's CPUs, or
    (more slots than CPUs) one CPU each, shared round-robin. None where affinity cannot be set.

    Why affinity: XLA:CPU sizes its thread pools from the CPUs a process may run on (sched_getaffinity),
    so a child pinned to k CPUs runs k-wide and N children do not oversubscribe the cores; no XLA flag
    is needed, and a flag the installed XLA did not know would abort the child."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    n = len(cpus)
    return [cpus[k * n // parallel : max(k * n // parallel + 1, (k + 1) * n // parallel)] for k in range(parallel)]


@dataclasses.dataclass
class Child:
    run: sweeps.Run
    proc: subprocess.Popen
    slot: int
    started: float
    log_offset: int  # where this attempt's output starts in the log


class Runner:
    """`run()` works through `runs` (skipping those already done) and returns the sweep's exit code:
    0 all done, 1 some failed, 75 stopped (by a signal, or a child stopped by someone else): rerun to go on.
    """

    def __init__(
        self,
        runs: list[sweeps.Run],
        root: Path,
        repo: Path,
        *,
        parallel: int = 1,
        python: str = sys.executable,
        out: TextIO = sys.stderr,
        heartbeat_s: float = 30.0,
    ):
        self.runs, self.root, self.repo, self.parallel = runs, Path(root).resolve(), Path(repo), parallel
        self.python, self.out, self.heartbeat_s = python, out, heartbeat_s
        self.slots = cpu_slots(parallel)
        self.children: dict[int, Child] = {}  # slot -> child
        self.durations: list[float] = []  # of runs finished by this sweep process, for the ETA
        self.failed: list[str] = []
        self.stopped: list[str] = []
        self.done = 0
        self.pending: list[sweeps.Run] = []  # not started by this sweep process yet
        self._waiting: set[str] = set()  # pending runs whose workdir another process holds
        self.signals = 0  # received; the main loop acts on them (a handler only counts, so never prints)
        self._acted = 0
        self._last_line = 0.0

    # ------------------------------------------------------------------ the loop

    def run(self) -> int:
        for run in self.runs:
            run_dir = sweeps.workdir(self.root, run)
            if sweeps.status(run_dir) == "done":
                self.done += 1
                recorded = sweeps.read_state(run_dir).get("command", [])
                if _without_workdir(recorded[1:]) != _without_workdir(run.train_args(run_dir)):
                    self._say(f"{run.name}: finished with other overrides than the sweep's now; not rerun")
            else:
                self.pending.append(run)
        self._say(
            f"{len(self.runs)} runs: {self.done} already done, {len(self.pending)} to run, {self.parallel} at once"
        )
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        try:
            while self.children or (self.pending and not self.signals):
                self._forward_signals()
                self._reap()
                if not self.signals:
                    self._launch()
                if time.monotonic() - self._last_line > self.heartbeat_s:
                    self._progress()
                time.sleep(0.2)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        return self._summary()

    def _on_signal(self, signum, frame) -> None:
        self.signals += 1

    def _forward_signals(self) -> None:
        """The first signal: SIGTERM to every child (each saves a checkpoint at its next iteration
        boundary and exits 75). Another: SIGINT, which stops a child already stopping at once (130)."""
        if self.signals == self._acted:
            return
        first = self._acted == 0
        self._acted = self.signals
        sig = signal.SIGTERM if first else signal.SIGINT
        for child in self.children.values():
            if child.proc.poll() is None:
                child.proc.send_signal(sig)
        if first:
            self._say(f"stopping: SIGTERM sent to {len(self.children)} running, waiting for their checkpoints")
        else:
            self._say("stopping at once: SIGINT sent (the newest complete checkpoints are kept)")

    def _launch(self) -> None:
        for slot in range(self.parallel):
            if slot in self.children:
                continue
            # Another arm than those running first: runs of one arm (seeds) compile the same programs,
            # and one started after its arm's first loads them from the compilation cache.
            running = {c.run.arm for c in self.children.values()}
            other_arm = (r for r in self.pending if r.arm not in running and not self._busy(r))
            run = next(other_arm, None) or next((r for r in self.pending if not self._busy(r)), None)
            if run is None:
                return  # nothing, or only runs that a process left by an earlier sweep holds: next tick
            self.pending.remove(run)
            self.children[slot] = self._start(run, slot)
            self._progress(f"started {run.name}")

    def _busy(self, run: sweeps.Run) -> bool:
        """Whether another process (a child left running by a killed sweep) holds the run's workdir;
        the run waits for it rather than being refused by train.py and counted as failed."""
        busy = workdir.in_use(sweeps.workdir(self.root, run))
        if busy and run.name not in self._waiting:
            self._say(f"waiting for {run.name}: another process holds its workdir (left by an earlier sweep?)")
        (self._waiting.add if busy else self._waiting.discard)(run.name)
        return busy

    def _start(self, run: sweeps.Run, slot: int) -> Child:
        run_dir = sweeps.workdir(self.root, run)
        run_dir.mkdir(parents=True, exist_ok=True)
        cpus = self.slots[slot] if self.slots else None
        env = dict(os.environ)
        if cpus is not None and self.parallel > 1:
            env.update({k: str(len(cpus)) for k in THREAD_ENV})
        env.update(device_memory_env(self.parallel, env))
        command = [self.python, *run.train_args(run_dir)]
        with open(run_dir / sweeps.LOG_FILE, "ab") as log:
            offset = log.tell()
            log.write(f"=== {sweeps.now()} sweep attempt (cpus {cpus}): {' '.join(command)}\n".encode())
            log.flush()
            # Its own session: a terminal's Ctrl-C reaches the sweep only, which forwards one SIGTERM
            # (a child that saw both would take the second for an impatient second Ctrl-C).
            proc = subprocess.Popen(
                command, cwd=self.repo, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        if cpus is not None and self.parallel > 1:
            # Set from here, as the child has just exec'd an interpreter that has not yet started any
            # thread; every thread it starts, and scripts/train.py's re-exec, inherit the mask.
            with contextlib.suppress(ProcessLookupError):  # already gone: reaped as any other exit
                os.sched_setaffinity(proc.pid, cpus)
        return Child(run, proc, slot, time.monotonic(), offset)

    def _reap(self) -> None:
        for slot, child in list(self.children.items()):
            rc = child.proc.poll()
            if rc is None:
                continue
            del self.children[slot]
            run, run_dir = child.run, sweeps.workdir(self.root, child.run)
            seconds = time.monotonic() - child.started
            tail = _tail(run_dir / sweeps.LOG_FILE, child.log_offset)
            # A child our signal reached before train.py installed its handler (start-up) dies of it.
            killed_by_us = self.signals and rc in (-signal.SIGTERM, -signal.SIGINT)
            # scripts/train.py stopped with a checkpoint saved (75), or at once (130): both resume.
            stopped = rc in (EXIT_STOPPED, EXIT_INTERRUPTED) or killed_by_us
            status = "done" if rc == EXIT_DONE else "stopped" if stopped else "failed"
            command = [self.python, *run.train_args(run_dir)]
            sweeps.record_attempt(run_dir, status, rc=rc, seconds=seconds, command=command, tail=tail)
            if status == "done":
                self.done += 1
                self.durations.append(seconds)
                message = f"finished {run.name} in {_duration(seconds)}"
            elif status == "stopped":
                self.stopped.append(run.name)
                message = f"stopped {run.name} (exit {rc}): resumes on the next sweep"
            else:
                self.failed.append(run.name)
                shown = "\n".join("    " + line for line in tail[-8:])
                message = f"FAILED {run.name} (exit {rc}); last lines of {run_dir / sweeps.LOG_FILE}:\n{shown}"
            self._progress(message)

    # ------------------------------------------------------------------ what the user sees

    def _progress(self, event: str = "") -> None:
        left = len(self.pending)
        line = (
            f"{self.done}/{len(self.runs)} done, {len(self.children)} running, {len(self.failed)} failed, "
            f"{left} left, ETA {self._eta(left)}"
        )
        self._say(f"{event}  [{line}]" if event else line)

    def _eta(self, left: int) -> str:
        """From the mean duration of the runs finished so far: the work left (runs not started, and
        what the running ones have still to do by that mean), shared by the parallel slots."""
        if not self.durations:
            return "—"
        mean = sum(self.durations) / len(self.durations)
        now = time.monotonic()
        work = left * mean + sum(max(0.0, mean - (now - c.started)) for c in self.children.values())
        return _duration(work / max(1, min(self.parallel, left + len(self.children))))

    def _say(self, message: str) -> None:
        print(f"[sweep {datetime.datetime.now().strftime('%H:%M:%S')}] {message}", file=self.out, flush=True)
        self._last_line = time.monotonic()

    def _summary(self) -> int:
        """Interrupted: 75 (a rerun goes on, and retries any failure); else 1 if a run failed; else 75
        if a child was stopped by someone else's signal; else 0."""
        if self.failed:
            self._say(f"{len(self.failed)} failed: {', '.join(self.failed)} (see their log.txt; a rerun retries them)")
        unfinished = len(self.pending) + len(self.stopped)
        if unfinished:
            self._say(
                f"stopped: {self.done}/{len(self.runs)} done, {unfinished} to go; rerun the same command to resume"
            )
        if self.signals:
            return EXIT_STOPPED
        if self.failed:
            return EXIT_FAILED
        if unfinished:
            return EXIT_STOPPED
        self._say(f"all {len(self.runs)} runs done")
        return EXIT_DONE


def _without_workdir(args: list[str]) -> list[str]:
    """train.py's arguments but the paths in the workroot (the same run, in a workroot that has moved)."""
    i = args.index("--workdir") if "--workdir" in args else len(args)
    return [a for a in args[:i] + args[i + 2 :] if not a.startswith(sweeps.CACHE_FLAG)]


def _tail(path: Path, offset: int, lines: int = TAIL_LINES) -> list[str]:
    with open(path, "rb") as f:
        f.seek(offset)
        text = f.read().decode("utf-8", "replace")
    # A terminal-style progress bar redraws with \r; keep the last state of each line.
    return [line.rsplit("\r", 1)[-1] for line in text.splitlines() if line.strip()][-lines:]


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"

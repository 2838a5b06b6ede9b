"""A workdir holds one run: a lock so that a second run on it is refused, the config it was started
with so that a later start with a different one is refused, and one metrics row per step after any
interruption.

Everything here runs on process 0 only (the others share its filesystem or keep nothing).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import socket
from pathlib import Path
from typing import Any

from gspo_jax.validation import ConfigError
from gspo_jax.writers import METRICS_FILE, ROUTING_FILE, SAMPLES_FILE

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"
_NO_LOCKS = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP)
CONFIG_FILE = "config.json"

# Keys that may change when a run is resumed: they say how long to run and how to observe it, not
# what the checkpoints mean. Every other key must match the config the workdir was started with.
RESUMABLE_KEYS = (
    "train.num_iterations",  # extend (or shorten) a run; the LR schedule's length follows it
    "train.eval_every",
    "train.eval_batches",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.drift_subsample",  # what drift is measured on, not what trains
    "train.routing_diagnostics",  # what is logged, not what trains
    "warm_start.cache_dir",
)


class WorkdirBusy(RuntimeError):
    """Another live process holds the workdir."""


class Lock:
    """An exclusive `flock` on `<workdir>/.lock`, recording the holder (pid, host, start time).

    The kernel drops the lock when its process dies, however it dies, so a lock left by a dead run
    is simply taken over (and logged). A live holder makes `acquire` raise `WorkdirBusy` without
    changing any file, or, with `wait=True`, blocks until it lets go (a cache several runs share).
    """

    def __init__(self, workdir: str | os.PathLike, name: str = LOCK_FILE, *, wait: bool = False):
        self.path = Path(workdir) / name
        self.wait = wait
        self._fd: int | None = None

    def acquire(self) -> Lock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not self.wait:
                    raise
                log.info("waiting for %s, held by %s", self.path, _read_holder(fd))
                fcntl.flock(fd, fcntl.LOCK_EX)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise WorkdirBusy(f"workdir {self.path.parent} is in use by {holder}") from None
        except OSError as e:
            if e.errno not in _NO_LOCKS:
                os.close(fd)
                raise
            # A filesystem without locks (gcsfuse, where a pod's workdir often lives): run unguarded.
            log.warning("%s: this filesystem has no file locks (%s); a second run on it is not refused", self.path, e)
        previous = _read_holder(fd)
        if previous != "an unknown process":
            log.warning("took over %s, left by %s, which is no longer running", self.path, previous)
        holder = dict(
            pid=os.getpid(), host=socket.gethostname(), since=datetime.datetime.now().isoformat(" ", "seconds")
        )
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)  # a holder record left behind means its process died holding it
            with contextlib.suppress(OSError):  # no lock to release where the filesystem has none
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> Lock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def in_use(workdir: str | os.PathLike) -> bool:
    """Whether a live process holds `workdir`'s lock: a probe that takes it for an instant and writes
    nothing (False where there is no lock file, or the filesystem has no locks)."""
    try:
        fd = os.open(Path(workdir) / LOCK_FILE, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    except OSError as e:
        if e.errno in _NO_LOCKS:
            return False
        raise
    finally:
        os.close(fd)


def _read_holder(fd: int) -> str:
    try:
        h = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {h['pid']} on {h['host']} (since {h['since']})"
    except (ValueError, KeyError):
        return "an unknown process"


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        out.update(_flat(v, key + ".") if isinstance(v, dict) else {key: v})
    return out


RESUMABLE_PREFIXES = ("logging.",)  # where a run is tracked, never what it trains

# Keys added after workdirs were recorded without them, each with the value whose behaviour a run
# without it had: such a run resumes when the key holds that value.
ADDED_KEYS = {
    "mesh.rollout_devices": 0,
    "mesh.rollout.data": -1,
    "mesh.rollout.fsdp": 1,
    "mesh.rollout.expert": 1,
    "mesh.rollout.tensor": 1,
}


def config_changes(recorded: dict, config: dict) -> list[str]:
    """'key: old -> new' for every key (outside RESUMABLE_KEYS and _PREFIXES) whose value differs; a key of
    `ADDED_KEYS` absent from `recorded` counts as its value there."""
    old, new = _flat(recorded), _flat(json.loads(json.dumps(config, default=_jsonable)))
    old = {**{k: v for k, v in ADDED_KEYS.items() if k in new}, **old}
    keys = sorted(k for k in (set(old) | set(new)) - set(RESUMABLE_KEYS) if not k.startswith(RESUMABLE_PREFIXES))
    missing = object()
    return [
        f"{k}: {old.get(k, missing)!r} -> {new.get(k, missing)!r}".replace(repr(missing), "(absent)")
        for k in keys
        if old.get(k, missing) != new.get(k, missing)
    ]


def _jsonable(x):
    return list(x) if isinstance(x, tuple) else str(x)


def check_config(workdir: Path, config_json: str, *, allow_change: bool) -> list[str]:
    """Refuses (ConfigError, one line) a config (`config.as_json`) that differs from the one `workdir` was
    started with, unless `allow_change`; returns the changes. Reads only: a refused run leaves the
    workdir as it was."""
    path = workdir / CONFIG_FILE
    if not path.exists():
        return []
    changes = config_changes(json.loads(path.read_text()), json.loads(config_json))
    if changes and not allow_change:
        raise ConfigError(
            f"workdir {workdir} was started with a different config ({'; '.join(changes)}); use a new workdir, "
            "or pass --allow_config_change to continue it with this one"
        )
    return changes


def record_config(workdir: Path, config_json: str, changes: list[str]) -> None:
    """Writes `config_json` (`config.as_json`) as `config.json`; an allowed change keeps the previous one
    as `config.<time>.json`."""
    path = workdir / CONFIG_FILE
    if changes:
        kept = workdir / f"config.{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
        path.rename(kept)
        log.warning("config changed on resume (%s); the previous config is kept as %s", "; ".join(changes), kept.name)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(config_json)
    os.replace(tmp, path)


def drop_rows_after(workdir: Path, step: int) -> int:
    """Removes metric and sample rows of steps > `step` (work past the restored checkpoint, which
    the resumed run repeats), rewriting each file atomically; returns how many rows went."""
    total = 0
    for name in (METRICS_FILE, SAMPLES_FILE, ROUTING_FILE):
        path = workdir / name
        if not path.exists():
            continue
        keep, dropped = [], 0
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row_step = int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                dropped += 1  # a line cut off by a crash
                continue
            if row_step <= step:
                keep.append(line)
            else:
                dropped += 1
        if dropped:
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in keep), encoding="utf-8")
            os.replace(tmp, path)
            total += dropped
    if total:
        log.warning("dropped %d logged rows past step %d (the resumed run redoes them)", total, step)
    return total

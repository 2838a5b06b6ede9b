"""What a sweep is: a file beside the configs (`configs/sweeps/<name>.py`) that names a base config and
yields override dicts, expanded here into named runs; and each run's state in its workdir, so that a
sweep can be killed and restarted at any point without losing or repeating a finished run.

A sweep file defines
    BASE = "configs/gspo.py:tiny"                # the config file and its argument (the size)
    COMMON = {"train.num_iterations": 3}         # optional: overrides for every run, not in run names
    def runs(): return grid(algorithm=["grpo", "gspo"], seed=[0, 1])   # or yield override dicts
    CONTROL = {"train.routing_replay": "none"}   # optional: each arm's control arm, for paired differences
    ANALYSIS = "..."                             # optional: the analysis, stated before the sweep ran

CONTROL is either a dict (an arm's control is the arm with those keys set to those values, a None value
meaning the key unset) or a function from an arm's overrides (its own, with `algorithm`, without the
seed) to its control's. The report (gspo_jax.study.report, by gspo_jax.study.analysis's rule) gives each arm's
difference to its control per seed with a 95% interval, and prints ANALYSIS above its tables.

Every key is a `--config.KEY=VALUE` override of scripts/train.py except `algorithm`, which picks the
config file beside BASE's (`configs/<algorithm>.py`): an algorithm is its config file, not a key. A
study config that takes the algorithm as its argument says so with a placeholder:
    BASE = "configs/study/moe_drift.py:{algorithm}"
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import itertools
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gspo_jax.config_files import load_file

ALGORITHM = "algorithm"  # switches the config file instead of overriding a key
SEED = "seed"  # runs that differ only in it form one arm of the report
RUNS_DIR = "runs"  # <workroot>/runs/<run name>/ is a run's workdir
# <workroot>/warm_starts/: the runs' shared warm-start cache (runs of one seed share one warm start,
# trained by the first run to need it while the others wait), unless a run sets warm_start.cache_dir.
WARM_STARTS = "warm_starts"
CACHE_FLAG = "--config.warm_start.cache_dir="
STATE_FILE = ".sweep.json"  # in a run's workdir: its status and attempts, rewritten atomically
LOG_FILE = "log.txt"  # in a run's workdir: every attempt's stdout and stderr, appended
# Readable labels for keys whose last component says little on its own; others use their last component.
LABELS = {"train.routing_replay": "replay"}
_MAX_NAME = 120
_UNSAFE = re.compile(r"[^A-Za-z0-9._+=,-]")


class SweepError(ValueError):
    """A sweep file, or a sweep argument, that cannot be run; one line, naming what is wrong."""


def grid(axes: Mapping[str, Sequence[Any]] | None = None, /, **more: Sequence[Any]) -> list[dict[str, Any]]:
    """The product of the axes, as override dicts in axis order, the last axis varying fastest:
    grid({"train.routing_replay": ["none", "R3"]}, seed=[0, 1]) gives 4 dicts. Dotted keys go in the
    positional mapping (they are not Python names), the rest may be keyword arguments."""
    axes = {**(axes or {}), **more}
    for key, values in axes.items():
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
            raise SweepError(f"grid axis {key!r}: expected a non-empty list of values, got {values!r}")
    return [dict(zip(axes, combo, strict=True)) for combo in itertools.product(*axes.values())]


def value_text(value: Any) -> str:
    """How a value is written in a run name and on train.py's command line (repr for floats: exact)."""
    return repr(value) if isinstance(value, float) else str(value)


def run_name(stem: str, overrides: Mapping[str, Any]) -> str:
    """`<algorithm>-<label>=<value>-...` in the overrides' order, e.g. `grpo-replay=R3-seed=1`: readable
    in a directory listing, the same for the same overrides, and safe as a file name (characters other
    than letters, digits and `._+=,-` become `_`; a name over 120 characters ends in a hash of it)."""
    keys = [k for k in overrides if k != ALGORITHM]
    labels = [LABELS.get(k, k.rpartition(".")[2]) for k in keys]
    labels = [k if labels.count(label) > 1 else label for k, label in zip(keys, labels, strict=True)]
    parts = [str(overrides.get(ALGORITHM, stem))]
    parts += [f"{label}={value_text(overrides[k])}" for k, label in zip(keys, labels, strict=True)]
    name = _UNSAFE.sub("_", "-".join(parts)).lstrip(".-") or "run"
    if len(name) > _MAX_NAME:
        name = f"{name[: _MAX_NAME - 9]}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"
    return name


@dataclasses.dataclass(frozen=True)
class Run:
    index: int  # position in the sweep: what --shard slices
    name: str
    arm: str  # the name without the seed: runs of one arm differ only in seed
    config: str  # scripts/train.py's --config, e.g. "configs/grpo.py:tiny"
    overrides: dict[str, Any]  # key -> value, each a --config.KEY=VALUE (COMMON's included)
    arm_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)  # the run's own, `algorithm` in, seed out
    sweep: str = ""  # the sweep file's stem: the run's group in a tracker (`logging.group`)

    def train_args(self, workdir: str | os.PathLike) -> list[str]:
        """scripts/train.py's arguments for this run in `workdir`: its overrides, the sweep's shared warm
        start cache, and its sweep and arm as a tracker's group and tag (unless the sweep sets them)."""
        flags = [f"--config.{k}={value_text(v)}" for k, v in self.overrides.items()]
        if "warm_start.cache_dir" not in self.overrides:
            flags.append(f"{CACHE_FLAG}{Path(workdir).parent.parent / WARM_STARTS}")
        for key, value in (("logging.group", self.sweep), ("logging.arm", self.arm)):
            if value and key not in self.overrides:
                flags.append(f"--config.{key}={value}")
        return ["scripts/train.py", "--config", self.config, "--workdir", str(workdir), *flags]


@dataclasses.dataclass(frozen=True)
class Sweep:
    name: str  # the sweep file's stem
    base: str
    runs: list[Run]
    control: dict[str, str] = dataclasses.field(default_factory=dict)  # arm -> its control arm
    analysis: str = ""  # the sweep file's ANALYSIS: how its results are read, written before it ran


def load_sweep(path: str | os.PathLike, repo: str | os.PathLike) -> Sweep:
    """Reads a sweep file; config paths are relative to `repo` (where scripts/train.py runs). Raises
    SweepError for a missing file or config, a malformed override or two runs of one name."""
    path, repo = Path(path), Path(repo)
    if not path.is_file():
        raise SweepError(f"sweep file not found: {path}")
    try:
        module = load_file(path, f"gspo_jax_sweep_{path.stem}")
    except Exception as e:  # noqa: BLE001 - any error in the user's file is a refusal, named
        raise SweepError(f"sweep file {path} failed to load: {type(e).__name__}: {e}") from None
    base = getattr(module, "BASE", None)
    if not isinstance(base, str) or not base:
        raise SweepError(f"{path}: BASE must name a config, e.g. BASE = 'configs/gspo.py:tiny'")
    common = getattr(module, "COMMON", {})
    runs_fn = getattr(module, "runs", None)
    if not isinstance(common, Mapping) or not callable(runs_fn):
        raise SweepError(f"{path}: needs a function runs() yielding override dicts (and COMMON, if any, a dict)")
    config_path, sep, arg = base.partition(":")
    try:
        override_dicts = list(runs_fn())
    except Exception as e:  # noqa: BLE001
        raise SweepError(f"{path}: runs() failed: {type(e).__name__}: {e}") from None
    if not override_dicts:
        raise SweepError(f"{path}: runs() yielded no runs")
    runs, seen = [], {}
    for index, overrides in enumerate(override_dicts):
        if not isinstance(overrides, Mapping) or not all(isinstance(k, str) and k for k in overrides):
            raise SweepError(f"{path}: run {index} is {overrides!r}, not a dict of 'KEY': value overrides")
        if any(k.startswith("config.") for k in overrides):
            raise SweepError(f"{path}: run {index}: write keys without 'config.' (e.g. 'train.routing_replay')")
        config_file, run_arg = Path(config_path), arg
        if "{algorithm}" in arg:  # the study config takes the algorithm as its argument
            if ALGORITHM not in overrides:
                raise SweepError(f"{path}: run {index}: BASE {base!r} needs an 'algorithm' in every run")
            run_arg = arg.replace("{algorithm}", str(overrides[ALGORITHM]))
        elif ALGORITHM in overrides:
            config_file = config_file.with_name(f"{overrides[ALGORITHM]}.py")
        if not (repo / config_file).is_file():
            raise SweepError(f"{path}: run {index}: config file not found: {config_file}")
        merged = {**common, **{k: v for k, v in overrides.items() if k != ALGORITHM}}
        name = run_name(config_file.stem, overrides)
        if name in seen:
            raise SweepError(f"{path}: runs {seen[name]} and {index} are both named {name!r}")
        seen[name] = index
        own = {k: v for k, v in overrides.items() if k != SEED}
        arm = run_name(config_file.stem, own)
        runs.append(Run(index, name, arm, f"{config_file.as_posix()}{sep}{run_arg}", merged, own, sweep=path.stem))
    analysis = getattr(module, "ANALYSIS", "")
    if not isinstance(analysis, str):
        raise SweepError(f"{path}: ANALYSIS must be a string (how the sweep's results are read)")
    control = _controls(path, runs, getattr(module, "CONTROL", None))
    return Sweep(path.stem, base, runs, control, analysis.strip())


def _controls(path: Path, runs: Sequence[Run], spec: Any) -> dict[str, str]:
    """arm -> its control arm, from the sweep file's CONTROL (see the module docstring); {} without one."""
    if spec is None:
        return {}
    if isinstance(spec, Mapping):
        target = lambda own: {k: v for k, v in {**own, **spec}.items() if v is not None}  # noqa: E731
    elif callable(spec):
        target = spec
    else:
        raise SweepError(f"{path}: CONTROL must be a dict of overrides or a function of an arm's overrides")
    arms = {r.arm: r.arm_overrides for r in runs}
    out = {}
    for arm, own in arms.items():
        try:
            want = dict(target(dict(own)))
        except Exception as e:  # noqa: BLE001 - the user's function, named
            raise SweepError(f"{path}: CONTROL failed on arm {arm!r}: {type(e).__name__}: {e}") from None
        match = [a for a, o in arms.items() if o == want]
        if match and match[0] != arm:
            out[arm] = match[0]
    if not out:
        raise SweepError(f"{path}: CONTROL {spec!r} names no arm of this sweep as any arm's control")
    return out


def parse_shard(text: str) -> tuple[int, int]:
    """'i/n' -> (i, n), with 0 <= i < n."""
    match = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if not match or not 0 <= int(match[1]) < int(match[2]):
        raise SweepError(f"--shard {text!r}: expected i/n with 0 <= i < n, e.g. --shard 0/4 ... --shard 3/4")
    return int(match[1]), int(match[2])


def shard(runs: Iterable[Run], i: int, n: int) -> list[Run]:
    """The i-th of n disjoint slices that together hold every run: the runs whose index % n == i."""
    return [r for r in runs if r.index % n == i]


# ------------------------------------------------------------------ a run's state in its workdir


def workdir(root: str | os.PathLike, run: Run) -> Path:
    return Path(root) / RUNS_DIR / run.name


def read_state(run_dir: Path) -> dict[str, Any]:
    """The run's recorded state ({} before its first attempt ended)."""
    try:
        return json.loads((run_dir / STATE_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return {}


def status(run_dir: Path) -> str:
    """done | failed | stopped (an attempt ended early: resumes) | unfinished (started, no attempt
    recorded: running, or its sweep was killed) | not started."""
    state = read_state(run_dir)
    if state:
        return state["status"]
    return "unfinished" if run_dir.exists() else "not started"


def record_attempt(run_dir: Path, status: str, *, rc: int, seconds: float, command: list[str], tail: list[str]) -> None:
    """Adds an attempt to the run's state, written to a temporary file and renamed over the old one, so
    a crash leaves either state whole; `done` is recorded only after train.py exited 0."""
    state = read_state(run_dir)
    attempts = [*state.get("attempts", []), dict(rc=rc, seconds=round(seconds, 3), ended=now())]
    state = dict(status=status, command=command, attempts=attempts, tail=tail)
    tmp = run_dir / (STATE_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(state, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, run_dir / STATE_FILE)


def now() -> str:
    """The local time to the second, as the sweep's records and logs write it: '2026-11-27 14:03:09'."""
    return datetime.datetime.now().isoformat(" ", "seconds")

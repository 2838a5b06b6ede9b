"""What ran a run: each start of a workdir appends one line to `<workdir>/provenance.jsonl` (when, on
which host, CPU and devices, with which versions and code commit), so that runs made on different
machines (a sweep's CPU cells beside its GPU ones) say where they ran and their times are read
against the right machine. A sweep's report names each run's device from it."""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import subprocess
from importlib import metadata
from pathlib import Path

import jax

PROVENANCE_FILE = "provenance.jsonl"
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "transformers")
_REPO = Path(__file__).resolve().parents[1]  # a source checkout's root (an editable install's)


def cpu() -> tuple[str, str, int]:
    """The CPU's model, its widest vector ISA this project cares about, and the cores this process may use."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return model, isa, cores


def machine() -> str:
    """One line: the CPU's model and vector ISA, the cores this process may use (figures move with
    them: the hosts this project is lent differ from session to session), and JAX's devices."""
    model, isa, cores = cpu()
    devices = f"{jax.device_count()} {jax.devices()[0].platform} device(s)"
    return f"{model} ({platform.machine()}{', ' + isa if isa else ''}, {cores} cores), {devices}"


def device_slug() -> str:
    """JAX's first device's kind as a file name ("nvidia-h100-80gb-hbm3", "cpu"): what the benchmarks'
    result files are named by."""
    return "".join(ch if ch.isalnum() else "-" for ch in jax.devices()[0].device_kind.lower()).strip("-")


def commit() -> str:
    """The commit of the source checkout this code runs from, "+ changes" when it has uncommitted ones;
    "" for an installed copy or without git."""
    if not (_REPO / "setup.py").is_file():
        return ""
    try:
        git = ["git", "--no-optional-locks", "-C", str(_REPO)]  # reads only: no index refresh
        run = lambda *a: subprocess.run([*git, *a], capture_output=True, text=True, timeout=30)
        head = run("rev-parse", "HEAD").stdout.strip()
        dirty = run("status", "--porcelain", "--untracked-files=no").stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return f"{head} + changes" if head and dirty else head


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return ""


def describe() -> dict:
    """This process's record: time, host, CPU, JAX's platform and devices (all processes'), versions, commit."""
    model, isa, cores = cpu()
    return dict(
        time=datetime.datetime.now().isoformat(" ", "seconds"),
        host=socket.gethostname(),
        cpu=model,
        isa=isa,
        cores=cores,
        platform=jax.default_backend(),
        device_kind=jax.devices()[0].device_kind,
        devices=jax.device_count(),
        processes=jax.process_count(),
        python=platform.python_version(),
        versions={p: _version(p) for p in PACKAGES},
        commit=commit(),
    )


def record(workdir: str | os.PathLike) -> dict:
    """Appends this start's record to the workdir's provenance file (one line, one write) and returns it;
    a line a crash cut off is ended first, so it does not swallow this one."""
    rec, path = describe(), Path(workdir) / PROVENANCE_FILE
    cut = path.exists() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
    with open(path, "a", encoding="utf-8") as f:
        f.write(("\n" if cut else "") + json.dumps(rec) + "\n")
    return rec


def read(workdir: str | os.PathLike) -> list[dict]:
    """Every start's record, oldest first ([] for a run made before these were kept); a line cut off
    by a crash is skipped."""
    path = Path(workdir) / PROVENANCE_FILE
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def label(rec: dict) -> str:
    """A record's device in a few words: the accelerator's kind and count, or the CPU's model and cores."""
    if rec.get("platform") == "cpu":
        return f"CPU: {rec.get('cpu', '?')}, {rec.get('cores', '?')} cores"
    n = rec.get("devices", 1)
    return f"{rec.get('device_kind', rec.get('platform', '?'))}{f' × {n}' if n != 1 else ''}"


def devices_of(workdir: str | os.PathLike) -> str:
    """Where a run ran: its starts' distinct device labels in order ("" without records)."""
    labels = list(dict.fromkeys(label(r) for r in read(workdir)))
    return " then ".join(labels)

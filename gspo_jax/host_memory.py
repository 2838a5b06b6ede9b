"""Huge pages for XLA:CPU's per-call buffers: glibc's `hugetlb` malloc tunable, set before start-up.

XLA:CPU allocates a program's temporaries as one block per call (84 MiB for the default train step,
1.25 GiB for the `bench` one) on a worker thread. glibc serves a block over 64 MiB on a thread other
than the main one with a fresh `mmap` every time, and `munmap`s it on free, so each call page-faults
its whole temporary space back in 4 KiB at a time (21,600 faults per default step, 328,600 per
`bench` step). With `glibc.malloc.hugetlb=1` malloc advises transparent huge pages for what it maps:
2 MiB per fault, and the same bits computed. glibc reads its tunables only when a process starts,
so an entry point (`scripts/train.py`, the benchmarks) calls `reexec_with_huge_pages()` before it
imports JAX. The tests do not: their time is compilation, which huge pages make no faster.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb"
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _glibc_has_tunable() -> bool:
    libc, version = platform.libc_ver()
    try:
        return libc == "glibc" and tuple(int(v) for v in version.split(".")[:2]) >= (2, 35)
    except ValueError:
        return False


def _thp_possible() -> bool:
    try:
        return "[never]" not in THP_SETTING.read_text()
    except OSError:
        return False


def huge_pages_environ(environ: Mapping[str, str]) -> dict[str, str] | None:
    """`environ` with the tunable added to `GLIBC_TUNABLES`, or None where there is nothing to add:
    the tunable is already chosen (`glibc.malloc.hugetlb=0` there opts out), the C library is not
    glibc 2.35 or newer, or the kernel has transparent huge pages off."""
    current = environ.get("GLIBC_TUNABLES", "")
    if TUNABLE in current or not _glibc_has_tunable() or not _thp_possible():
        return None
    return {**environ, "GLIBC_TUNABLES": f"{current}:{TUNABLE}=1" if current else f"{TUNABLE}=1"}


def reexec_with_huge_pages() -> None:
    """Replace this process (same pid, same command line) by one started with the tunable set;
    returns at once where `huge_pages_environ` has nothing to add. Call it before importing JAX."""
    env = huge_pages_environ(os.environ)
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)

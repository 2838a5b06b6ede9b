"""host_memory: which environments get glibc's huge-page tunable, and the re-exec that applies it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gspo_jax import host_memory

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def capable(monkeypatch):
    """A glibc 2.36 host with transparent huge pages on `madvise`."""
    monkeypatch.setattr(host_memory.platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(host_memory, "_thp_possible", lambda: True)


def test_the_tunable_is_added_to_what_is_there(capable):
    assert host_memory.huge_pages_environ({"A": "1"}) == {"A": "1", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    env = host_memory.huge_pages_environ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert env == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}


def test_a_choice_already_made_is_kept(capable):
    """`glibc.malloc.hugetlb=0` opts out; a process started with the tunable is not re-executed again."""
    off, on = "glibc.malloc.hugetlb=0", "glibc.malloc.hugetlb=1"
    for chosen in (off, on, f"glibc.malloc.arena_max=2:{off}"):
        assert host_memory.huge_pages_environ({"GLIBC_TUNABLES": chosen}) is None


@pytest.mark.parametrize("libc", [("glibc", "2.34"), ("", ""), ("musl", "1.2"), ("glibc", "unknown")])
def test_nothing_where_glibc_lacks_the_tunable(monkeypatch, libc):
    monkeypatch.setattr(host_memory.platform, "libc_ver", lambda: libc)
    monkeypatch.setattr(host_memory, "_thp_possible", lambda: True)
    assert host_memory.huge_pages_environ({}) is None


def test_nothing_where_the_kernel_has_huge_pages_off(monkeypatch, tmp_path):
    monkeypatch.setattr(host_memory.platform, "libc_ver", lambda: ("glibc", "2.36"))
    setting = tmp_path / "enabled"
    monkeypatch.setattr(host_memory, "THP_SETTING", setting)
    assert host_memory.huge_pages_environ({}) is None  # no such file: not Linux, or no THP
    setting.write_text("always madvise [never]\n")
    assert host_memory.huge_pages_environ({}) is None
    setting.write_text("always [madvise] never\n")
    assert host_memory.huge_pages_environ({}) == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


def test_the_reexec_keeps_the_process_and_its_command_line(tmp_path):
    """The same pid, interpreter options and arguments after the exec; the tunable set exactly when this
    host supports it (otherwise the call returns and the process goes on unchanged)."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import json, os, sys\n"
        "first = 'GSPO_PROBE_PID' not in os.environ\n"
        "if first:\n"
        "    os.environ['GSPO_PROBE_PID'] = str(os.getpid())\n"
        "    print('before', flush=True)\n"
        "from gspo_jax.host_memory import reexec_with_huge_pages\n"
        "reexec_with_huge_pages()\n"
        "print(json.dumps(dict(first=first, pid=os.getpid(), start=int(os.environ['GSPO_PROBE_PID']),\n"
        "    argv=sys.argv[1:], optimize=sys.flags.optimize, tunables=os.environ.get('GLIBC_TUNABLES'))))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, "-O", str(probe), "a b", "--x=1"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "before" and len(lines) == 2  # printed once, flushed before the exec
    out = json.loads(lines[1])
    assert out["pid"] == out["start"] and out["argv"] == ["a b", "--x=1"] and out["optimize"] == 1
    supported = host_memory.huge_pages_environ(env) is not None
    assert out["first"] is not supported  # re-executed: the second start printed
    assert out["tunables"] == ("glibc.malloc.hugetlb=1" if supported else None)

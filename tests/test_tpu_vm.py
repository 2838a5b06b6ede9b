"""scripts/tpu_vm/*.sh, without gcloud or a TPU: their syntax; the commands they print (parsed back with
shlex, so the printing is checked to be correctly shell-quoted); that a dry run calls nothing; that a real
run calls a fake `gcloud` (first on PATH, recording its arguments) with exactly what was printed; the
refusals (exit 2, one line naming what is missing, no gcloud call); and the shell commands that run.sh
and stop.sh send to the workers, run here in a temporary worker home."""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPTS_DIR = Path(__file__).resolve().parents[1] / "scripts" / "tpu_vm"
ENTRY_POINTS = ["create.sh", "setup.sh", "run.sh", "logs.sh", "fetch.sh", "stop.sh", "delete.sh"]
SLICE = {"TPU_NAME": "my-tpu", "ZONE": "us-east5-a"}
NEW_SLICE = {**SLICE, "ACCELERATOR_TYPE": "v5p-64", "RUNTIME_VERSION": "v2-alpha-tpuv5"}
ZONE = ["--zone", "us-east5-a"]
CONFIG, WORKDIR = "configs/gspo.py:qwen3_30b_a3b", "/mnt/gcs/runs/gspo_30b"
ODD_FLAG = "--config.note=it's a b"  # a space and a quote: survives two rounds of shell quoting

# Records its arguments, one JSON list a line; answers `describe` with the next of GCLOUD_STATES.
FAKE_GCLOUD = """#!{python}
import json, os, sys
log = os.environ["GCLOUD_LOG"]
with open(log, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
if "describe" in sys.argv:
    states = os.environ.get("GCLOUD_STATES", "ACTIVE").split(",")
    n = sum("describe" in json.loads(line) for line in open(log)) - 1
    print(states[min(n, len(states) - 1)])
"""


class Result:
    def __init__(self, process: subprocess.CompletedProcess, calls: list[list[str]]):
        self.rc, self.stdout, self.stderr, self.calls = process.returncode, process.stdout, process.stderr, calls
        # The commands the script printed ("+ " and one shell-quoted line each), as argument lists.
        self.printed = [shlex.split(line[2:]) for line in self.stderr.splitlines() if line.startswith("+ ")]

    def gcloud(self) -> list[list[str]]:
        """The printed gcloud commands, without the leading `gcloud`."""
        return [cmd[1:] for cmd in self.printed if cmd[0] == "gcloud"]


@pytest.fixture
def sh(tmp_path):
    """sh(script, *args, **env) runs scripts/tpu_vm/<script> with only PATH, HOME, TMPDIR and `env` set."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    gcloud = bin_dir / "gcloud"
    gcloud.write_text(FAKE_GCLOUD.format(python=sys.executable))
    gcloud.chmod(0o755)
    log = tmp_path / "gcloud.log"

    def run(script: str, *args: str, **env: str) -> Result:
        log.unlink(missing_ok=True)
        base = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path), "TMPDIR": str(tmp_path)}
        p = subprocess.run(
            ["bash", str(SCRIPTS_DIR / script), *args],
            env={**base, "GCLOUD_LOG": str(log), **env},
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        return Result(p, calls)

    return run


def command_of(ssh: list[str]) -> str:
    """The shell command of a printed `gcloud compute tpus tpu-vm ssh ... --command CMD`."""
    return ssh[ssh.index("--command") + 1]


@pytest.mark.parametrize("script", sorted(p.name for p in SCRIPTS_DIR.glob("*.sh")))
def test_scripts_parse(script):
    p = subprocess.run(["bash", "-n", str(SCRIPTS_DIR / script)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def test_every_script_is_here_and_executable():
    assert sorted(p.name for p in SCRIPTS_DIR.glob("*.sh")) == sorted([*ENTRY_POINTS, "common.sh"])
    for name in ENTRY_POINTS:
        assert os.access(SCRIPTS_DIR / name, os.X_OK), name


@pytest.mark.parametrize("script", ENTRY_POINTS)
def test_help_needs_no_variables_and_calls_nothing(sh, script):
    r = sh(script, "--help")
    assert r.rc == 0, r.stderr
    assert f"Usage: scripts/tpu_vm/{script}" in r.stdout
    assert "Variables" in r.stdout and not r.stdout.startswith("#")
    assert r.calls == [] and r.printed == []


def test_create_prints_and_runs_the_create_command(sh):
    want = ["compute", "tpus", "tpu-vm", "create", "my-tpu", "--accelerator-type", "v5p-64"]
    want += ["--version", "v2-alpha-tpuv5", "--spot", *ZONE]
    dry = sh("create.sh", "--dry-run", SPOT="1", **NEW_SLICE)
    assert dry.rc == 0, dry.stderr
    assert dry.gcloud() == [want] and dry.calls == []
    real = sh("create.sh", SPOT="1", **NEW_SLICE)
    assert real.rc == 0, real.stderr
    assert real.calls == [want] == real.gcloud()
    # PREEMPTIBLE=1, a project and extra gcloud flags.
    r = sh("create.sh", "--reserved", PREEMPTIBLE="1", PROJECT="proj", DRY_RUN="1", **NEW_SLICE)
    assert r.gcloud() == [[*want[:-3], "--preemptible", "--reserved", *ZONE, "--project", "proj"]] and r.calls == []


def test_create_queued_waits_until_active(sh):
    create = ["compute", "tpus", "queued-resources", "create", "my-tpu-qr", "--node-id", "my-tpu"]
    create += ["--accelerator-type", "v5p-64", "--runtime-version", "v2-alpha-tpuv5", "--spot", *ZONE]
    describe = ["compute", "tpus", "queued-resources", "describe", "my-tpu-qr", "--format=value(state.state)", *ZONE]
    dry = sh("create.sh", "--dry-run", QUEUED="1", SPOT="1", **NEW_SLICE)
    assert dry.rc == 0, dry.stderr
    assert dry.gcloud() == [create, describe] and dry.calls == []

    states = "WAITING_FOR_RESOURCES,PROVISIONING,ACTIVE"
    r = sh("create.sh", QUEUED="1", SPOT="1", POLL_SECONDS="0", GCLOUD_STATES=states, **NEW_SLICE)
    assert r.rc == 0, r.stderr
    assert r.calls == [create, describe, describe, describe] == r.gcloud()
    assert "PROVISIONING" in r.stderr

    r = sh("create.sh", QUEUED="1", QR_ID="q7", POLL_SECONDS="0", GCLOUD_STATES="FAILED", **NEW_SLICE)
    assert r.rc == 1 and "FAILED" in r.stderr
    assert [c[3:5] for c in r.calls] == [["create", "q7"], ["describe", "q7"]]
    assert "--spot" not in r.calls[0]

    r = sh("create.sh", QUEUED="1", WAIT_TIMEOUT="0", GCLOUD_STATES="WAITING_FOR_RESOURCES", **NEW_SLICE)
    assert r.rc == 1 and "not ACTIVE after 0s" in r.stderr
    assert [c[3] for c in r.calls] == ["create", "describe"]


def test_delete(sh):
    r = sh("delete.sh", **SLICE)
    assert r.rc == 0, r.stderr
    assert r.calls == [["compute", "tpus", "tpu-vm", "delete", "my-tpu", "--quiet", *ZONE]] == r.gcloud()
    r = sh("delete.sh", QUEUED="1", **SLICE)
    assert r.calls == [["compute", "tpus", "queued-resources", "delete", "my-tpu-qr", "--force", "--quiet", *ZONE]]
    dry = sh("delete.sh", "--dry-run", **SLICE)
    assert dry.rc == 0 and dry.calls == [] and dry.gcloud()[0][3] == "delete"


def test_setup_copies_head_installs_and_mounts_on_every_worker(sh):
    r = sh("setup.sh", "--dry-run", BUCKET="gs://my-bucket", PROJECT="proj", **SLICE)
    assert r.rc == 0, r.stderr
    assert r.calls == []
    archive = next(cmd for cmd in r.printed if cmd[0] == "git")
    assert archive[-1] == "HEAD" and "archive" in archive
    tarball = archive[archive.index("-o") + 1]
    assert not Path(tarball).exists()  # a dry run writes nothing
    scp, *ssh = r.gcloud()
    assert scp[:4] == ["compute", "tpus", "tpu-vm", "scp"] and scp[4] == tarball and "--worker=all" in scp
    assert all(c[3] == "ssh" and "--worker=all" in c and c[-2:] == ["--project", "proj"] for c in ssh)
    commands = [command_of(c) for c in ssh]
    assert any("tar -xzf" in c for c in commands)
    assert any("python3.11 -m venv .venv" in c and '.venv/bin/pip install -q -e ".[tpu]"' in c for c in commands)
    assert any("gcsfuse --implicit-dirs" in c and c.endswith("my-bucket /mnt/gcs)") for c in commands)

    r = sh("setup.sh", "--dry-run", REPO_URL="https://example.com/gspo_jax.git", PYTHON="python3.12", **SLICE)
    assert [cmd[0] for cmd in r.printed] == ["gcloud", "gcloud"]  # no archive, no mount
    clone, install = (command_of(c) for c in r.gcloud())
    assert "git clone https://example.com/gspo_jax.git gspo_jax" in clone
    assert "python3.12 -m venv" in install and "gcsfuse" not in install


def test_run_starts_the_trainer_on_every_worker(sh):
    extra = ["--config.hf_checkpoint=/mnt/gcs/hf/Qwen3-30B-A3B", ODD_FLAG]
    dry = sh("run.sh", "--dry-run", CONFIG, WORKDIR, *extra, **SLICE)
    assert dry.rc == 0, dry.stderr
    real = sh("run.sh", CONFIG, WORKDIR, *extra, **SLICE)
    assert real.rc == 0, real.stderr
    assert dry.calls == [] and real.calls == dry.gcloud() == real.gcloud()
    check, start = dry.gcloud()
    assert all(c[3:6] == ["ssh", "my-tpu", "--worker=all"] for c in (check, start))
    train = f"scripts/train.py --config {CONFIG} --workdir {WORKDIR} --multihost {extra[0]}"
    assert train in command_of(start) and "setsid nohup" in command_of(start)
    assert "logs.sh" in dry.stderr  # how to follow it
    assert "warning" not in dry.stderr
    r = sh("run.sh", "--dry-run", CONFIG, "/home/me/runs/x", **SLICE)
    assert r.rc == 0 and "warning: WORKDIR /home/me/runs/x is not under /mnt/gcs" in r.stderr


def test_logs_stop_fetch(sh):
    (ssh,) = sh("logs.sh", "--dry-run", "3", **SLICE).gcloud()
    assert "--worker=3" in ssh and command_of(ssh) == "cd gspo_jax && tail -n 100 -F logs/latest.log"
    (ssh,) = sh("logs.sh", RUN_NAME="gspo_30b", REPO_DIR="~/src/g", **SLICE).calls
    assert "--worker=0" in ssh and command_of(ssh).endswith("cd src/g && tail -n 100 -F logs/gspo_30b.$(hostname).log")

    stop = sh("stop.sh", **SLICE)
    assert stop.rc == 0 and "--worker=all" in stop.calls[0] and "kill -TERM" in command_of(stop.calls[0])

    bucket = sh("fetch.sh", WORKDIR, "out", BUCKET="my-bucket")  # from the bucket: no slice needed
    assert bucket.rc == 0, bucket.stderr
    rsync = ["storage", "rsync", "--recursive", "gs://my-bucket/runs/gspo_30b", "out/gspo_30b"]
    assert bucket.calls == [[*rsync, "--exclude=^(checkpoints|warm_start_[^/]*)/"]] == bucket.gcloud()
    assert bucket.printed[0] == ["mkdir", "-p", "out/gspo_30b"]
    assert sh("fetch.sh", WORKDIR, "out", BUCKET="my-bucket", WITH_CHECKPOINTS="1").calls == [rsync]

    worker = sh("fetch.sh", "--dry-run", "/data/runs/r1", "out", **SLICE)
    assert worker.rc == 0 and worker.calls == []
    ssh, scp = worker.gcloud()
    assert "--worker=0" in ssh and "--exclude=./checkpoints" in command_of(ssh)
    assert scp[3] == "scp" and "--worker=0" in scp and scp[5] == "out/r1.tar.gz"
    assert worker.printed[-2][:2] == ["tar", "-xzf"]
    (scp,) = sh("fetch.sh", "--dry-run", "/data/runs/r1", "out", WITH_CHECKPOINTS="1", **SLICE).gcloud()
    assert scp[3:7] == ["scp", "--recurse", "my-tpu:/data/runs/r1", "out/"] and "--worker=0" in scp


@pytest.mark.parametrize(
    "script, args, env, names",
    [
        ("delete.sh", [], {"ZONE": "z"}, ["TPU_NAME"]),
        ("setup.sh", [], {}, ["TPU_NAME", "ZONE"]),
        ("create.sh", [], SLICE, ["ACCELERATOR_TYPE", "RUNTIME_VERSION"]),
        ("create.sh", [], {**NEW_SLICE, "SPOT": "1", "PREEMPTIBLE": "1"}, ["SPOT", "PREEMPTIBLE"]),
        ("create.sh", [], {**NEW_SLICE, "QUEUED": "1", "PREEMPTIBLE": "1"}, ["QUEUED", "PREEMPTIBLE", "SPOT"]),
        ("create.sh", [], {**NEW_SLICE, "SPOT": "yes"}, ["SPOT=yes"]),
        ("run.sh", [CONFIG], SLICE, ["CONFIG", "WORKDIR"]),
        ("run.sh", [CONFIG, WORKDIR], {"ZONE": "z"}, ["TPU_NAME"]),
        ("run.sh", [CONFIG, "runs/x"], SLICE, ["WORKDIR", "absolute"]),
        ("logs.sh", ["w1"], SLICE, ["WORKER"]),
        ("fetch.sh", [WORKDIR], SLICE, ["WORKDIR", "DEST"]),
        ("fetch.sh", [WORKDIR, "out"], {}, ["TPU_NAME", "ZONE"]),
        ("stop.sh", ["now"], SLICE, ["unexpected argument: now"]),
    ],
)
def test_refusals_exit_2_before_any_gcloud_call(sh, script, args, env, names):
    r = sh(script, *args, **env)
    assert r.rc == 2, (r.stdout, r.stderr)
    assert r.calls == [] and r.printed == []
    (line,) = r.stderr.splitlines()
    assert line.startswith(f"{script}: error: ")
    assert all(name in line for name in names), line


@pytest.mark.skipif(sys.platform != "linux" or not shutil.which("setsid"), reason="needs /proc and setsid")
def test_worker_commands_start_refuse_and_stop_a_trainer(sh, tmp_path):
    """run.sh's and stop.sh's worker commands, run by bash in a fake worker home whose .venv/bin/python
    prints its arguments and sleeps."""
    home = tmp_path / "worker"
    (home / "gspo_jax" / ".venv" / "bin").mkdir(parents=True)
    python = home / "gspo_jax" / ".venv" / "bin" / "python"
    python.write_text(
        f"#!{sys.executable}\nimport sys, time\nprint('trainer argv:', sys.argv[1:], flush=True)\ntime.sleep(30)\n"
    )
    python.chmod(0o755)
    check, start = (command_of(c) for c in sh("run.sh", "--dry-run", CONFIG, WORKDIR, ODD_FLAG, **SLICE).gcloud())
    (stop,) = (command_of(c) for c in sh("stop.sh", "--dry-run", **SLICE).gcloud())

    def on_worker(command):
        return subprocess.run(["bash", "-c", command], cwd=home, capture_output=True, text=True, timeout=30)

    assert on_worker(check).returncode == 0
    assert "no trainer running" in on_worker(stop).stdout
    started = on_worker(start)
    assert started.returncode == 0, started.stderr
    logs = home / "gspo_jax" / "logs"
    for _ in range(200):  # until the fake trainer has started and printed
        if "trainer argv" in (logs / "latest.log").read_text():
            break
        time.sleep(0.05)
    pid = int((logs / "train.pid").read_text())
    cmdline = Path(f"/proc/{pid}/cmdline")
    try:
        assert b"scripts/train.py" in cmdline.read_bytes()  # the pid file names the trainer itself
        refused = on_worker(check)
        assert refused.returncode == 1 and f"still running (pid {pid})" in refused.stderr
        stopped = on_worker(stop)
        assert stopped.returncode == 0 and f"SIGTERM sent to trainer pid {pid}" in stopped.stdout
        for _ in range(200):  # until it has exited (a zombie's cmdline is empty)
            if not (cmdline.exists() and cmdline.read_bytes()):
                break
            time.sleep(0.05)
        assert on_worker(check).returncode == 0
    finally:
        if cmdline.exists() and cmdline.read_bytes():
            os.kill(pid, signal.SIGKILL)
    latest = (logs / "latest.log").resolve()
    assert latest.parent == logs and latest.name.startswith("gspo_30b.") and latest.name.endswith(".log")
    assert latest.name in started.stdout
    header, output = latest.read_text().splitlines()
    assert header.startswith("=== ") and header.endswith(" run.sh")
    want = ["scripts/train.py", "--config", CONFIG, "--workdir", WORKDIR, "--multihost", ODD_FLAG]
    assert output == f"trainer argv: {want}"

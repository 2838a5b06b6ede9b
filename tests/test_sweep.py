"""Sweeps: override grids and run names checked by hand, disjoint shards, one sweep process per workroot,
failures recorded without stopping the others, and the tiny sweep killed mid-way and restarted finishing
every run exactly once, then reported."""

import importlib.util
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gspo_jax import provenance, workdir
from gspo_jax.study import report as sweep_report
from gspo_jax.study import runner as sweep_runner
from gspo_jax.study import sweeps
from gspo_jax.study.runner import Runner, SweepLock, cpu_slots, device_memory_env
from gspo_jax.workdir import Lock, WorkdirBusy

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "sweeps" / "tiny.py"
# The shipped sweeps: every file of configs/sweeps/ but claims.py, the study's claims table (scripts/claims.py).
SHIPPED = sorted(p.stem for p in (ROOT / "configs" / "sweeps").glob("*.py") if p.stem != "claims")

spec = importlib.util.spec_from_file_location("sweep_script", ROOT / "scripts" / "sweep.py")
sweep_script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sweep_script)


def child_env() -> dict[str, str]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # the fake 8-device CPU is for this process's tests, not the runs
    return env


# ------------------------------------------------------------------ grid, names, sweep files


def test_grid_is_the_product_in_axis_order_last_axis_fastest():
    assert sweeps.grid({"train.routing_replay": ["none", "R3"]}, seed=[0, 1]) == [
        {"train.routing_replay": "none", "seed": 0},
        {"train.routing_replay": "none", "seed": 1},
        {"train.routing_replay": "R3", "seed": 0},
        {"train.routing_replay": "R3", "seed": 1},
    ]
    assert len(sweeps.grid(algorithm=["grpo", "dapo", "gspo"], seed=[0, 1, 2], **{"train.epochs": [1, 2]})) == 18
    with pytest.raises(sweeps.SweepError, match="'seed'"):
        sweeps.grid(seed=[])
    with pytest.raises(sweeps.SweepError, match="'algorithm'"):
        sweeps.grid(algorithm="gspo")  # a string is not a list of values


def test_run_names_are_readable_deterministic_and_filesystem_safe():
    name = sweeps.run_name
    assert name("gspo", {"algorithm": "grpo", "train.routing_replay": "R3", "seed": 1}) == "grpo-replay=R3-seed=1"
    assert name("gspo", {"seed": 1, "algorithm": "grpo"}) == "grpo-seed=1"  # the algorithm leads
    assert name("gspo", {}) == "gspo"  # no algorithm override: the base config's
    assert name("gspo", {"train.learning_rate": 1e-05}) == "gspo-learning_rate=1e-05"
    # Two keys with one last component: both spelled out.
    assert (
        name("gspo", {"train.learning_rate": 0.0001, "warm_start.learning_rate": 0.003, "seed": 0})
        == "gspo-train.learning_rate=0.0001-warm_start.learning_rate=0.003-seed=0"
    )
    dense = {"task.arithmetic.ops": "+-*/", "model.dense_layers": (0, 1)}
    assert name("gspo", dense) == "gspo-ops=+-__-dense_layers=_0,_1_"
    long_a = name("gspo", {f"k{i}": "x" * 20 for i in range(8)})
    long_b = name("gspo", {f"k{i}": "x" * 20 for i in range(7)} | {"k7": "y" * 20})
    assert len(long_a) == len(long_b) == 120 and long_a != long_b and long_a[:100] == long_b[:100]


def test_the_tiny_sweep_expands_to_four_named_runs_in_two_arms():
    sweep = sweeps.load_sweep(TINY, ROOT)
    assert (sweep.name, sweep.base) == ("tiny", "configs/gspo.py:tiny")
    assert [(r.index, r.name, r.arm, r.config) for r in sweep.runs] == [
        (0, "grpo-seed=0", "grpo", "configs/grpo.py:tiny"),
        (1, "grpo-seed=1", "grpo", "configs/grpo.py:tiny"),
        (2, "gspo-seed=0", "gspo", "configs/gspo.py:tiny"),
        (3, "gspo-seed=1", "gspo", "configs/gspo.py:tiny"),
    ]
    assert sweep.runs[1].train_args("/w/runs/grpo-seed=1") == [
        "scripts/train.py",
        "--config",
        "configs/grpo.py:tiny",
        "--workdir",
        "/w/runs/grpo-seed=1",
        "--config.train.num_iterations=3",  # COMMON's, not in the name
        "--config.seed=1",
        "--config.warm_start.cache_dir=/w/warm_starts",  # shared by the sweep's runs
        "--config.logging.group=tiny",  # a tracker groups the sweep's runs, tagged by arm
        "--config.logging.arm=grpo",
    ]


@pytest.mark.parametrize(
    "body, message",
    [
        ("def runs(): return [{}]", "BASE must name a config"),
        ("BASE = 'configs/gspo.py:tiny'", "needs a function runs"),
        ("BASE = 'configs/gspo.py:tiny'\ndef runs(): return []", "yielded no runs"),
        ("BASE = 'configs/nope.py'\ndef runs(): return [{}]", "config file not found: configs/nope.py"),
        ("BASE = 'configs/gspo.py'\ndef runs(): yield {'algorithm': 'nope'}", "config file not found: configs/nope.py"),
        ("BASE = 'configs/gspo.py'\ndef runs(): return [{'seed': 0}, {'seed': 0}]", "runs 0 and 1 are both named"),
        ("BASE = 'configs/gspo.py'\ndef runs(): return [{'config.seed': 0}]", "without 'config.'"),
        ("BASE = 'configs/gspo.py'\ndef runs(): return [['seed', 0]]", "not a dict"),
        ("BASE = 'configs/gspo.py'\ndef runs(): return grid(seed=[0])", "runs\\(\\) failed: NameError"),
        ("BASE = 1 +", "failed to load: SyntaxError"),
        ("BASE = 'configs/gspo.py:{algorithm}'\ndef runs(): return [{'seed': 0}]", "needs an 'algorithm' in every"),
        (
            "BASE = 'configs/gspo.py'\nCONTROL = {'lr': 1}\ndef runs(): return [{'seed': 0}]",
            "names no arm of this sweep",
        ),
        ("BASE = 'configs/gspo.py'\nCONTROL = 3\ndef runs(): return [{'seed': 0}]", "CONTROL must be a dict"),
        ("BASE = 'configs/gspo.py'\nANALYSIS = 3\ndef runs(): return [{'seed': 0}]", "ANALYSIS must be a string"),
    ],
)
def test_bad_sweep_files_are_refused_with_one_line_naming_the_problem(tmp_path, body, message):
    path = tmp_path / "bad.py"
    path.write_text(body + "\n")
    with pytest.raises(sweeps.SweepError, match=message) as e:
        sweeps.load_sweep(path, ROOT)
    assert "\n" not in str(e.value)


def test_a_base_with_an_algorithm_placeholder_passes_the_algorithm_as_the_config_argument(tmp_path):
    path = tmp_path / "study.py"
    path.write_text(
        "BASE = 'configs/gspo.py:{algorithm}'\ndef runs(): return grid(algorithm=['tiny'], seed=[0, 1])\n"
        "from gspo_jax.study.sweeps import grid\n"
    )
    sweep = sweeps.load_sweep(path, ROOT)
    assert [(r.name, r.arm, r.config) for r in sweep.runs] == [
        ("tiny-seed=0", "tiny", "configs/gspo.py:tiny"),
        ("tiny-seed=1", "tiny", "configs/gspo.py:tiny"),
    ]


def test_shards_are_disjoint_and_cover_the_sweep():
    assert sweeps.parse_shard("1/3") == (1, 3)
    for bad in ("3/3", "1/0", "-1/2", "a/b", "1", "1/2/3"):
        with pytest.raises(sweeps.SweepError, match="expected i/n with 0 <= i < n"):
            sweeps.parse_shard(bad)
    runs = [sweeps.Run(i, f"r{i}", f"r{i}", "configs/gspo.py", {}) for i in range(7)]
    parts = [[r.index for r in sweeps.shard(runs, i, 3)] for i in range(3)]
    assert parts == [[0, 3, 6], [1, 4], [2, 5]]


def test_list_prints_names_statuses_and_commands_of_a_shard(tmp_path, capsys):
    assert sweep_script.main([str(TINY), "--workroot", str(tmp_path), "--list", "--shard", "1/2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# ")
    assert [line.split("\t")[:2] for line in lines[1:]] == [[n, "not started"] for n in ("grpo-seed=1", "gspo-seed=1")]
    assert (
        lines[1]
        .split("\t")[2]
        .endswith(
            f"scripts/train.py --config configs/grpo.py:tiny --workdir {tmp_path}/runs/grpo-seed=1 "
            f"--config.train.num_iterations=3 --config.seed=1 --config.warm_start.cache_dir={tmp_path}/warm_starts "
            "--config.logging.group=tiny --config.logging.arm=grpo"
        )
    )
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "args, message", [(["--shard", "2/2"], "--shard '2/2'"), (["--parallel", "0"], "--parallel=0: must be >= 1")]
)
def test_bad_arguments_are_refused_with_exit_2(tmp_path, capsys, args, message):
    assert sweep_script.main([str(TINY), "--workroot", str(tmp_path), *args]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: ") and message in line


# ------------------------------------------------------------------ locks, CPUs, state


def test_a_second_sweep_on_a_workroot_is_refused_naming_the_holder(tmp_path, capsys):
    with SweepLock(tmp_path):  # a lock is per open file: this process holds it against its own second try
        assert sweep_script.main([str(TINY), "--workroot", str(tmp_path)]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert "another sweep is running" in line and f"pid {os.getpid()}" in line
        assert not (tmp_path / "runs").exists()
    # Shards of one sweep may share a workroot; one shard twice may not.
    with SweepLock(tmp_path, (0, 2)), SweepLock(tmp_path, (1, 2)), pytest.raises(WorkdirBusy):
        SweepLock(tmp_path, (0, 2)).acquire()


def test_cpu_slots_split_the_cpus_into_disjoint_blocks(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert cpu_slots(1) == [[0, 1, 2, 3]]
    assert cpu_slots(2) == [[0, 1], [2, 3]]
    assert cpu_slots(3) == [[0], [1], [2, 3]]
    assert cpu_slots(6) == [[0], [0], [1], [2], [2], [3]]  # more runs than CPUs: shared round-robin


def test_each_child_gets_its_share_of_one_accelerator(tmp_path, monkeypatch):
    """N runs at once: JAX's client memory settings give each 0.9/N of a GPU and no preallocation (one
    run keeps JAX's defaults; a value the user set is kept), in the environment the child is started with."""
    assert device_memory_env(1, {}) == {}
    assert device_memory_env(2, {}) == {
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.450",
    }
    assert device_memory_env(3, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.2"}) == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    seen = []

    class Started:
        pid = -1

        def __init__(self, command, env, **_):
            seen.append(env)

    monkeypatch.setattr(sweep_runner.subprocess, "Popen", Started)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    run = sweeps.Run(0, "r", "r", "configs/gspo.py:tiny", {"seed": 0})
    for parallel in (1, 4):
        runner = Runner([run], tmp_path, ROOT, parallel=parallel, out=io.StringIO())
        runner.slots = None  # no affinity for a process that is not there
        runner._start(run, 0)
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in seen[0] and "XLA_PYTHON_CLIENT_PREALLOCATE" not in seen[0]
    assert (seen[1]["XLA_PYTHON_CLIENT_MEM_FRACTION"], seen[1]["XLA_PYTHON_CLIENT_PREALLOCATE"]) == ("0.225", "false")


def test_run_state_is_recorded_per_attempt(tmp_path):
    run_dir = tmp_path / "r"
    assert sweeps.status(run_dir) == "not started"
    run_dir.mkdir()
    assert sweeps.status(run_dir) == "unfinished"
    sweeps.record_attempt(run_dir, "stopped", rc=75, seconds=1.5, command=["x"], tail=["a"])
    assert sweeps.status(run_dir) == "stopped"
    sweeps.record_attempt(run_dir, "done", rc=0, seconds=2.0, command=["x"], tail=["b"])
    state = sweeps.read_state(run_dir)
    assert (state["status"], [a["rc"] for a in state["attempts"]], state["tail"]) == ("done", [75, 0], ["b"])
    assert sorted(p.name for p in run_dir.iterdir()) == [sweeps.STATE_FILE]  # no temporary file left


def test_a_run_held_by_a_live_process_is_busy(tmp_path):
    assert not workdir.in_use(tmp_path)  # no lock file
    with Lock(tmp_path):
        assert workdir.in_use(tmp_path)
    assert not workdir.in_use(tmp_path)


# ------------------------------------------------------------------ the runner, on a fake train.py

FAKE_TRAIN = """
import json, sys
from pathlib import Path
args = dict(a.split("=", 1) for a in sys.argv[1:] if a.startswith("--config.") and "=" in a)
workdir = Path(sys.argv[sys.argv.index("--workdir") + 1])
with open(workdir / "ran.txt", "a") as f:
    f.write("ran\\n")
if args["--config.seed"] == "1":
    for i in range(30):
        print(f"line {i}")
    sys.exit(1)
(workdir / "metrics.jsonl").write_text("".join(json.dumps(dict(step=s, eval_accuracy=0.5)) + "\\n" for s in range(3)))
"""


def test_a_failed_run_is_recorded_with_its_log_and_the_others_finish(tmp_path):
    repo, root = tmp_path / "repo", tmp_path / "root"
    (repo / "scripts").mkdir(parents=True)
    (repo / "configs").mkdir()
    (repo / "configs" / "fake.py").write_text("")
    (repo / "scripts" / "train.py").write_text(textwrap.dedent(FAKE_TRAIN))
    (repo / "s.py").write_text("BASE = 'configs/fake.py'\ndef runs(): return [{'seed': s} for s in (0, 1, 2)]\n")
    sweep = sweeps.load_sweep(repo / "s.py", repo)
    out = tmp_path / "progress.txt"
    with open(out, "w") as f:
        assert Runner(sweep.runs, root, repo, parallel=2, out=f).run() == 1
    status = {r.name: sweeps.status(sweeps.workdir(root, r)) for r in sweep.runs}
    assert status == {"fake-seed=0": "done", "fake-seed=1": "failed", "fake-seed=2": "done"}
    failed = sweeps.read_state(root / "runs" / "fake-seed=1")
    assert failed["attempts"][0]["rc"] == 1
    assert failed["tail"] == [f"line {i}" for i in range(10, 30)]  # the last 20 lines of the attempt
    assert "FAILED fake-seed=1 (exit 1)" in out.read_text() and "line 29" in out.read_text()
    # A rerun retries the failure only, and says which finished run the sweep file now describes otherwise.
    state = sweeps.read_state(root / "runs" / "fake-seed=0")
    sweeps.record_attempt(
        root / "runs" / "fake-seed=0", "done", rc=0, seconds=1, command=[*state["command"], "--config.x=1"], tail=[]
    )
    with open(out, "w") as f:
        assert Runner(sweep.runs, root, repo, parallel=2, out=f).run() == 1
    ran = {r.name: (root / "runs" / r.name / "ran.txt").read_text().count("ran") for r in sweep.runs}
    assert ran == {"fake-seed=0": 1, "fake-seed=1": 2, "fake-seed=2": 1}
    assert "2 already done, 1 to run" in out.read_text()
    assert "fake-seed=0: finished with other overrides" in out.read_text()
    assert "fake-seed=2: finished with other" not in out.read_text()


def test_runs_of_another_arm_start_first(tmp_path):
    """Listed arm by arm, seeds fastest, the runs start one per arm: two seeds of an arm started together
    would compile the same programs twice."""
    repo, root = tmp_path / "repo", tmp_path / "root"
    (repo / "scripts").mkdir(parents=True)
    (repo / "configs").mkdir()
    (repo / "configs" / "fake.py").write_text("")
    (repo / "scripts" / "train.py").write_text(textwrap.dedent(FAKE_TRAIN))
    (repo / "s.py").write_text(
        "BASE = 'configs/fake.py'\ndef runs(): return [{'x': x, 'seed': s} for x in (1, 2) for s in (0, 2)]\n"
    )
    sweep = sweeps.load_sweep(repo / "s.py", repo)
    out = tmp_path / "progress.txt"
    with open(out, "w") as f:
        assert Runner(sweep.runs, root, repo, parallel=2, out=f).run() == 0
    started = [x.split("started ")[1].split()[0] for x in out.read_text().splitlines() if "started " in x]
    assert started[:2] == ["fake-x=1-seed=0", "fake-x=2-seed=0"]
    assert sorted(started) == sorted(r.name for r in sweep.runs)


# ------------------------------------------------------------------ the tiny sweep, end to end


@pytest.mark.slow
def test_the_tiny_sweep_killed_and_restarted_finishes_every_run_once_then_reports(tmp_path):
    root = tmp_path / "w"
    names = [r.name for r in sweeps.load_sweep(TINY, ROOT).runs]
    args = [sys.executable, "scripts/sweep.py", str(TINY), "--workroot", str(root), "--parallel", "2"]
    proc = subprocess.Popen(args, cwd=ROOT, env=child_env(), stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while True:  # until a run is done and one started after it (in its place) is running
        statuses = [sweeps.status(root / "runs" / n) for n in names]
        started = sum((root / "runs" / n / sweeps.LOG_FILE).exists() for n in names)
        if "done" in statuses and "unfinished" in statuses and started >= 3:
            break
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 75, err
    assert "stopping: SIGTERM sent" in err
    first = {n: sweeps.read_state(root / "runs" / n) for n in names}
    done_first = [n for n in names if first[n].get("status") == "done"]
    stopped_first = [n for n in names if first[n].get("status") == "stopped"]
    assert done_first and stopped_first, first
    assert all(first[n]["attempts"][-1]["rc"] in (75, 130, -signal.SIGTERM) for n in stopped_first)

    r = subprocess.run(args, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"{len(done_first)} already done" in r.stderr
    for n in names:
        state = sweeps.read_state(root / "runs" / n)
        assert state["status"] == "done"
        assert [a["rc"] for a in state["attempts"]].count(0) == 1  # finished exactly once
        steps = [json.loads(line)["step"] for line in (root / "runs" / n / "metrics.jsonl").read_text().splitlines()]
        assert steps == [0, 1, 2, 3]  # one row per step, after any interruption
        if n in done_first:  # not run again
            assert state == first[n]
            assert (root / "runs" / n / sweeps.LOG_FILE).read_text().count("sweep attempt") == 1
    for n in stopped_first:
        assert len(sweeps.read_state(root / "runs" / n)["attempts"]) == 2
    for n in names:  # each start that reached the run recorded where it ran (a kill in start-up may not)
        records = provenance.read(root / "runs" / n)
        assert 1 <= len(records) <= len(sweeps.read_state(root / "runs" / n)["attempts"])
        assert n not in done_first or len(records) == 1
        assert all(r["platform"] == "cpu" and r["versions"]["jax"] for r in records)

    r = subprocess.run([*args, "--report"], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    report = (root / "report.md").read_text()
    assert "4 runs: 4 done." in report
    for n in names:  # the runs table names each run's device
        row = next(line for line in report.splitlines() if line.startswith(f"| `{n}` | done | 3 |"))
        assert row.endswith(f"| {provenance.devices_of(root / 'runs' / n)} |") and "| CPU: " in row
    for arm in ("grpo", "gspo"):
        assert f"| `{arm}` | 2/2 |" in report
    figures = sorted(p.name for p in (root / "report").glob("*.png"))
    assert {"accuracy.png", "clip_fraction.png", "drift_per_layer.png"} <= set(figures)
    assert all(f"(report/{f})" in report for f in figures)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_sweep_loads_and_each_arm_builds(name):
    """A renamed config key or a bad value in a shipped sweep fails here, not an hour into the sweep."""
    from gspo_jax import built as built_lib

    sweep = sweeps.load_sweep(ROOT / "configs" / "sweeps" / f"{name}.py", ROOT)
    arms = {}
    for run in sweep.runs:
        arms.setdefault(run.arm, run)
    for run in arms.values():
        path, _, arg = run.config.partition(":")
        spec = importlib.util.spec_from_file_location(f"sweep_config_{name}", ROOT / path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        c = module.get_config(arg) if arg else module.get_config()
        for key, value in run.overrides.items():
            *parents, last = key.split(".")
            node = c
            for part in parents:
                node = node[part]
            assert last in node, f"{name}: {run.name}: no such config key {key}"
            if isinstance(node[last], tuple) and isinstance(value, str):
                value = (value,)  # as the command line gives it: --config.lora.targets=a,b is ("a,b",)
            node[last] = value
        built_lib.build(c, device_count=1)


def test_report_gives_greedy_and_sampled_gains_per_arm(tmp_path):
    """Hand-made metrics of two seeds: each accuracy's step-0, final and gain columns are the seeds'
    mean ± sd, and the accuracy figure gets a panel per accuracy."""
    repo, root = tmp_path / "repo", tmp_path / "root"
    (repo / "configs").mkdir(parents=True)
    (repo / "configs" / "fake.py").write_text("")
    (repo / "s.py").write_text("BASE = 'configs/fake.py'\ndef runs(): return [{'seed': s} for s in (0, 1)]\n")
    sweep = sweeps.load_sweep(repo / "s.py", repo)
    curves = {0: ((0.5, 0.3, 0.8), (0.2, 0.3, 0.7)), 1: ((0.4, 0.2, 0.5), (0.3, 0.3, 0.6))}  # greedy, sampled
    for run in sweep.runs:
        run_dir = sweeps.workdir(root, run)
        run_dir.mkdir(parents=True)
        greedy, sampled = curves[run.overrides["seed"]]
        rows = [
            dict(step=10 * i, eval_accuracy=g, eval_accuracy_sampled=x) for i, (g, x) in enumerate(zip(greedy, sampled))
        ]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        sweeps.record_attempt(run_dir, "done", rc=0, seconds=5.0, command=["x"], tail=[])
    report = sweep_report.write_report(sweep, root).read_text()
    # final: the mean of the evaluations after step 0 (0.55 and 0.35 greedy, 0.5 and 0.45 sampled); greedy:
    # start, final, best, AUC (0.475 and 0.325), gain (0.05 and -0.05); sampled: start, final, gain (0.3, 0.15)
    greedy = "| `fake` | 2/2 | 0.45 ± 0.071 | 0.45 ± 0.14 | 0.65 ± 0.21 | 0.4 ± 0.11 | 0 ± 0.071 |"
    assert greedy + " 0.25 ± 0.071 | 0.475 ± 0.035 | 0.225 ± 0.11 | 0/2 |" in report
    assert "sampled gain" in report and "eval_accuracy_sampled" in report
    assert (root / "report" / "accuracy.png").exists()


def test_report_figures_colour_arms_by_algorithm_and_style_them_by_the_rest():
    """27 arms (9 objectives × 3 replays) must not cycle 10 colours: an algorithm keeps its colour,
    a replay setting its line style, and no two arms look alike."""
    arms = [f"{a}-replay={r}" for r in ("none", "R2", "R3") for a in ("grpo", "gspo", "ppo")]
    style = sweep_report._styles(arms)
    assert style["grpo-replay=none"]["color"] == style["grpo-replay=R3"]["color"] != style["gspo-replay=R3"]["color"]
    assert (
        style["grpo-replay=R2"]["linestyle"]
        == style["ppo-replay=R2"]["linestyle"]
        != style["ppo-replay=R3"]["linestyle"]
    )
    assert len({(s["color"], s["linestyle"]) for s in style.values()}) == len(arms)
    many = [f"grpo-lr={i}" for i in range(12)]  # more variants than line styles: a colour each
    assert len({s["color"] for s in sweep_report._styles(many).values()}) == 12


def test_a_legend_never_sits_on_the_curves_it_names():
    """A few short arm names: a legend in each panel; a few long ones (a ladder's names grow rung by
    rung): below the panels, in a figure grown to hold them; many: beside the panels."""
    short, long = ["grpo", "gspo-replay=R3"], ["grpo", "grpo-" + "x=1-" * 20 + "seed"]
    assert [sweep_report._legend_place(a) for a in (short, long, [f"a{i}" for i in range(7)])] == [
        "panel",
        "below",
        "right",
    ]
    fig, _ = sweep_report._figure(1, long)
    assert fig.get_size_inches()[1] > sweep_report._figure(1, short)[0].get_size_inches()[1]


def _fake_sweep(tmp_path, body: str, curves: dict) -> tuple[sweeps.Sweep, Path]:
    """A sweep file `body` over configs/fake.py whose runs' metrics are `curves[run name]`: (step, greedy,
    sampled) rows, each run recorded done."""
    repo, root = tmp_path / "repo", tmp_path / "root"
    (repo / "configs").mkdir(parents=True)
    (repo / "configs" / "fake.py").write_text("")
    (repo / "s.py").write_text("BASE = 'configs/fake.py'\n" + textwrap.dedent(body))
    sweep = sweeps.load_sweep(repo / "s.py", repo)
    for run in sweep.runs:
        run_dir = sweeps.workdir(root, run)
        run_dir.mkdir(parents=True)
        rows = [dict(step=s, eval_accuracy=g, eval_accuracy_sampled=x) for s, g, x in curves[run.name]]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        sweeps.record_attempt(run_dir, "done", rc=0, seconds=1.0, command=["x"], tail=[])
    return sweep, root


def test_the_analysis_gives_intervals_paired_differences_and_collapses_at_three_thresholds(tmp_path):
    """Hand-computed: final = mean of the last 3 evaluations after step 0; a t-interval over 3 seeds;
    per-seed differences to the control arm; collapse read on the sampled accuracy at 5/10/20 points."""
    body = """
        ANALYSIS = "Stated first."
        CONTROL = {"lr": None}
        def runs(): return [{"lr": 2, "seed": s} for s in (0, 1, 2)] + [{"seed": s} for s in (0, 1, 2)]
    """
    base = lambda s: [(0, 0.5, 0.5), (10, 0.9, 0.9), (20, 0.4 + s / 10, 0.4 + s / 10), (30, 0.5, 0.5), (40, 0.6, 0.6)]
    low = lambda s: [(0, 0.5, 0.5), (10, 0.5, 0.5), (20, 0.2, 0.2), (30, 0.3 - s / 10, 0.3 - s / 10), (40, 0.4, 0.4)]
    curves = {f"fake-seed={s}": base(s) for s in range(3)} | {f"fake-lr=2-seed={s}": low(s) for s in range(3)}
    sweep, root = _fake_sweep(tmp_path, body, curves)
    assert sweep.control == {"fake-lr=2": "fake"} and sweep.analysis == "Stated first."
    text = sweep_report.analysis_text(sweep, root)
    assert text.startswith("## Analysis\n\nStated first.\n")
    # base finals: mean(0.4+s/10, 0.5, 0.6) = 0.5, 0.5333, 0.5667: mean 53.3, sd 3.33, half-width
    # 4.303 * 3.33 / sqrt(3) = 8.28
    assert "| `fake` | 3 | 53.3 ± 3.3 (45.1 to 61.6) | +3.3 ± 3.3 (-4.9 to +11.6) |" in text
    # low finals: mean(0.2, 0.3-s/10, 0.4) = 0.3, 0.2667, 0.2333; minus base: -20.0, -26.7, -33.3
    assert "| `fake-lr=2` | `fake` | -20.0, -26.7, -33.3 | -26.7 ± 6.7 (-43.2 to -10.1) |" in text
    # drops of the low arm: 20, 23.3, 26.7 points: all > 5 and > 10, two > 20
    assert "| `fake-lr=2` | sampled | 3/3 | 3/3 | 2/3 |" in text
    assert "| `fake` | sampled | 0/3 | 0/3 | 0/3 |" in text


def test_analysis_rules_by_hand():
    from gspo_jax.study import analysis

    assert analysis.final_value([(0, 0.9), (10, 0.1), (20, 0.2), (30, 0.3), (40, 0.7)]) == pytest.approx(0.4)
    assert analysis.final_value([(0, 0.9), (10, 0.3)]) == 0.3 and analysis.final_value([(0, 0.9)]) == 0.9
    iv = analysis.interval([1.0, 2.0, 3.0, 4.0])  # mean 2.5, sd 1.291, t(3) 3.182: half-width 2.054
    assert (iv.mean, round(iv.sd, 3), round(iv.lo, 3), round(iv.hi, 3)) == (2.5, 1.291, 0.446, 4.554)
    assert analysis.t975(1) == 12.706 and analysis.t975(4) == 2.776 and analysis.t975(200) == 1.96
    diffs, d = analysis.paired({0: 0.5, 1: 0.7, 2: float("nan")}, {0: 0.4, 1: 0.4, 3: 0.1})
    assert diffs == pytest.approx({0: 0.1, 1: 0.3}) and d.n == 2
    assert analysis.collapsed(0.5, 0.39, False) and not analysis.collapsed(0.5, 0.41, False)
    assert analysis.collapsed(float("nan"), 0.0, True) and not analysis.collapsed(float("nan"), 0.0, False)


def test_the_claims_table_in_results_md_is_the_one_the_committed_results_regenerate():
    """docs/RESULTS.md's claims table is exactly what `python scripts/claims.py` builds from results/."""
    from gspo_jax.study import claims

    doc = (ROOT / "docs" / "RESULTS.md").read_text(encoding="utf-8")
    table = claims.table(ROOT, claims.load(ROOT / "configs" / "sweeps" / "claims.py"))
    assert claims.current(doc) == table, "run `python scripts/claims.py --write` and review the diff"


def test_compare_gives_each_common_runs_final_accuracies_and_their_difference(tmp_path, capsys):
    body = "def runs(): return [{'seed': s} for s in (0, 1)]\n"
    curve = [(0, 0.5, 0.4), (10, 0.6, 0.5)]
    sweep, root = _fake_sweep(tmp_path / "a", body, {"fake-seed=0": curve, "fake-seed=1": curve})
    _, other = _fake_sweep(
        tmp_path / "b", body, {"fake-seed=0": [(0, 0.5, 0.4), (10, 0.64, 0.5)], "fake-seed=1": curve}
    )
    text = sweep_report.compare(sweep, root, other)
    assert "| `fake-seed=0` | 60.0 | 64.0 | -4.0 | 50.0 | 50.0 | +0.0 |" in text
    assert "2 runs in both; final accuracies differ by 4.0 points at most, 1.0 on average." in text
    repo = tmp_path / "a" / "repo"
    sweep_script.REPO, saved = repo, sweep_script.REPO
    try:
        assert (
            sweep_script.main([str(repo / "s.py"), "--workroot", str(root), "--compare", str(tmp_path / "nope")]) == 2
        )
        assert sweep_script.main([str(repo / "s.py"), "--workroot", str(root), "--compare", str(other)]) == 0
    finally:
        sweep_script.REPO = saved
    assert "-4.0" in capsys.readouterr().out

"""Runs that cannot be silently corrupted: one run per workdir, refused config drift, bad input stopped at
the door (one line, workdir untouched), non-finite updates skipped, SIGINT like SIGTERM, documented exit
codes, one metrics row per step after any interruption."""

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from train_cli import train_cli

from gspo_jax import checkpoint, sharding, train, workdir
from gspo_jax import iteration as iteration_lib
from gspo_jax import programs as programs_lib
from gspo_jax import run as run_lib
from gspo_jax.built import build, resolve_microbatches
from gspo_jax.checkpoint import Checkpointer
from gspo_jax.config import as_json, base_config
from gspo_jax.validation import ConfigError

ROOT = Path(__file__).resolve().parents[1]
EXIT_REFUSED, EXIT_STOPPED = 2, 75


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file under `path` with its bytes: 'untouched' means equal snapshots."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def cli(*args, timeout=300):
    """The real command in a child process; the refusals run it in this process (`train_cli`)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    return subprocess.run(
        [sys.executable, "scripts/train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def one_line(r) -> str:
    lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1, r.stderr
    return lines[0]


def rows(path: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (path / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ refused at config build


@pytest.mark.parametrize(
    "key, value, field",
    [
        ("loss.eps_low", 1.5, "eps_low"),
        ("rollout.group_size", 1, "group_size"),
        ("rollout.temperature", 0.0, "temperature"),
        ("train.b1", 1.0, "b1"),
        ("train.warmup_steps", -1, "warmup_steps"),
        ("train.learning_rate", float("inf"), "learning_rate"),
        ("warm_start.b2", 1.5, "b2"),
        ("mesh.data", 3, "mesh"),  # does not divide the batch of 8 (and more than the devices here)
        ("mesh.data", 16, "mesh"),  # more devices than present
        ("mesh.fsdp", 0, "mesh.fsdp"),
        ("prompt_len", 8, "prompt_len"),  # the task's prompts need 16 tokens
        ("tokenizer_path", "/no/such/tokenizer", "tokenizer_path"),
        ("hf_checkpoint", "/no/such/checkpoint", "hf_checkpoint"),
        ("warm_start.cache_dir", "/no/such/parent/cache", "cache_dir"),
        ("task.arithmetic.digits", 0, "digits"),
        ("task.arithmetic.holdout", 1.0, "holdout"),
        ("task.name", "sudoku", "task.name"),
        ("train.drift_subsample", 3, "drift_subsample"),  # not a divisor of the batch of 8
        ("train.drift_subsample", 0, "drift_subsample"),
        ("model.batch_chunks", 3, "batch_chunks"),  # not a divisor of the batch of 8
        ("model.batch_chunks", 0, "batch_chunks"),
        ("model.logprob_chunk", -1, "logprob_chunk"),
        ("train.microbatch_tokens", -1, "microbatch_tokens"),
        ("rollout.sampler_threads", 3, "sampler_threads"),  # not a divisor of the batch of 8
        ("rollout.sampler_threads", -1, "sampler_threads"),
        ("train.old_logp_source", "engine", "old_logp_source"),  # the typed sections' own checks
        ("train.keep_checkpoints", 0, "keep_checkpoints"),
        ("warm_start.steps", -1, "warm_start.steps"),
        ("max_new_tokens", 0, "max_new_tokens"),
    ],
)
def test_values_that_cannot_work_are_refused_at_build_naming_the_key(key, value, field):
    c = base_config("gspo", "tiny")
    section, _, name = key.rpartition(".")
    (c[section] if section else c)[name] = value
    with pytest.raises(ConfigError, match=field) as e:
        build(c)
    assert "\n" not in str(e.value)


def test_the_trainer_reads_typed_sections_and_unknown_keys_are_refused():
    """`build` gives the trainer typed sections holding the config's values (the optimizer keys apart);
    a key no section has is refused at build, naming the section and its allowed fields."""
    c = base_config("gspo", "tiny")
    b = build(c)
    assert b.train.minibatches == c.train.minibatches and b.optimizer.learning_rate == c.train.learning_rate
    assert b.warm_start.steps == c.warm_start.steps and b.warm_start.optimizer.b2 == c.warm_start.b2
    assert b.mesh.axes() == {k: c.mesh[k] for k in sharding.MESH_AXES}
    assert b.sampler.seq_len == c.prompt_len + c.max_new_tokens
    assert b.train.updates == c.train.num_iterations * c.train.epochs * c.train.minibatches
    for section in ("train", "warm_start", "mesh"):
        d = base_config("gspo", "tiny")
        d[section].bogus = 1
        with pytest.raises(ConfigError, match=rf"config.{section}: unknown field\(s\) \['bogus'\]; allowed"):
            build(d)


def test_mesh_data_axes_must_divide_every_batch():
    c = base_config("gspo", "tiny")  # 8 completions, minibatches of 4, warm-start batches of 8
    c.mesh.data = 8
    with pytest.raises(ConfigError, match=r"must divide a micro-batch \(train.minibatches, train.microbatches\)=4"):
        build(c)
    c.mesh.update(data=4, fsdp=1)
    build(c)
    c.train.drift_subsample = 4  # a drift batch of 2 cannot be split over 4
    with pytest.raises(ConfigError, match=r"must divide a drift batch chunk \(train.drift_subsample, model.ba"):
        build(c)
    c.train.drift_subsample = 1
    c.model.batch_chunks = 4  # batch chunks of 2 cannot be split over 4 either
    with pytest.raises(ConfigError, match=r"must divide a batch chunk \(model.batch_chunks\)=2"):
        build(c)
    c.model.batch_chunks = 1
    c.mesh.update(data=1, expert=4)  # the expert axis splits the batch too
    build(c)
    c.train.microbatches = 2  # micro-batches of 2 cannot be split over data×fsdp×expert = 4
    with pytest.raises(ConfigError, match=r"data×fsdp×expert=4 must divide a micro-batch"):
        build(c)
    c.train.microbatches = 1
    c.model.num_experts = 6  # 6 experts do not split over 4 expert shards
    with pytest.raises(ConfigError, match=r"mesh.expert=4 .*a divisor of model.num_experts=6"):
        build(c)


def test_microbatches_are_raised_to_keep_under_the_token_bound():
    # 128 rows of 80 tokens: 64 rows hold 5,120 tokens, 32 rows 2,560.
    assert resolve_microbatches(128, 80, data=1, at_least=1, max_tokens=4096) == 4
    assert resolve_microbatches(128, 80, data=1, at_least=1, max_tokens=5120) == 2
    assert resolve_microbatches(128, 80, data=1, at_least=8, max_tokens=4096) == 8  # never fewer than asked
    assert resolve_microbatches(128, 80, data=1, at_least=1, max_tokens=0) == 1  # 0: no bound
    assert resolve_microbatches(128, 80, data=4, at_least=1, max_tokens=4096) == 1  # 32 rows per device
    assert resolve_microbatches(128, 80, data=4, at_least=1, max_tokens=1280) == 2  # 16 rows per device
    assert resolve_microbatches(12, 80, data=1, at_least=1, max_tokens=250) == 4  # 3 rows, 240 tokens
    # One row per device is over the bound: the finest split that still covers every device.
    assert resolve_microbatches(8, 10_000, data=2, at_least=1, max_tokens=4096) == 4


def test_build_resolves_the_updates_microbatches():
    c = base_config("gspo", "tiny")
    assert c.train.microbatch_tokens == 4096 and build(c).plan.update_microbatches == 1  # 4 rows of 32 tokens
    c.rollout.update(num_groups=16, group_size=8)
    c.train.minibatches = 1
    c.max_new_tokens = 64  # 128 rows of 24 + 64 = 88 tokens: 32 rows (2,816 tokens) per micro-batch
    assert build(c).plan.update_microbatches == 4
    c.train.microbatch_tokens = 0
    assert build(c).plan.update_microbatches == 1
    c.mesh.data = 4  # on 4 devices a micro-batch of 32 rows is 8 rows, 704 tokens, per device
    c.train.microbatch_tokens = 1000
    assert build(c, device_count=4).plan.update_microbatches == 4
    assert base_config("gspo", "qwen3_30b_a3b").train.microbatch_tokens == 0  # its AOT rows: one micro-batch


def test_sampler_threads_are_resolved_from_the_mesh_and_refused_beside_a_bigger_one():
    c = base_config("gspo", "tiny")  # 8 completions, sampler_threads 0: two on one device
    assert c.rollout.sampler_threads == 0 and build(c).rollout.threads(devices=1) == 2
    assert build(c).rollout.threads(devices=4) == 1
    c.rollout.update(num_groups=3, group_size=3)  # an odd batch: not split
    c.train.minibatches = 1
    assert build(c).rollout.threads(devices=1) == 1
    c = base_config("gspo", "tiny")
    c.rollout.sampler_threads = 4
    assert build(c).rollout.threads(devices=1) == 4
    c.mesh.fsdp = 2
    with pytest.raises(ConfigError, match=r"rollout.sampler_threads=4 .*1 on a mesh of 2 devices"):
        build(c)
    c.rollout.sampler_threads = 0
    build(c)


# ------------------------------------------------------------------ the CLI: one line, workdir untouched


@pytest.mark.parametrize(
    "args, words",
    [
        (["--config", "configs/gspo.py:tiny", "--config.algorithm=grpo"], "algorithm"),
        (["--config", "configs/no_such.py"], "config file not found"),
        (["--config", "configs/gspo.py:huge"], "size"),
        (["--config", "configs/gspo.py:tiny", "--config.mesh.data=16"], "mesh"),
        (["--config", "configs/gspo.py:tiny", "--config.mesh.tensor=0"], "mesh.tensor"),
        (["--config", "configs/gspo.py:tiny", "--config.prompt_len=8"], "prompt_len"),
        (["--config", "configs/gspo.py:tiny", "--config.tokenizer_path=/no/such/dir"], "tokenizer_path"),
        (["--config", "configs/gspo.py:tiny", "--config.rollout.temperature=0.0"], "temperature"),
    ],
)
def test_cli_refuses_bad_input_in_one_line_and_leaves_the_workdir_untouched(tmp_path, args, words):
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("precious")
    before = snapshot(work)
    r = train_cli(*args, "--workdir", str(work))
    assert r.returncode == EXIT_REFUSED, r.stderr
    assert words in one_line(r)
    assert snapshot(work) == before


def test_the_command_itself_refuses_in_one_line_with_exit_2_and_leaves_the_workdir_untouched(tmp_path):
    """The refusals above and below run `scripts/train.py` in this process; this one runs the command."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("precious")
    before = snapshot(work)
    r = cli("--config", "configs/gspo.py:tiny", "--config.rollout.temperature=0.0", "--workdir", str(work))
    assert r.returncode == EXIT_REFUSED, r.stderr
    assert "temperature" in one_line(r) and one_line(r).startswith("error: ")
    assert snapshot(work) == before


GSM8K = ["--config.task.name=gsm8k", "--config.prompt_len=160"]
QA = [{"question": "What is two plus two?", "answer": "#### 4"}, {"question": "Half of 9?", "answer": "#### 4.5"}]


@pytest.mark.parametrize(
    "args, words",
    [
        (["--config.task.arithmetic.foo=1"], "task.arithmetic.foo; task 'arithmetic' has the fields: format_reward, "),
        (["--config.task.digits=2"], "no such config key: task.digits; config.task has: arithmetic, countdown, gsm8k"),
        (["--config.task.name=countdown"], "prompt_len=24 is not allowed; the prompt bucket must hold the longest"),
        ([*GSM8K, "--config.task.gsm8k.path=/no/qa.jsonl"], "config.task.gsm8k: DatasetTask.path='/no/qa.jsonl'"),
        ([*GSM8K, "--config.task.gsm8k.path={qa}"], "split 'eval' of 'gsm8k' is empty: none of its 2 records"),
        ([*GSM8K, "--config.task.gsm8k.eval_path=/no/x.json"], "config.task.gsm8k: DatasetTask.eval_path='/no/x.json'"),
    ],
)
def test_cli_refuses_a_task_that_cannot_run_and_writes_nothing(tmp_path, args, words):
    qa = tmp_path / "qa.jsonl"  # two records, neither held out at 1/16: an empty eval split
    qa.write_text("".join(json.dumps(r) + "\n" for r in QA))
    work = tmp_path / "work"
    r = train_cli("--config", "configs/gspo.py:tiny", *[a.format(qa=qa) for a in args], "--workdir", str(work))
    assert r.returncode == EXIT_REFUSED, r.stderr
    assert words in one_line(r)
    assert not work.exists()


@pytest.mark.parametrize(
    "args",
    [
        ["--config.task.name=countdown", "--config.prompt_len=40", "--config.task.countdown.count=4"],
        GSM8K,  # the shipped fixture
        [*GSM8K, "--config.task.gsm8k.path={qa}", "--config.task.gsm8k.eval_path={qa}"],
    ],
)
def test_cli_selects_a_task_by_name_with_its_section(tmp_path, args):
    """The config passes build (a held workdir is refused only after it), so the task's keys arrive."""
    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps(r) + "\n" for r in QA))
    work = tmp_path / "work"
    work.mkdir()
    with workdir.Lock(work):
        r = train_cli("--config", "configs/gspo.py:tiny", *[a.format(qa=qa) for a in args], "--workdir", str(work))
    assert r.returncode == EXIT_REFUSED and f"in use by pid {os.getpid()}" in one_line(r)


def test_a_run_on_a_mesh_smaller_than_the_devices_warns_naming_the_idle_ones(tmp_path, monkeypatch, caplog):
    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(programs_lib, "init_policy", stop)  # the run stops right after building its mesh
    with pytest.raises(Stop):
        run_lib.train_and_evaluate(build(base_config("gspo", "tiny")), tmp_path, progress=False)  # a mesh of 1 of 8
    [warning] = [r.getMessage() for r in caplog.records if r.name == "gspo_jax.sharding"]
    assert "uses 1 of this process's 8 devices; idle: cpu:1, cpu:2, cpu:3, cpu:4, cpu:5, cpu:6, cpu:7" in warning


def test_cli_refuses_a_workdir_that_cannot_be_created(tmp_path):
    (tmp_path / "a_file").write_text("x")
    r = train_cli("--config", "configs/gspo.py:tiny", "--workdir", str(tmp_path / "a_file" / "run"))
    assert r.returncode == EXIT_REFUSED and "cannot be created" in one_line(r)


# ------------------------------------------------------------------ one run per workdir


def test_a_second_run_on_a_held_workdir_is_refused_naming_the_holder(tmp_path):
    with workdir.Lock(tmp_path):
        before = snapshot(tmp_path)
        r = train_cli("--config", "configs/gspo.py:tiny", "--workdir", str(tmp_path))
        assert r.returncode == EXIT_REFUSED
        assert f"in use by pid {os.getpid()}" in one_line(r)
        assert snapshot(tmp_path) == before
    with pytest.raises(workdir.WorkdirBusy, match=f"pid {os.getpid()}"), workdir.Lock(tmp_path), workdir.Lock(tmp_path):
        pass


def test_a_lock_left_by_a_dead_process_is_taken_over(tmp_path, caplog):
    holder = subprocess.Popen(
        [sys.executable, "-c", f"from gspo_jax.workdir import Lock; Lock({str(tmp_path)!r}).acquire(); input()"],
        stdin=subprocess.PIPE,
    )
    deadline = time.time() + 60
    while not (tmp_path / workdir.LOCK_FILE).exists() or not (tmp_path / workdir.LOCK_FILE).read_text():
        assert time.time() < deadline
        time.sleep(0.1)
    with pytest.raises(workdir.WorkdirBusy, match=f"pid {holder.pid}"):
        workdir.Lock(tmp_path).acquire()
    holder.kill()  # kill -9: no cleanup runs
    holder.wait()
    with workdir.Lock(tmp_path):
        assert json.loads((tmp_path / workdir.LOCK_FILE).read_text())["pid"] == os.getpid()
    assert any(f"pid {holder.pid}" in r.getMessage() for r in caplog.records)


def test_a_waiting_lock_takes_its_turn_after_a_clean_release(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from gspo_jax.workdir import Lock; l = Lock({str(tmp_path)!r}, 'w.lock').acquire(); input(); l.release()",
        ],
        stdin=subprocess.PIPE,
    )
    deadline = time.time() + 60
    while not (tmp_path / "w.lock").exists() or not (tmp_path / "w.lock").read_text():
        assert time.time() < deadline
        time.sleep(0.1)
    start = time.monotonic()
    threading.Timer(1.0, lambda: holder.communicate(b"\n")).start()
    with workdir.Lock(tmp_path, "w.lock", wait=True):  # blocks until the holder lets go, 1 s from now
        assert time.monotonic() - start >= 0.9
        assert json.loads((tmp_path / "w.lock").read_text())["pid"] == os.getpid()
    messages = [r.getMessage() for r in caplog.records]
    assert any(f"held by pid {holder.pid}" in m for m in messages)
    assert not any("took over" in m for m in messages)  # released cleanly: nothing to take over
    assert (tmp_path / "w.lock").read_text() == ""


def test_a_filesystem_without_locks_runs_unguarded_and_says_so(tmp_path, monkeypatch, caplog):
    def no_locks(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(workdir.fcntl, "flock", no_locks)  # as on gcsfuse, where pod workdirs often live
    with workdir.Lock(tmp_path):
        assert json.loads((tmp_path / workdir.LOCK_FILE).read_text())["pid"] == os.getpid()
    assert any("no file locks" in r.getMessage() for r in caplog.records)

    def broken(fd, op):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(workdir.fcntl, "flock", broken)  # any other failure still stops the run
    with pytest.raises(OSError, match="Input/output"):
        workdir.Lock(tmp_path).acquire()


# ------------------------------------------------------------------ the workdir remembers its config


def test_a_changed_config_is_refused_listing_the_keys_unless_allowed(tmp_path):
    grpo = base_config("grpo", "tiny")
    workdir.record_config(tmp_path, as_json(grpo), [])
    before = snapshot(tmp_path)

    gspo = base_config("gspo", "tiny")
    gspo.model.embed_dim = 32
    with pytest.raises(ConfigError) as e:
        workdir.check_config(tmp_path, as_json(gspo), allow_change=False)
    message = str(e.value)
    assert "\n" not in message
    for key in ("algorithm: 'grpo' -> 'gspo'", "loss.ratio: 'token' -> 'sequence'", "model.embed_dim: 64 -> 32"):
        assert key in message
    assert snapshot(tmp_path) == before

    longer = base_config("grpo", "tiny")
    longer.train.num_iterations, longer.train.eval_every = 10, 5  # resumable keys
    assert workdir.check_config(tmp_path, as_json(longer), allow_change=False) == []

    changes = workdir.check_config(tmp_path, as_json(gspo), allow_change=True)
    workdir.record_config(tmp_path, as_json(gspo), changes)
    kept = [p for p in tmp_path.glob("config.*.json")]
    assert len(kept) == 1 and json.loads(kept[0].read_text())["algorithm"] == "grpo"
    assert json.loads((tmp_path / "config.json").read_text())["algorithm"] == "gspo"


def test_cli_refuses_a_changed_algorithm_on_an_existing_workdir(tmp_path):
    workdir.record_config(tmp_path, as_json(base_config("grpo", "tiny")), [])
    before = snapshot(tmp_path)
    r = train_cli("--config", "configs/gspo.py:tiny", "--workdir", str(tmp_path))
    assert r.returncode == EXIT_REFUSED
    assert "algorithm: 'grpo' -> 'gspo'" in one_line(r) and "--allow_config_change" in one_line(r)
    assert snapshot(tmp_path) == before


def test_checkpoints_that_do_not_restore_stop_the_run_instead_of_training_without_saving(tmp_path):
    with Checkpointer(tmp_path / "checkpoints") as ckpt:
        ckpt.save(3, {"w": jnp.zeros(3)}, {"iteration": 2, "prompts": {}}, force=True)
    c = base_config("gspo", "tiny")
    with pytest.raises(checkpoint.CheckpointMismatch, match="use a new workdir"):
        run_lib.train_and_evaluate(build(c), tmp_path, progress=False)
    assert not (tmp_path / "metrics.jsonl").exists()


# ------------------------------------------------------------------ non-finite updates


def test_an_update_that_would_make_parameters_non_finite_is_skipped():
    """Loss and gradient are finite, but lr × weight decay overflows float32: the update is rejected."""
    c = base_config("gspo", "tiny")
    c.train.update(learning_rate=3e38, weight_decay=1.0, max_grad_norm=0.0, warmup_steps=0)
    built = build(c)
    mesh = sharding.mesh_from_config(**c.mesh)
    graphdef, params = programs_lib.init_policy(built, mesh)
    programs = programs_lib.compile_programs(built, graphdef, params, mesh)
    B, T = 4, c.prompt_len + c.max_new_tokens
    tokens = jnp.ones((B, T), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    mask = jnp.zeros((B, T), bool).at[:, -4:].set(True)
    logp, topk = programs.score(params, tokens, positions)
    batch = train.TrainBatch(
        tokens=tokens,
        positions=positions,
        completion_mask=mask,
        loss_mask=mask.astype(jnp.float32),
        old_logp=logp,
        sampler_logp=logp,
        ref_logp=logp,
        advantages=jnp.array([1.0, -1.0, 0.5, -0.5]),
        topk=topk,
    )
    state = programs_lib.init_train_state(programs, params, 0)
    for _ in range(3):  # the schedule's first step has lr 0; a later one overflows
        before = jax.tree.map(np.asarray, state)
        state, m, _ = programs.train_step(state, jax.device_put(batch, programs.batch_shardings))
        assert np.isfinite(float(m["total_loss"].compute())) and np.isfinite(float(m["grad_norm"].compute()))
        if float(m["skipped"].compute()):
            chex.assert_trees_all_equal(jax.tree.map(np.asarray, state), before)
            break
    else:
        pytest.fail("no update was skipped")
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state))


# ------------------------------------------------------------------ interruptions


def _signal_after(monkeypatch, iteration, *signums):
    original = iteration_lib.rl_iteration

    def iteration_then_signal(ctx, state, it):
        out = original(ctx, state, it)
        if it == iteration:
            for signum in signums:
                os.kill(os.getpid(), signum)
        return out

    monkeypatch.setattr(iteration_lib, "rl_iteration", iteration_then_signal)


@pytest.mark.slow
def test_sigint_stops_like_sigterm_and_a_second_one_stops_at_once(tmp_path, monkeypatch):
    c = base_config("dapo", "tiny")
    c.train.num_iterations = 4
    with monkeypatch.context() as m, pytest.raises(run_lib.StoppedEarly, match="SIGINT after iteration 0"):
        _signal_after(m, 0, signal.SIGINT)
        run_lib.train_and_evaluate(build(c), tmp_path, progress=False)
    assert Checkpointer(tmp_path / "checkpoints").all_steps() == [1]
    assert rows(tmp_path) == [0, 1]

    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        _signal_after(m, 2, signal.SIGINT, signal.SIGINT)  # after iteration 2 wrote its row, before its save
        run_lib.train_and_evaluate(build(c), tmp_path, progress=False)
    assert Checkpointer(tmp_path / "checkpoints").all_steps() == [1, 2]
    assert rows(tmp_path) == [0, 1, 2]

    run_lib.train_and_evaluate(build(c), tmp_path, progress=False)  # resumes from step 2 and finishes
    assert rows(tmp_path) == [0, 1, 2, 3, 4]


@pytest.mark.slow
def test_after_a_crash_metrics_hold_one_row_per_step(tmp_path, monkeypatch):
    c = base_config("gspo", "tiny")
    c.train.update(num_iterations=4, checkpoint_every=2)
    original = iteration_lib.rl_iteration

    def crash_in_iteration_3(ctx, state, it):
        if it == 3:
            raise RuntimeError("the machine died")
        return original(ctx, state, it)

    with monkeypatch.context() as m, pytest.raises(RuntimeError, match="died"):
        m.setattr(iteration_lib, "rl_iteration", crash_in_iteration_3)
        run_lib.train_and_evaluate(build(c), tmp_path, progress=False)
    assert rows(tmp_path) == [0, 1, 2, 3]  # step 3 is past the last checkpoint (2)
    assert Checkpointer(tmp_path / "checkpoints").all_steps() == [2]
    run_lib.train_and_evaluate(build(c), tmp_path, progress=False)
    assert rows(tmp_path) == [0, 1, 2, 3, 4]


@pytest.mark.slow
def test_cli_exit_codes_stopped_then_finished(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    # 5 iterations: the SIGTERM, sent once steps 0 and 1 are logged, lands well before the last one (a stop
    # during the last iteration finishes the run).
    config = ("--config", "configs/gspo.py:tiny", "--config.train.num_iterations=5", "--workdir", str(tmp_path))
    args = [sys.executable, "scripts/train.py", *config]
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while not ((tmp_path / "metrics.jsonl").exists() and len(rows(tmp_path)) >= 2):
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_STOPPED, err
    assert "rerun to resume" in err
    assert not list(tmp_path.glob("plots/*.png"))  # only a finished run plots

    r = cli(*config)
    assert r.returncode == 0, r.stderr
    assert rows(tmp_path) == list(range(6))
    assert list(tmp_path.glob("plots/*.png")) or list(tmp_path.glob("*.png"))


@pytest.mark.slow
def test_a_run_whose_updates_overflow_warns_once_per_iteration_and_saves_only_finite_state(tmp_path, caplog):
    c = base_config("gspo", "tiny")
    c.train.update(learning_rate=3e38, weight_decay=1.0, warmup_steps=0, num_iterations=2)
    with caplog.at_level("WARNING", logger="gspo_jax.train"):
        metrics = run_lib.train_and_evaluate(build(c), tmp_path, progress=False)
    warnings = [r.getMessage() for r in caplog.records if "updates skipped" in r.getMessage()]
    assert len(warnings) == 2 and metrics["skipped"] >= 1  # iterations 0 and 1 each skipped some
    s = build(c)
    mesh = sharding.mesh_from_config(**c.mesh)
    graphdef, params = programs_lib.init_policy(s, mesh)
    programs = programs_lib.compile_programs(s, graphdef, params, mesh)
    with Checkpointer(tmp_path / "checkpoints") as ckpt:
        _, state, _ = ckpt.restore_latest(programs_lib.abstract_train_state(programs, params))
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state))

"""Checkpointer: exact round trips (nnx.State + optax + key data + meta), sharded restore,
retention, save cadence, fallback past corrupt steps, and the preemption guard."""

import glob
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gspo_jax.checkpoint import CORRUPT_SUBDIR, Checkpointer, PreemptionGuard, threads_start_at_exit


def make_state(seed: int = 0):
    """A train-state-shaped pytree: step, nnx params, adamw state, raw key data."""
    model = nnx.Linear(8, 4, rngs=nnx.Rngs(seed))
    params = nnx.state(model, nnx.Param)
    tx = optax.adamw(1e-2)
    opt_state = tx.init(params)
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5 + seed), params)
    _, opt_state = tx.update(grads, opt_state, params)  # non-trivial mu / nu / count
    return {
        "step": jnp.int32(seed),
        "params": params,
        "opt_state": opt_state,
        "rng": jax.random.key_data(jax.random.key(1234 + seed)),
    }


def abstract(tree, sharding_fn=None):
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_fn(x) if sharding_fn else None), tree
    )


def assert_bitwise_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


META = {"prompt_iter": {"epoch": 2, "index": 17, "seed": 3}, "config": {"lr": 1e-6, "algo": "gspo"}}


def test_round_trip_is_exact(tmp_path):
    state = make_state(3)
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.save(7, state, META)
        ckpt.wait()
        step, restored, meta = ckpt.restore_latest(abstract(state))
    assert step == 7 and meta == META
    assert isinstance(restored["params"], nnx.State)
    assert_bitwise_equal(restored, state)
    # Restored params drop straight back into a model.
    model = nnx.Linear(8, 4, rngs=nnx.Rngs(99))
    nnx.update(model, restored["params"])
    np.testing.assert_array_equal(model.kernel[...], state["params"]["kernel"][...])
    key = jax.random.wrap_key_data(restored["rng"])
    assert jax.random.bits(key) == jax.random.bits(jax.random.key(1237))


def test_typed_key_is_refused(tmp_path):
    with Checkpointer(tmp_path) as ckpt, pytest.raises(TypeError, match="key_data"):
        ckpt.save(1, {"rng": jax.random.key(0)}, {})


def test_restore_with_named_shardings(tmp_path):
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "tensor"))

    def sharding(x):  # kernels over both axes, biases over "tensor", key data over "data"
        if x.ndim == 2:
            return NamedSharding(mesh, P("data", "tensor"))
        if x.ndim == 1:
            return NamedSharding(mesh, P("tensor" if x.shape[0] % 4 == 0 else "data"))
        return NamedSharding(mesh, P())

    state = make_state(1)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state, META)  # saved from one device, restored onto the 2x4 mesh
        ckpt.wait()
        _, restored, _ = ckpt.restore_latest(abstract(state, sharding))
        ckpt.save(2, restored, META)  # and a sharded save restores sharded again
        ckpt.wait()
        step, again, _ = ckpt.restore_latest(abstract(state, sharding))
    assert step == 2
    for tree in (restored, again):
        assert_bitwise_equal(tree, state)
        for leaf, ref in zip(jax.tree.leaves(tree), jax.tree.leaves(state)):
            assert leaf.sharding == sharding(ref)
    assert restored["params"]["kernel"][...].addressable_shards[0].data.shape == (4, 1)


def test_max_to_keep(tmp_path):
    state = make_state()
    with Checkpointer(tmp_path, max_to_keep=2) as ckpt:
        for step in range(1, 5):
            ckpt.save(step, state, {"s": step})
        ckpt.wait()
        assert ckpt.all_steps() == [3, 4]
    assert sorted(os.listdir(tmp_path)) == ["3", "4", "checksums"]
    assert sorted(os.listdir(tmp_path / "checksums")) == ["3.json", "4.json"]  # records of deleted steps go too


def test_save_every_and_force(tmp_path):
    state = make_state()
    with Checkpointer(tmp_path, save_every=3) as ckpt:
        saved = [ckpt.save(step, state, {}) for step in range(1, 7)]
        assert saved == [False, False, True, False, False, True]
        assert ckpt.save(7, state, {}, force=True)  # forced: waits, so it is on disk now
        assert (tmp_path / "7" / "commit_success.txt").exists()
        assert not ckpt.save(7, state, {}, force=True)  # existing step: no-op
        assert ckpt.all_steps() == [3, 6, 7]
        assert ckpt.latest_step() == 7


def test_empty_directory_restores_none(tmp_path):
    with Checkpointer(tmp_path / "new") as ckpt:
        assert ckpt.restore_latest(abstract(make_state())) is None
        assert ckpt.latest_step() is None and ckpt.all_steps() == []


def _delete_a_file(step_dir):
    os.remove(sorted(glob.glob(f"{step_dir}/state/**/d/*", recursive=True))[0])


def _garbage_arrays(step_dir):
    for f in glob.glob(f"{step_dir}/state/**/d/*", recursive=True):
        with open(f, "r+b") as fh:  # same length, so only checksums can tell
            fh.write(os.urandom(os.path.getsize(f)))


def _truncate_all(step_dir):
    for f in glob.glob(f"{step_dir}/**", recursive=True):
        if os.path.isfile(f):
            open(f, "wb").close()


def _garbage_4kb_in_place(step_dir):
    """4 kB of garbage over the middle of the largest data file, its size unchanged."""
    f = max(glob.glob(f"{step_dir}/state/**/d/*", recursive=True), key=os.path.getsize)
    size = os.path.getsize(f)
    with open(f, "r+b") as fh:
        fh.seek(max(0, size // 2 - 2048))
        fh.write(os.urandom(min(4096, size)))
    assert os.path.getsize(f) == size


CORRUPTIONS = {
    "deleted_file": _delete_a_file,
    "garbage_arrays": _garbage_arrays,
    "garbage_4kb_in_place": _garbage_4kb_in_place,
    "no_state_item": lambda d: shutil.rmtree(f"{d}/state"),
    "no_commit_marker": lambda d: os.remove(f"{d}/commit_success.txt"),
    "garbage_meta": lambda d: Path(f"{d}/meta/metadata").write_text("{not json"),
    "truncated_files": _truncate_all,
}


# A failed tensorstore read can leave a callback for orbax's closed event loop; harmless noise.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("corrupt", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
def test_corrupt_latest_falls_back(tmp_path, caplog, corrupt):
    states = {s: make_state(s) for s in (1, 2, 3)}
    with Checkpointer(tmp_path, max_to_keep=3) as ckpt:
        for s, state in states.items():
            ckpt.save(s, state, {"s": s})
    corrupt(tmp_path / "3")
    snapshot = sorted(str(p.relative_to(tmp_path / "3")) for p in (tmp_path / "3").rglob("*"))

    with caplog.at_level(logging.WARNING, logger="gspo_jax.checkpoint"):
        ckpt = Checkpointer(tmp_path, max_to_keep=3)
        step, restored, meta = ckpt.restore_latest(abstract(states[1]))
    assert (step, meta) == (2, {"s": 2})
    assert_bitwise_equal(restored, states[2])
    assert any("step 3" in r.getMessage() for r in caplog.records)

    # Nothing is deleted: step 3 is moved aside intact ...
    (moved,) = (tmp_path / CORRUPT_SUBDIR).iterdir()
    assert moved.name.startswith("3.")
    assert sorted(str(p.relative_to(moved)) for p in moved.rglob("*")) == snapshot
    # ... so the resumed run can save step 3 again, and later steps.
    assert ckpt.save(3, states[3], {"s": 3}) and ckpt.save(4, states[3], {"s": 4})
    ckpt.close()
    step, restored, meta = Checkpointer(tmp_path).restore_latest(abstract(states[1]))
    assert (step, meta) == (4, {"s": 4})


def test_all_steps_corrupt_returns_none_and_moves_nothing(tmp_path, caplog):
    state = make_state()
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state, {})
        ckpt.save(2, state, {})
    for s in ("1", "2"):
        shutil.rmtree(tmp_path / s / "state")
    with caplog.at_level(logging.WARNING, logger="gspo_jax.checkpoint"):
        assert Checkpointer(tmp_path).restore_latest(abstract(state)) is None
    assert sorted(os.listdir(tmp_path)) == ["1", "2", "checksums"]
    assert any(r.levelno == logging.ERROR for r in caplog.records)


def test_threads_at_exit_rule_matches_this_python():
    """The rule `Checkpointer` uses to choose asynchronous saves is what this interpreter does."""
    script = textwrap.dedent("""
        import threading
        def hook():
            try:
                t = threading.Thread(target=print, args=("started",))
                t.start()
                t.join()
            except RuntimeError:
                print("refused")
        threading._register_atexit(hook)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60).stdout
    assert out.strip() == ("started" if threads_start_at_exit() else "refused")
    assert threads_start_at_exit((3, 11, 7)) and threads_start_at_exit((3, 13, 0))
    assert not threads_start_at_exit((3, 12, 1)) and threads_start_at_exit((3, 12, 3))


def test_async_save_then_exit_leaves_complete_checkpoint(tmp_path):
    # The process exits right after an async save, without wait() or close().
    script = textwrap.dedent(f"""
        import jax.numpy as jnp
        from gspo_jax.checkpoint import Checkpointer
        ckpt = Checkpointer({str(tmp_path)!r})
        ckpt.save(5, {{"w": jnp.full((1024, 1024), 2.5)}}, {{"done": True}})
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=120)
    tree = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
    step, restored, meta = Checkpointer(tmp_path).restore_latest(tree)
    assert (step, meta) == (5, {"done": True})
    assert float(restored["w"].min()) == float(restored["w"].max()) == 2.5


def test_meta_must_be_json(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(TypeError):
            ckpt.save(1, make_state(), {"bad": object()})
        assert ckpt.all_steps() == []


def test_preemption_guard_sets_flag_and_restores_handler():
    previous = signal.getsignal(signal.SIGTERM)
    sentinel = lambda signum, frame: None  # noqa: E731
    signal.signal(signal.SIGTERM, sentinel)
    try:
        with PreemptionGuard() as guard:
            assert not guard.requested
            os.kill(os.getpid(), signal.SIGTERM)
            assert guard.requested and guard.signum == signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) is sentinel
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_preemption_guard_sigint():
    previous = signal.getsignal(signal.SIGINT)
    with PreemptionGuard(sigint=True) as guard:
        os.kill(os.getpid(), signal.SIGINT)
        assert guard.requested and guard.signum == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C really interrupts
    assert signal.getsignal(signal.SIGINT) is previous

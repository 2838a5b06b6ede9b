"""The trainer: sharded step = single-device step, micro-batching, non-finite skip, the tiny end-to-end
run (compile once, checkpoints, bitwise resume) and the CLI's error handling."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax.config import base_config, build
from gspo_jax.tasks import prompt_iterator
from gspo_jax.train import Trainer

ROOT = Path(__file__).resolve().parents[1]


def tiny(algorithm="gspo", **mesh):
    c = base_config(algorithm, "tiny")
    c.mesh.update(**mesh)
    return c


def minibatch(tr: Trainer, seed=0):
    """A random but well-formed minibatch in the trainer's layout."""
    rng = np.random.default_rng(seed)
    B, L = tr.mb_size, tr.config.prompt_len + tr.config.max_new_tokens
    P = tr.config.prompt_len
    tokens = rng.integers(4, 100, (B, L)).astype(np.int32)
    pmask = np.zeros((B, L), bool)
    cmask = np.zeros((B, L), bool)
    for i in range(B):
        pmask[i, P - rng.integers(3, P) : P] = True
        cmask[i, P : P + rng.integers(1, L - P + 1)] = True
    positions = jnp.where(jnp.asarray(pmask | cmask), jnp.cumsum(pmask | cmask, 1) - 1, -1).astype(jnp.int32)
    logp, topk = tr.score(tr.params0, *jax.device_put((jnp.asarray(tokens), positions), tr.bs(2)))
    old = np.asarray(logp) + rng.normal(0, 0.02, (B, L)).astype(np.float32) * cmask
    return dict(
        tokens=tokens,
        positions=np.asarray(positions),
        loss_mask=cmask.astype(np.float32),
        old_logp=old.astype(np.float32),
        ref_logp=np.asarray(logp) - 0.01,
        advantages=rng.normal(0, 1, B).astype(np.float32),
        topk=np.asarray(topk),
    )


def step(tr: Trainer, batch):
    state = tr.init_state(tr.params0)
    return tr.train_step(state, jax.device_put({k: jnp.asarray(v) for k, v in batch.items()}, tr.batch_sh))


@pytest.mark.parametrize("algorithm", ["grpo", "gspo"])
def test_sharded_train_step_equals_single_device(algorithm):
    single = Trainer(tiny(algorithm), "/tmp/unused_single")
    sharded = Trainer(tiny(algorithm, data=2, expert=2, tensor=2), "/tmp/unused_sharded")
    assert sharded.mesh.devices.size == 8
    batch = minibatch(single)
    s1, m1 = step(single, batch)
    s2, m2 = step(sharded, batch)
    for k in ("loss", "total_loss", "grad_norm", "clip_frac"):
        np.testing.assert_allclose(m1[k], m2[k], rtol=1e-5, atol=1e-7, err_msg=k)
    for a, b in zip(jax.tree.leaves(s1["params"]), jax.tree.leaves(s2["params"])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    leaf = jax.tree.leaves(s2["params"])[0]
    assert len(leaf.sharding.device_set) > 1  # really sharded


@pytest.mark.parametrize("algorithm", ["dapo", "grpo"])
def test_microbatches_give_the_same_update(algorithm):
    """The global (minibatch) denominator makes micro-batch sums exact. The MoE aux losses are batch
    statistics, not additive over micro-batches, so they are switched off for the identity."""
    c = tiny(algorithm)
    c.model.update(lb_loss_coef=0.0, z_loss_coef=0.0)
    one = Trainer(c, "/tmp/unused1")
    c2 = tiny(algorithm)
    c2.model.update(lb_loss_coef=0.0, z_loss_coef=0.0)
    c2.train.microbatches = 2
    two = Trainer(c2, "/tmp/unused2")
    batch = minibatch(one, seed=1)
    s1, m1 = step(one, batch)
    s2, m2 = step(two, batch)
    for k in ("total_loss", "loss", "policy_loss", "kl_loss", "grad_norm"):
        np.testing.assert_allclose(m1[k], m2[k], rtol=1e-5, atol=1e-8, err_msg=k)
    for a, b in zip(jax.tree.leaves(s1["params"]), jax.tree.leaves(s2["params"])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_non_finite_loss_skips_the_update():
    tr = Trainer(tiny("grpo"), "/tmp/unused3")
    batch = minibatch(tr, seed=2)
    batch["advantages"][0] = np.nan
    state = tr.init_state(tr.params0)
    before = jax.tree.map(np.asarray, state)
    new, m = tr.train_step(state, jax.device_put({k: jnp.asarray(v) for k, v in batch.items()}, tr.batch_sh))
    assert float(m["skipped"]) == 1.0 and int(new["step"]) == 0
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(new)):
        np.testing.assert_array_equal(a, b)


def _final_params(tr):
    return [np.asarray(x) for x in jax.tree.leaves(tr.state["params"])]


@pytest.mark.slow
def test_tiny_end_to_end_compiles_once_checkpoints_and_resumes_bitwise(tmp_path, compile_counter):
    c = tiny("grpo")  # KL to the reference: exercises the ref model path too
    full = Trainer(c, tmp_path / "full")
    full.run(progress=False)

    part = Trainer(c, tmp_path / "resumed")
    part.run(max_iterations=1, progress=False)  # "interrupted" after iteration 1
    compile_counter.reset()
    part.run(progress=False)  # same process, same compiled functions: resumes, compiles nothing
    assert compile_counter.count == 0
    fresh = Trainer(c, tmp_path / "resumed")  # and a fresh trainer on the workdir resumes too
    assert fresh.run(progress=False) == {}  # nothing left to do

    for a, b in zip(_final_params(full), _final_params(part)):
        np.testing.assert_array_equal(a, b)  # bitwise

    lines = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    last = {r["step"]: r for r in lines}
    assert sorted(last) == [0, 1, 2, 3]
    for r in lines[1:]:
        for k in ("loss", "reward_mean", "clip_frac", "approx_kl", "kl_ref", "drift_slot_change_rate"):
            assert np.isfinite(r[k]), (k, r[k])
    assert lines[1]["xla_compiles"] > 0  # the first iteration compiles ...
    assert [r["xla_compiles"] for r in lines[2:]] == [0.0, 0.0]  # ... and nothing compiles after it
    resumed = {r["step"]: r for r in map(json.loads, (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines())}
    for s in (1, 2, 3):
        assert resumed[s]["loss"] == last[s]["loss"] and resumed[s]["reward_mean"] == last[s]["reward_mean"]
    assert any((tmp_path / "full" / "checkpoints").iterdir())
    assert list((tmp_path / "full").glob("*.png")) or list((tmp_path / "full").glob("plots/*.png"))


def run_cli(*args, cwd=ROOT):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    return subprocess.run(
        [sys.executable, "scripts/train.py", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    "override, key",
    [
        ("--config.loss.eps_low=-1", "eps_low"),
        ("--config.train.routing_replay=R4", "routing_replay"),
        ("--config.train.no_such_key=1", "no_such_key"),
        ("--config.rollout.group_size=x", "group_size"),
        ("--config.model.top_k=99", "top_k"),
    ],
)
def test_cli_rejects_bad_overrides_in_one_line_without_touching_the_workdir(tmp_path, override, key):
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("precious")
    r = run_cli("--config", "configs/gspo.py:tiny", "--workdir", str(work), override)
    assert r.returncode == 2, r.stderr
    err = [x for x in r.stderr.strip().splitlines() if x.strip()]
    assert len(err) == 1 and key in err[0], r.stderr
    assert [p.name for p in work.iterdir()] == ["keep.txt"] and (work / "keep.txt").read_text() == "precious"


@pytest.mark.parametrize("name", ["grpo", "dapo", "gspo", "gspo_token", "dr_grpo", "gmpo", "cispo", "sapo"])
@pytest.mark.parametrize("size", ["tiny", "default", "qwen3_30b_a3b"])
def test_every_config_builds(name, size):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "configs" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    built = build(mod.get_config(size))
    assert built.loss.ratio == {"gspo": "sequence", "gspo_token": "sequence_token", "gmpo": "geometric"}.get(
        name, "token"
    )


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_stops_at_the_iteration_boundary(tmp_path, monkeypatch):
    import signal

    from gspo_jax.checkpoint import Checkpointer

    original = Trainer.iteration

    def iteration_then_sigterm(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)  # "preempted" while iteration 1 finishes
        return out

    monkeypatch.setattr(Trainer, "iteration", iteration_then_sigterm)
    c = tiny("dapo")
    c.train.checkpoint_every = 100  # only the preemption save can write step 1
    Trainer(c, tmp_path).run(progress=False)
    assert Checkpointer(tmp_path / "checkpoints").all_steps() == [1]
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1]


def test_training_starts_from_a_hugging_face_checkpoint(tmp_path):
    from gspo_jax import hf

    ckpt = ROOT / "tests" / "fixtures" / "qwen3_moe_tiny"
    c = tiny("gspo")
    c.hf_checkpoint = str(ckpt)
    c.warm_start.steps = 0
    tr = Trainer(c, tmp_path)
    cfg, _, state = hf.load_hf_checkpoint(ckpt)
    assert tr.built.model.num_experts == cfg.num_experts and tr.built.model.embed_dim == cfg.embed_dim
    for a, b in zip(jax.tree.leaves(tr.params0), jax.tree.leaves(state)):
        np.testing.assert_array_equal(a, b)
    state, metrics = tr.iteration(tr.init_state(tr.params0), prompt_iterator(tr.built.task, split="train"), 0)
    assert np.isfinite(metrics["loss"]) and int(state["step"]) == c.train.minibatches
    bad = tiny("gspo")
    bad.hf_checkpoint = str(tmp_path / "missing")
    with pytest.raises(ValueError, match="hf_checkpoint"):
        build(bad)

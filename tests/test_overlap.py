"""Sampling and training at once on disjoint devices (`mesh.rollout_devices`, gspo_jax/overlap.py): the
split is refused at build where it cannot work; the sampler's mesh gets the last devices; with the two
meshes laid out as a one-mesh run's, a split run computes that run's metrics and parameters bitwise
while iteration i + 1's rollout runs on its own thread during iteration i's update, and it resumes
bitwise from a checkpoint taken while a rollout was in flight."""

import json
import threading

import jax
import numpy as np
import pytest
from test_train import _metrics, _sigterm_after, small

from benchmarks.run import overlap as overlap_bench
from gspo_jax import lora, overlap, snapshots
from gspo_jax import rollout as rollout_lib
from gspo_jax import run as run_lib
from gspo_jax import workdir as workdir_lib
from gspo_jax.built import build
from gspo_jax.config import as_json, base_config
from gspo_jax.validation import ConfigError


def _split(c, devices: int = 4):
    c.mesh.update(data=4)
    c.mesh.rollout_devices = devices
    c.rollout.staleness = 1
    return c


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(rollout_devices=8), ("mesh.rollout_devices", "[0, 8)", "the trainer keeps a device")),
        (dict(rollout_devices=-1), ("mesh.rollout_devices", "[0, 8)")),
        (dict(rollout_devices="4"), ("mesh.rollout_devices", "an int")),
        (dict(staleness=0), ("mesh.rollout_devices", "rollout.staleness=0", "never overlap")),
        (dict(rollout_devices=3), ("config.mesh.rollout", "data×fsdp×expert=3 must divide num_groups×group_size")),
        (dict(rollout_expert=8, rollout_devices=2), ("config.mesh.rollout", "there are 2 devices for it")),
    ],
)
def test_a_split_that_cannot_work_is_refused_at_build_in_one_line(change, words):
    c = _split(base_config("gspo", "tiny"))
    with c.ignore_type():
        if "rollout_devices" in change:
            c.mesh.rollout_devices = change["rollout_devices"]
        if "staleness" in change:
            c.rollout.staleness = change["staleness"]
        if "rollout_expert" in change:
            c.mesh.rollout.expert = change["rollout_expert"]
        if "lora" in change:
            c.lora.rank = change["lora"]
    with pytest.raises(ConfigError) as e:
        build(c, device_count=8)
    assert all(w in str(e.value) for w in words) and "\n" not in str(e.value), str(e.value)


def test_the_trainer_takes_the_first_devices_and_the_sampler_the_last_by_their_own_axes():
    c = _split(base_config("gspo", "tiny"))
    c.mesh.update(data=2, fsdp=2)
    c.mesh.rollout.update(data=2, tensor=2)
    built = build(c, device_count=8)
    assert built.mesh.axes() == dict(data=2, fsdp=2, expert=1, tensor=1)
    assert built.rollout_mesh.axes() == dict(data=2, fsdp=1, expert=1, tensor=2)
    trainer, sampler = overlap.meshes(built)
    devices = jax.devices()
    assert list(trainer.devices.flat) == devices[:4] and list(sampler.devices.flat) == devices[4:]
    assert dict(sampler.shape) == dict(data=2, fsdp=1, expert=1, tensor=2)
    c.mesh.rollout_devices = 0  # one mesh: the sampler's axes are not read
    assert build(c, device_count=8).rollout_mesh is None and overlap.meshes(build(c, device_count=8))[1] is None


def _spy_rollouts(monkeypatch, seen: list):
    """Records, per rollout of the train stream, the thread it ran on and the devices of its policy."""
    call = rollout_lib.Rollout.__call__

    def spied(self, params, *args):
        devices = {d.id for x in jax.tree.leaves(params) for d in x.devices()}
        seen.append((threading.current_thread().name, devices))
        return call(self, params, *args)

    monkeypatch.setattr(rollout_lib.Rollout, "__call__", spied)


def _compared(rows: list[dict]) -> list[dict]:
    timed = lambda k: k.endswith("_seconds") or k in ("time", "xla_compiles")
    return [{k: v for k, v in r.items() if not timed(k)} for r in rows]


@pytest.mark.slow
def test_a_split_run_equals_the_one_mesh_run_overlaps_and_resumes_bitwise(tmp_path, monkeypatch):
    """Staleness 1, weight replay (R3W), four iterations. One mesh: data=4 on devices 0-3 (4-7 idle).
    Split: the same trainer mesh, and a sampler mesh data=4 on devices 4-7. Every metric but the times, and the final
    parameters, are equal bitwise; iterations 1-3 drew their batch on the rollout thread with a policy
    on the sampler's devices; the split run's own timing keys are logged; stopped after iteration 1
    (its next batch in flight) and resumed, the split run ends where the uninterrupted one does."""
    c = small("gspo")
    c.warm_start.steps = 0  # the aux losses alone move the policy: tiny rewards are all 0 at first
    c.train.update(learning_rate=1e-2, eval_every=2, num_iterations=4)
    c.train.routing_replay = "R3W"  # the sampler's expert ids and weights cross to the trainer's mesh too
    c.rollout.staleness = 1
    c.mesh.update(data=4)
    run_lib.train_and_evaluate(build(c), tmp_path / "one", progress=False)
    one = _metrics(tmp_path / "one")

    c.mesh.rollout_devices = 4
    seen = []
    with monkeypatch.context() as m:
        _spy_rollouts(m, seen)
        run_lib.train_and_evaluate(build(c), tmp_path / "split", progress=False)
    split = _metrics(tmp_path / "split")
    assert _compared(split) == _compared(one)
    assert split[-1]["drift_jaccard"] < 1.0 and split[-1]["stale_router_flip_rate"] > 0  # the policy moved
    sampler = {d.id for d in jax.devices()[4:]}
    assert [thread.startswith("rollout-ahead") for thread, _ in seen] == [False, True, True, True]
    assert all(devices == sampler for _, devices in seen[1:])  # the lag lives on the sampler's mesh
    for r in split[1:]:
        assert r["sampler_busy_seconds"] > 0 and r["trainer_busy_seconds"] > 0
        assert 0 <= r["overlap_seconds"] <= r["sampler_busy_seconds"] and r["rollout_wait_seconds"] >= 0
    assert split[1]["overlap_seconds"] == 0  # the first batch is drawn in its own iteration
    r = overlap_bench.summary(one, split, devices=8, sampler_devices=4)  # `benchmarks.run --only overlap`'s figures
    assert all(r[run][k] > 0 for run in ("one_mesh", "split") for k in ("iteration_seconds", "trainer_seconds"))
    assert r["split"]["overlap_seconds"] >= 0 and "overlap_seconds" not in r["one_mesh"]
    assert r["split_vs_one_mesh"] == r["split"]["iteration_seconds"] / r["one_mesh"]["iteration_seconds"]

    with monkeypatch.context() as m, pytest.raises(run_lib.StoppedEarly):
        _sigterm_after(m, 1)  # iteration 2's batch is in flight when the checkpoint is taken
        run_lib.train_and_evaluate(build(c), tmp_path / "resumed", progress=False)
    run_lib.train_and_evaluate(build(c), tmp_path / "resumed", progress=False)
    assert _compared(_metrics(tmp_path / "resumed")) == _compared(split)
    final = [jax.tree.leaves(snapshots.load_params(snapshots.open_run(tmp_path / n), 4)) for n in ("one", "resumed")]
    assert all(np.array_equal(a, b) for a, b in zip(*final, strict=True))


@pytest.mark.slow
def test_a_lora_split_run_moves_only_adapters_and_equals_the_one_mesh_run_bitwise(tmp_path, monkeypatch):
    """LoRA (rank 4, a KL term) at staleness 1, three iterations, one mesh data=4 against the same
    trainer mesh with a sampler mesh data=4 on devices 4-7. The sampler's copy of the base is made once:
    every rollout and evaluation draws with it (its buffers never change) and the lagged adapters on the
    sampler's devices; every metric but the times and the final adapters are equal bitwise, and so after
    a stop with the second iteration's batch in flight and a resume."""
    from test_lora_train import lora_config

    c = lora_config()
    c.train.update(minibatches=1, num_iterations=3)
    c.rollout.staleness = 1
    c.mesh.update(data=4)
    run_lib.train_and_evaluate(build(c), tmp_path / "one", progress=False)
    one = _metrics(tmp_path / "one")

    c.mesh.rollout_devices = 4
    bases, sampler = [], {d.id for d in jax.devices()[4:]}
    call = rollout_lib.Rollout.__call__

    def spied(self, params, *args):
        base = lora.split(params)[1]
        bases.append({id(x) for x in jax.tree.leaves(base)})
        assert {d.id for x in jax.tree.leaves(params) for d in x.devices()} == sampler
        return call(self, params, *args)

    with monkeypatch.context() as m:
        m.setattr(rollout_lib.Rollout, "__call__", spied)
        run_lib.train_and_evaluate(build(c), tmp_path / "split", progress=False)
    split = _metrics(tmp_path / "split")
    assert _compared(split) == _compared(one)
    assert split[-1]["kl_ref"] > 0 and split[-1]["stale_router_flip_rate"] >= 0  # the adapters moved the policy
    assert len(bases) >= 3 and all(b == bases[0] for b in bases)  # rollouts and evaluations: one base copy

    with monkeypatch.context() as m, pytest.raises(run_lib.StoppedEarly):
        _sigterm_after(m, 0)  # the second iteration's batch is in flight when the checkpoint is taken
        run_lib.train_and_evaluate(build(c), tmp_path / "resumed", progress=False)
    run_lib.train_and_evaluate(build(c), tmp_path / "resumed", progress=False)
    assert _compared(_metrics(tmp_path / "resumed")) == _compared(split)
    final = [snapshots.load_params(snapshots.open_run(tmp_path / n, adapters=True), 3) for n in ("one", "resumed")]
    assert all(np.array_equal(a, b) for a, b in zip(*map(jax.tree.leaves, final), strict=True))


def test_a_workdir_recorded_before_the_split_keys_existed_resumes_as_one_mesh_only():
    """A run recorded without `mesh.rollout_devices` / `mesh.rollout` ran on one mesh: the same config
    today is no change, a split one is."""
    c = base_config("gspo", "tiny")
    recorded = json.loads(as_json(c))
    del recorded["mesh"]["rollout_devices"], recorded["mesh"]["rollout"]
    assert workdir_lib.config_changes(recorded, json.loads(as_json(c))) == []
    c.mesh.rollout_devices = 4
    assert workdir_lib.config_changes(recorded, json.loads(as_json(c))) == ["mesh.rollout_devices: 0 -> 4"]


class _Prompts:
    """A prompt stream whose position is how many batches were drawn."""

    def __init__(self):
        self.drawn = 0

    def state(self):
        return {"drawn": self.drawn}


def _batch(value: int) -> rollout_lib.RolloutBatch:
    host = np.full((2,), value)
    return rollout_lib.RolloutBatch(*(host for _ in range(11)))


def test_the_rollout_ahead_hands_over_in_order_remembers_the_prompts_and_raises_a_failure():
    """`RolloutAhead` with a stand-in rollout (host arrays only): one batch in flight at a time, taken by
    its own iteration; a checkpoint's prompt position is the one before the batch in flight; the
    rollout's exception reaches the trainer at `take`; `close` waits for the one in flight."""
    prompts, gate = _Prompts(), threading.Event()

    def rollout(policy, stream, key):
        gate.wait(10)
        if policy == "bad":
            raise ValueError("reward function failed")
        stream.drawn += 1
        return _batch(key), {"reward_mean": float(key)}

    ahead = overlap.RolloutAhead(rollout, prompts, trainer_mesh=None)
    assert ahead.take(0) is None and ahead.prompts_state() == {"drawn": 0}  # nothing started: drawn in place
    ahead.start(1, "policy", 7)
    with pytest.raises(RuntimeError, match="a rollout for iteration 1 is still in flight"):
        ahead.start(2, "policy", 8)
    assert ahead.prompts_state() == {"drawn": 0}  # what a checkpoint now records: the batch is drawn again
    gate.set()
    ahead.wait()
    assert prompts.drawn == 1 and ahead.prompts_state() == {"drawn": 0}  # drawn, not yet taken
    with pytest.raises(RuntimeError, match="iteration 1's, not 2's"):
        ahead.take(2)
    drawn = ahead.take(1)
    assert drawn.metrics == {"reward_mean": 7.0} and int(drawn.batch.tokens[0]) == 7
    assert drawn.busy_seconds >= 0 and drawn.wait_seconds >= 0 and ahead.prompts_state() == {"drawn": 1}
    ahead.start(2, "bad", 8)
    with pytest.raises(ValueError, match="reward function failed"):
        ahead.take(2)
    ahead.start(3, "policy", 9)
    ahead.close()  # waits for it, drops it
    assert prompts.drawn == 2 and ahead.take(3) is None

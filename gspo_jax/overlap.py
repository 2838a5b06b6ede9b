"""Sampling and training at once, on disjoint devices (`mesh.rollout_devices`): the sampler gets a mesh of
its own, and with `rollout.staleness` = k >= 1 iteration i + 1's rollout, whose behaviour policy is known
once iteration i has scored its batch, runs on a thread on the sampler's mesh while iteration i's update
runs on the trainer's. What each iteration computes is what the one-mesh loop computes with the same k
(docs/ALGORITHMS.md, "Bounded staleness"); only the time differs.

`meshes` splits the devices; `RolloutAhead` runs the rollout ahead and hands its batch over on the
trainer's mesh, remembering where the prompt stream stood before it (what a checkpoint records, so a
resumed run draws that batch again)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any, NamedTuple

import jax

from gspo_jax import built as built_lib
from gspo_jax import hosts
from gspo_jax import sharding as sharding_lib
from gspo_jax.rollout import Rollout, RolloutBatch


def meshes(built: built_lib.Built, devices=None) -> tuple[jax.sharding.Mesh, jax.sharding.Mesh | None]:
    """(the trainer's mesh, the sampler's or None): with `built.rollout_mesh` the trainer takes the first
    devices and the sampler the last `rollout_devices`, each laid out by its own axes."""
    devices = list(jax.devices() if devices is None else devices)
    if built.rollout_mesh is None:
        return sharding_lib.make_mesh(**built.mesh.axes(), devices=devices), None
    cut = len(devices) - built.rollout_devices
    trainer = sharding_lib.make_mesh(**built.mesh.axes(), devices=devices[:cut])
    return trainer, sharding_lib.make_mesh(**built.rollout_mesh.axes(), devices=devices[cut:])


def batch_to(batch: RolloutBatch, mesh: jax.sharding.Mesh) -> RolloutBatch:
    """The batch's per-token device fields moved to `mesh` (the trainer's), split as its batch fields are;
    the host fields as they are."""
    names = [f.name for f in dataclasses.fields(batch) if isinstance(getattr(batch, f.name), jax.Array)]
    moved = jax.device_put({k: getattr(batch, k) for k in names}, sharding_lib.field_shardings(mesh, names))
    return dataclasses.replace(batch, **moved)


class Drawn(NamedTuple):
    """A rollout drawn ahead, handed over: its batch (on the trainer's mesh) and metrics, the seconds the
    sampler worked on it and the seconds the trainer then waited for it."""

    batch: RolloutBatch
    metrics: dict[str, float]
    busy_seconds: float
    wait_seconds: float


class RolloutAhead:
    """One rollout at a time, on a thread: `start` draws iteration i's batch with the given policy, `take`
    waits for it. The thread's device work runs on the sampler's mesh, its host work (decoding, rewards)
    off the main thread; the batch is moved to `trainer_mesh` there too.

    Across hosts (`bridge`, `hosts.py`) there is no thread: every process runs the loop, and `start`
    draws the batch at once on the sampler's processes (the trainer's go on to the update), `take` is
    where the two sides meet: the batch's arrays cross by the bridge, its host values (rewards,
    advantages, metrics, the prompt stream's position after it) by a channel."""

    def __init__(self, rollout: Rollout, prompts: Any, trainer_mesh: jax.sharding.Mesh, bridge=None):
        self._rollout, self._prompts, self._mesh, self._bridge = rollout, prompts, trainer_mesh, bridge
        self._pending: tuple[int, Any, Any] | None = None
        if bridge is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout-ahead")
            return
        sampler = rollout.sampler.mesh
        self.samples, self.trains = hosts.holds(sampler), hosts.holds(trainer_mesh)
        self._lead = jax.process_index() == hosts.processes(sampler)[0]  # it sends the sampler's host values
        self._batches, self._evaluations = hosts.Channel("rollout"), hosts.Channel("evaluation")

    def start(self, iteration: int, policy, key) -> None:
        """Starts drawing `iteration`'s batch with `policy` (on the sampler's mesh) and `key`."""
        if self._pending is not None:
            raise RuntimeError(f"a rollout for iteration {self._pending[0]} is still in flight")
        before = self._prompts.state()
        if self._bridge is None:
            self._pending = (iteration, before, self._pool.submit(self._draw, policy, key))
        else:  # drawn now, where the sampler's devices are; the trainer's processes only count it
            self._pending = (iteration, before, self._draw(policy, key, to_trainer=False) if self.samples else None)

    def _draw(self, policy, key, to_trainer: bool = True) -> tuple[RolloutBatch, dict[str, float], float]:
        """The batch, its metrics and the seconds drawing it took; on the trainer's mesh unless across hosts,
        where it crosses in `take`."""
        t0 = time.perf_counter()
        batch, metrics = self._rollout(policy, self._prompts, key)
        batch = batch_to(batch, self._mesh) if to_trainer else batch
        jax.block_until_ready([getattr(batch, f.name) for f in dataclasses.fields(batch)])
        return batch, metrics, time.perf_counter() - t0

    def take(self, iteration: int) -> Drawn | None:
        """`iteration`'s batch, once drawn (None when none was started: a run's first iteration, a resume)."""
        if self._pending is None:
            return None
        started, _, future = self._pending
        if started != iteration:
            raise RuntimeError(f"the rollout in flight is iteration {started}'s, not {iteration}'s")
        self._pending = None  # taken, whether it drew its batch or raised
        t0 = time.perf_counter()
        if self._bridge is None:
            batch, metrics, busy = future.result()
        else:
            batch, metrics, busy = self._cross(future)
        return Drawn(batch, metrics, busy, time.perf_counter() - t0)

    def _cross(self, drawn) -> tuple[RolloutBatch, dict[str, float], float]:
        """A batch drawn on the sampler's processes, on the trainer's mesh (every process calls this)."""
        if self.samples:
            batch, metrics, busy = drawn
            arrays = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
            arrays = {k: v for k, v in arrays.items() if isinstance(v, jax.Array)}
            host = {k: v for k, v in dataclasses.asdict(batch).items() if k not in arrays}
            shapes = {k: (v.shape, v.dtype) for k, v in arrays.items()}
            message = dict(host=host, metrics=metrics, busy=busy, prompts=self._prompts.state(), shapes=shapes)
            self._batches.send(message) if self._lead else self._batches.skip()
        if not self.samples:
            message = self._batches.recv()
            self._prompts.restore(message["prompts"])  # where the sampler's stream now stands
            sh = sharding_lib.field_shardings(self._rollout.sampler.mesh, message["shapes"])
            arrays = {k: jax.ShapeDtypeStruct(s, d, sharding=sh[k]) for k, (s, d) in message["shapes"].items()}
        moved = self._bridge.move(arrays, sharding_lib.field_shardings(self._mesh, arrays))
        batch = RolloutBatch(**moved, **message["host"])
        return batch, message["metrics"], message["busy"]

    def evaluate(self, evaluation, policy, shardings) -> tuple[dict[str, float], list[dict]]:
        """`evaluation(policy)` (metrics, samples) where the sampler is, once the rollout in flight is
        drawn; across hosts `policy` first crosses to `shardings` (the sampler's) and the trainer's
        processes receive what the sampler's lead process measured."""
        if self._bridge is None:
            self.wait()
            return evaluation(policy)
        moved = self._bridge.move(policy, shardings)
        if not self.samples:
            return self._evaluations.recv()
        result = evaluation(moved)
        self._evaluations.send(result) if self._lead else self._evaluations.skip()
        return result

    def wait(self) -> None:
        """Until the rollout in flight is drawn (it stays to be taken): the sampler is then free, e.g. to
        evaluate. A failure in it is raised here."""
        if self._pending is not None and self._bridge is None:
            self._pending[2].result()

    def prompts_state(self):
        """Where the prompt stream stood before the rollout in flight (now, when none is): what a
        checkpoint records, so that a resumed run draws that batch again."""
        return self._prompts.state() if self._pending is None else self._pending[1]

    def close(self) -> None:
        """Waits for the rollout in flight (its batch is dropped) and ends the thread."""
        if self._bridge is not None:
            self._pending = None
            return
        if self._pending is not None:
            concurrent.futures.wait([self._pending[2]])
            self._pending = None
        self._pool.shutdown(wait=True)


def timing(drawn: Drawn | None, metrics: dict[str, float]) -> dict[str, float]:
    """Each mesh's busy seconds in an iteration of a split run, and their overlap: `sampler_busy_seconds`
    (the rollout's, on its thread when it was `drawn` ahead), `trainer_busy_seconds` (scoring, update
    and drift), `rollout_wait_seconds` (the trainer waiting for the batch) and `overlap_seconds` (the
    rollout's seconds the trainer did not wait through: 0 for a batch drawn in the iteration itself, its
    first or a resumed one's). `rollout_seconds` becomes the sampler's."""
    busy = metrics["rollout_seconds"] if drawn is None else drawn.busy_seconds
    waited = metrics["rollout_seconds"] if drawn is None else drawn.wait_seconds
    return dict(
        rollout_seconds=busy,
        sampler_busy_seconds=busy,
        trainer_busy_seconds=sum(metrics[f"{k}_seconds"] for k in ("logprob", "update", "drift")),
        rollout_wait_seconds=waited,
        overlap_seconds=max(busy - waited, 0.0),
    )

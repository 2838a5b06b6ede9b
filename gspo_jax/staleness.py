"""Bounded staleness, `rollout.staleness = k`: iteration i samples with the parameters the run had after
iteration i − k − 1, k iterations older than an on-policy run's, as an asynchronous trainer with
max_staleness = k sees its rollouts; while no policy is that old, with the oldest there is (the warm
start). That behaviour policy is π_old: the trainer scores the batch with it, the update starts from
today's parameters. Definitions and the pod layout: "Bounded staleness" in docs/ALGORITHMS.md.

`PolicyLag` keeps the k policies on the device; `saved` / `restored` put them in a checkpoint beside
the train state, so that a resumed run samples with exactly the policies an uninterrupted one would.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from gspo_jax import routing

LAGGED = "lagged_policies"  # the checkpoint's key for them, beside the train state's fields


class PolicyLag:
    """The k policies before today's, oldest first, as parameter copies on the device (k × the
    parameters' memory; slots not yet filled share the starting copy). With k = 0 it holds nothing
    and `behaviour` is today's policy. Under LoRA it holds the trainable adapters only (`state.params`):
    a lagged policy is the state's base with them (`TrainState.with_adapters`)."""

    def __init__(self, policies: Sequence[Any], shardings=None, move=None):
        """`shardings`: where the copies live (the sampler's mesh, `mesh.rollout_devices`), else where
        the parameters are; `policies` are moved there, by `move(tree, shardings)` (`jax.device_put`;
        across hosts `hosts.Bridge.move`)."""
        self._shardings, self._move = shardings, move or jax.device_put
        moved = {id(p): _copy(p, shardings, self._move) for p in policies} if shardings is not None else {}
        self._queue = collections.deque(moved.get(id(p), p) for p in policies)  # shared slots stay shared
        self._staged = None  # today's parameters, already on their way to `shardings` (`stage`)

    @classmethod
    def fresh(cls, k: int, params, shardings=None, move=None) -> PolicyLag:
        """A run's start: all k slots hold the starting parameters (one copy: `params` may be donated)."""
        start = _copy(params, shardings, move or jax.device_put) if k else None
        return cls([start] * k)._placed(shardings, move)

    def _placed(self, shardings, move) -> PolicyLag:
        self._shardings, self._move = shardings, move or jax.device_put
        return self

    @property
    def k(self) -> int:
        return len(self._queue)

    @property
    def policies(self) -> tuple[Any, ...]:
        """Oldest first: the one the next iteration samples with comes first."""
        return tuple(self._queue)

    def behaviour(self, current):
        """The policy this iteration samples and scores π_old with: the oldest kept (`current` with k = 0)."""
        return self._queue[0] if self._queue else current

    def advance(self, current) -> None:
        """Once this iteration has sampled and scored, before its update donates `current`: drops the
        oldest policy and keeps a copy of `current`, the next iteration's newest lagged one."""
        if self._queue:
            self._queue.popleft()
            staged, self._staged = self._staged, None
            self._queue.append(staged if staged is not None else _copy(current, self._shardings, self._move))

    def stage(self, current) -> None:
        """With copies on another mesh: starts moving `current` there as soon as the update has made it,
        for the next `advance` (which is given those same parameters) to take."""
        if self._queue and self._shardings is not None:
            self._staged = _copy(current, self._shardings, self._move)


def policy_lag(k: int, iteration: int) -> int:
    """How many iterations the behaviour policy of `iteration` (0-based) is behind today's: k, or fewer
    at the start, where the oldest policy is the warm start."""
    return min(k, iteration)


def _copy(params, shardings=None, move=jax.device_put):
    """A copy of `params` with its own buffers (the train step donates the original): on the same
    devices and shardings, or moved to `shardings` by `move` (another mesh's devices: a copy by itself)."""
    if shardings is not None:
        return move(params, shardings)
    return jax.tree.map(lambda x: jax.device_put(jnp.copy(x), x.sharding), params)


def saved(state, lag: PolicyLag):
    """What a checkpoint holds: the train state, and with k > 0 its fields beside the lagged policies
    (`params` stays a top-level key, so a tool that reads only it, `snapshots.load_params`, reads any
    run's). Given an abstract state and lag, the abstract tree to restore into. Never a LoRA run's
    frozen base (`TrainState.frozen`): its adapters (and the lag's) are saved, the base is rebuilt."""
    if getattr(state, "frozen", None) is not None:
        state = state.replace(frozen=None)
    if not lag.k:
        return state
    return {**{f.name: getattr(state, f.name) for f in dataclasses.fields(state)}, LAGGED: list(lag.policies)}


def restored(tree, like) -> tuple[Any, PolicyLag]:
    """(train state, lag) from what `saved` wrote; `like` is a state of the same type (its abstract)."""
    if not isinstance(tree, dict):
        return tree, PolicyLag([])
    fields = {f.name: tree[f.name] for f in dataclasses.fields(like)}
    return dataclasses.replace(like, **fields), PolicyLag(tree[LAGGED])


def abstract(abstract_state, k: int):
    """The abstract tree a checkpoint of a run with staleness k restores into."""
    return saved(abstract_state, PolicyLag([abstract_state.params] * k))


def drift_to_log(drift: dict[str, jax.Array]) -> dict[str, float]:
    """`routing.measure_drift` of today's policy against the behaviour policy's batch, as `stale_*`
    scalars (the `drift_*` names with the other prefix)."""
    return {"stale_" + k.removeprefix("drift_"): v for k, v in routing.drift_to_log(drift).items()}

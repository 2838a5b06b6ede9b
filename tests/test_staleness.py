"""Bounded staleness (`rollout.staleness = k`): iteration i samples, and scores π_old, with the policy
of iteration i − k (the warm start before there is one); the update starts from today's policy; the
drift between the two is logged; nothing recompiles; a resumed run restores the lagged policies and
ends bitwise where an uninterrupted one does; a bad value is refused at build."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_train import _metrics, _sigterm_after, small

from gspo_jax import iteration as iteration_lib
from gspo_jax import rollout as rollout_lib
from gspo_jax import run as run_lib
from gspo_jax import snapshots, staleness
from gspo_jax.built import build
from gspo_jax.config import base_config
from gspo_jax.validation import ConfigError


@pytest.mark.parametrize("k", [0, 1, 3])
def test_the_lag_hands_out_the_policy_k_iterations_back_and_owns_its_copies(k):
    """Policy θ_j is today's after iteration j (θ_-1 the warm start): iteration i samples with
    θ_max(i-k-1, -1), and the lag keeps its own buffers when today's are donated (deleted)."""
    theta = lambda j: {"w": jnp.full((2,), float(j))}
    current = theta(-1)
    lag = staleness.PolicyLag.fresh(k, current)
    for i in range(6):
        assert float(lag.behaviour(current)["w"][0]) == max(i - k - 1, -1)
        assert lag.k == k and staleness.policy_lag(k, i) == min(k, i)
        lag.advance(current)
        current["w"].delete()  # what the update's donation does
        current = theta(i)
    assert [float(p["w"][0]) for p in lag.policies] == list(range(5 - k, 5))  # iteration 6's θ_{6-k-1} first


def test_staleness_turns_off_the_shared_old_forward():
    """One update per batch shares π_old's forward only when the update starts at π_old."""
    c = base_config("gspo", "tiny")
    c.train.minibatches = 1
    assert build(c).plan.on_policy
    c.rollout.staleness = 1
    assert not build(c).plan.on_policy


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_a_bad_staleness_is_refused_at_build_in_one_line(value):
    c = base_config("gspo", "tiny")
    with c.ignore_type():
        c.rollout.staleness = value
    with pytest.raises(ConfigError, match="staleness") as e:
        build(c)
    assert "int >= 0" in str(e.value) and "\n" not in str(e.value)


def _leaves(params) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(params)]


def _spy(monkeypatch, seen: dict):
    """Records, per call, today's parameters at each iteration's start, and what the rollout samples
    with and `prepare_batch` scores π_old with."""
    rl_iteration, prepare_batch, sample = (
        iteration_lib.rl_iteration,
        iteration_lib.prepare_batch,
        rollout_lib.Rollout.__call__,
    )

    def spied_iteration(ctx, state, it):
        seen["current"].append(_leaves(state.params))
        return rl_iteration(ctx, state, it)

    def prepare(ctx, params, batch, *reference):
        seen["scored"].append(_leaves(params))
        return prepare_batch(ctx, params, batch, *reference)

    def rollout(self, params, *args):
        seen["sampled"].append(_leaves(params))
        return sample(self, params, *args)

    monkeypatch.setattr(iteration_lib, "rl_iteration", spied_iteration)
    monkeypatch.setattr(iteration_lib, "prepare_batch", prepare)
    monkeypatch.setattr(rollout_lib.Rollout, "__call__", rollout)


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
def test_a_stale_run_samples_with_the_lagged_policy_logs_its_drift_and_resumes_bitwise(tmp_path, monkeypatch):
    """staleness 1, three iterations: iterations 0 and 1 sample and score with the starting policy, 2
    with the policy after iteration 0; stopped after iteration 1 and resumed, the run restores that
    policy from the checkpoint and ends bitwise where the uninterrupted one does."""
    c = small("gspo")
    c.rollout.staleness = 1
    c.warm_start.steps = 0  # the aux losses alone move the policy: tiny rewards are all 0 at first
    c.train.update(learning_rate=1e-2, eval_every=10)  # two updates an iteration (the first at lr 0)
    seen = {"current": [], "sampled": [], "scored": []}
    with monkeypatch.context() as m:
        _spy(m, seen)
        run_lib.train_and_evaluate(build(c), tmp_path / "full", progress=False)
    current, sampled, scored = seen["current"], seen["sampled"], seen["scored"]
    assert len(current) == len(scored) == len(sampled) == 3  # (evaluation samples with `Rollout.sample`)
    for i, behaviour in enumerate((current[0], current[0], current[1])):
        assert _same(scored[i], behaviour) and _same(sampled[i], behaviour), i
    assert not _same(current[1], current[0])  # so iteration 1 really sampled with an older policy

    rows = {r["step"]: r for r in _metrics(tmp_path / "full")}
    assert [rows[s]["staleness"] for s in (1, 2, 3)] == [1, 1, 1]
    assert [rows[s]["policy_lag"] for s in (1, 2, 3)] == [0, 1, 1]
    assert rows[1]["stale_router_flip_rate"] <= 0.01  # the same policy: at most rounding at near-ties
    for s in (1, 2, 3):
        assert 0 <= rows[s]["stale_router_flip_rate"] <= 1 and np.isfinite(rows[s]["stale_logratio_routing_abs"])
    assert rows[2]["xla_compiles"] == rows[3]["xla_compiles"] == 0  # the lagged params are shaped as today's

    with monkeypatch.context() as m, pytest.raises(run_lib.StoppedEarly):
        _sigterm_after(m, 1)
        run_lib.train_and_evaluate(build(c), tmp_path / "resumed", progress=False)
    run_lib.train_and_evaluate(build(c), tmp_path / "resumed", progress=False)
    resumed = {r["step"]: r for r in _metrics(tmp_path / "resumed")}
    for key in ("loss", "reward_mean", "stale_router_flip_rate", "policy_lag"):
        assert resumed[3][key] == rows[3][key], key
    runs = {name: snapshots.open_run(tmp_path / name) for name in ("full", "resumed")}  # reads `params` alone
    final = [_leaves(snapshots.load_params(run, 3)) for run in runs.values()]
    assert _same(*final)

"""Routing replay is consistent: π_old is scored under the routing the update replays, so the importance
ratio is 1 at θ_old before any update (none / R2 / R3, on- and off-policy paths), and with the sampler's
log-probs as π_old the ratio is the sampler–trainer likelihood ratio under one routing."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_train import Setup, values

from gspo_jax import train
from gspo_jax.config import base_config


def small(**train_keys):
    """Two MoE layers of four experts (the smallest model with routing to replay), GRPO's token ratios."""
    c = base_config("grpo", "tiny")
    c.model.update(num_layers=2, dense_layers=(), num_experts=4)
    c.train.update(**train_keys)
    return c


def fake_rollout(s: Setup, seed=0):
    """A rollout as the sampler would hand it over, whose routing differs from the trainer's live routing
    on about a third of the (token, layer) slots and whose log-probs are off by a little noise: what a
    bf16 sampler gives, made by hand so every replay mode sees the same batch."""
    rng = np.random.default_rng(seed)
    B, P, C = s.built.batch_size, s.config.prompt_len, s.config.max_new_tokens
    T = P + C
    tokens = rng.integers(4, 100, (B, T)).astype(np.int32)
    pmask, cmask = np.zeros((B, T), bool), np.zeros((B, T), bool)
    for i in range(B):
        pmask[i, P - rng.integers(3, P) : P] = True
        cmask[i, P : P + rng.integers(1, C + 1)] = True
    positions = jnp.where(jnp.asarray(pmask | cmask), jnp.cumsum(pmask | cmask, 1) - 1, -1).astype(jnp.int32)
    b2 = s.programs.batch_shardings.tokens
    logp, topk = map(np.asarray, s.programs.score(s.params, *jax.device_put((jnp.asarray(tokens), positions), b2)))
    E = s.built.model.num_experts
    flip = rng.random(topk.shape[:3])[..., None] < 0.35
    sampler_topk = np.where(flip, (topk + 1) % E, topk)  # still K distinct experts per slot
    sampler_logp = np.where(cmask, logp + rng.normal(0, 0.05, logp.shape), 0.0).astype(np.float32)
    return types.SimpleNamespace(
        tokens=tokens,
        prompt_mask=pmask,
        completion_mask=cmask,
        loss_mask=cmask.astype(np.float32),
        old_logp=sampler_logp,
        topk=sampler_topk.astype(np.int32),
        advantages=rng.normal(0, 1, B).astype(np.float32),
    )


def first_update(s: Setup, rollout):
    """The batch as the trainer prepares it and the metrics of the first update on it (made at θ_old)."""
    metrics = {}
    full = train.prepare_batch(s.programs, s.params, rollout, s.built.train, None, metrics)
    rows = np.arange(s.mb_size)
    _, step, _ = s.programs.train_step(s.state(), s.programs.take(full, rows))
    return full, values(step), metrics


# (minibatches, correction): the on-policy path (one update, its own forward is π_old), the off-policy
# path with two minibatches, and the off-policy path with one update (masked IS needs π_old first).
PATHS = {"on-policy": (1, "none"), "two-minibatches": (2, "none"), "scored-first": (1, "mis")}


@pytest.mark.slow
@pytest.mark.parametrize("replay", ["none", "R2", "R3"])
def test_the_ratio_is_one_at_the_old_policy_under_every_replay(replay):
    rollout = None
    for path, (minibatches, correction) in PATHS.items():
        c = small(minibatches=minibatches, routing_replay=replay)
        c.loss.update(is_correction=correction, is_cap=1e6)  # a cap no token reaches: MIS keeps every token
        s = Setup(c)
        assert s.programs.on_policy == (path == "on-policy"), path
        rollout = rollout or fake_rollout(s)
        full, m, mismatch = first_update(s, rollout)
        assert m["ratio_min"] == pytest.approx(1.0, abs=2e-6) and m["ratio_max"] == pytest.approx(1.0, abs=2e-6), path
        assert m["clip_frac"] == 0.0, path
        if replay == "R3" and path != "on-policy":
            np.testing.assert_array_equal(full.topk, rollout.topk)  # the sampler's routing, replayed
        # The mismatch is against the trainer's live routing whatever is replayed: a third of the slots.
        if path != "on-policy" or replay == "R3":
            assert 0.2 < mismatch["mismatch_router_flip_rate"] < 0.5, (path, mismatch)


@pytest.mark.slow
def test_with_the_samplers_log_probs_the_ratio_is_the_mismatch_under_one_routing():
    """R3 with old_logp_source=sampler: at θ_old the ratio is π_trainer / π_sampler, the trainer scored
    under the sampler's routing, so no routing term enters it."""
    s = Setup(small(minibatches=2, routing_replay="R3", old_logp_source="sampler"))
    rollout = fake_rollout(s)
    full, m, _ = first_update(s, rollout)
    rows = np.arange(s.mb_size)
    b2 = s.programs.batch_shardings.tokens
    tokens, positions = jax.device_put((full.tokens[rows], full.positions[rows]), b2)
    replayed, _ = s.programs.score_replayed(s.params, tokens, positions, jnp.asarray(rollout.topk)[rows])
    live, _ = s.programs.score(s.params, tokens, positions)
    mask = rollout.completion_mask[rows]
    log_r = (np.asarray(replayed) - rollout.old_logp[rows])[mask]
    assert m["ratio_min"] == pytest.approx(np.exp(log_r.min()), rel=1e-5)
    assert m["ratio_max"] == pytest.approx(np.exp(log_r.max()), rel=1e-5)
    assert np.abs(np.asarray(live) - np.asarray(replayed))[mask].max() > 1e-3  # the routing term it leaves out

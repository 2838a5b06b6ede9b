"""Routing replay is consistent: π_old is scored under the routing the update replays, so the importance
ratio is 1 at θ_old before any update (none / R2 / R3 / R3W, on- and off-policy paths), and with the
sampler's log-probs as π_old the ratio is the sampler–trainer likelihood ratio under one routing. Weight
replay (R3W) reproduces the sampler's forward exactly where the router is all that differs."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_train import Setup, values

from gspo_jax import iteration as iteration_lib
from gspo_jax import model as model_lib
from gspo_jax import model_config
from gspo_jax.config import base_config
from gspo_jax.sampler import Sampler, SamplerOptions, left_pad


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
    gates = rng.uniform(0.1, 1.0, topk.shape).astype(np.float32)
    return types.SimpleNamespace(
        tokens=tokens,
        prompt_mask=pmask,
        completion_mask=cmask,
        loss_mask=cmask.astype(np.float32),
        sampler_logp=sampler_logp,
        topk=sampler_topk.astype(np.int32),
        gates=gates / gates.sum(-1, keepdims=True),
        advantages=rng.normal(0, 1, B).astype(np.float32),
    )


def first_update(s: Setup, rollout):
    """The batch as the trainer prepares it and the metrics of the first update on it (made at θ_old)."""
    full, metrics = iteration_lib.prepare_batch(s.context(), s.params, rollout)
    rows = np.arange(s.mb_size)
    _, step, _ = s.programs.train_step(s.state(), s.programs.take(full, rows))
    return full, values(step), metrics


# (minibatches, correction): the on-policy path (one update, its own forward is π_old), the off-policy
# path with two minibatches, and the off-policy path with one update (masked IS needs π_old first).
PATHS = {"on-policy": (1, "none"), "two-minibatches": (2, "none"), "scored-first": (1, "mis")}


@pytest.mark.slow
@pytest.mark.parametrize("replay", ["none", "R2", "R3", "R3W"])
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
        if replay in ("R3", "R3W") and path != "on-policy":
            np.testing.assert_array_equal(full.topk, rollout.topk)  # the sampler's routing, replayed
        assert (full.gates is not None) == (replay == "R3W")
        # The mismatch is against the trainer's live routing whatever is replayed: a third of the slots.
        if path != "on-policy" or replay in ("R3", "R3W"):
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
    log_r = (np.asarray(replayed) - rollout.sampler_logp[rows])[mask]
    assert m["ratio_min"] == pytest.approx(np.exp(log_r.min()), rel=1e-5)
    assert m["ratio_max"] == pytest.approx(np.exp(log_r.max()), rel=1e-5)
    assert np.abs(np.asarray(live) - np.asarray(replayed))[mask].max() > 1e-3  # the routing term it leaves out


def test_replaying_ids_and_weights_reproduces_the_samplers_forward():
    """A float32 sampler whose router differs from the trainer's (every other weight equal): replaying
    its expert ids and combine weights gives the trainer the sampler's log-probs to float tolerance,
    ids alone do not, and the router still gets a gradient through the live gates (straight-through)."""
    cfg = model_config.get("tiny", num_layers=2, dense_layers=(), num_experts=4)
    assert cfg.dtype == "float32"
    graphdef, params = nnx.split(model_lib.Transformer(cfg, rngs=nnx.Rngs(0)))
    shift = lambda path, x: x + 0.5 * jax.random.normal(jax.random.key(1), x.shape) if "router" in str(path) else x
    sampler_params = jax.tree_util.tree_map_with_path(shift, params)
    rng = np.random.default_rng(0)
    tokens, mask = left_pad([list(rng.integers(4, cfg.vocab_size, n)) for n in (3, 8, 5, 1)], 8)
    sampler = Sampler(graphdef, cfg, 4, 8, 8, options=SamplerOptions(record_gates=True))
    out = sampler(sampler_params, tokens, mask, jax.random.key(2))
    positions = model_lib.positions_from_mask(out.prompt_mask | out.completion_mask)
    score = jax.jit(functools.partial(model_lib.logprobs, graphdef))
    cm = np.asarray(out.completion_mask)
    logp = lambda forced: np.asarray(score(params, out.tokens, positions, forced)[0])
    error = lambda forced: np.abs(logp(forced) - out.sampler_logp)[cm].max()
    assert error((out.topk, out.gates)) < 1e-5
    assert error(out.topk) > 1e-3 and error(None) > 1e-3  # ids alone leave the gates' difference

    def router_grad(forced):  # the largest |gradient| of each MoE layer's router
        logp = lambda p: jnp.sum(jnp.where(out.completion_mask, score(p, out.tokens, positions, forced)[0], 0.0))
        leaves = jax.tree_util.tree_leaves_with_path(jax.grad(logp)(params))
        (g,) = [np.asarray(g) for path, g in leaves if "router" in str(path)]  # stacked over the layers
        return np.abs(g).reshape(g.shape[0], -1).max(axis=1)

    assert router_grad((out.topk, out.gates)).shape == (2,) and np.all(router_grad((out.topk, out.gates)) > 0)

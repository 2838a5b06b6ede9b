"""The trainer: sharded step = single-device step, micro-batching, non-finite skip, the tiny end-to-end
run (compile once, checkpoints, bitwise resume) and the CLI's error handling."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from train_cli import train_cli

from gspo_jax import checkpoint, losses, routing, staleness, train
from gspo_jax import config as config_lib
from gspo_jax import evaluate as evaluate_lib
from gspo_jax import iteration as iteration_lib
from gspo_jax import model as model_lib
from gspo_jax import optimizer as optimizer_lib
from gspo_jax import programs as programs_lib
from gspo_jax import run as run_lib
from gspo_jax import sharding as sharding_lib
from gspo_jax.built import build
from gspo_jax.checkpoint import Checkpointer
from gspo_jax.config import base_config
from gspo_jax.context import RunContext
from gspo_jax.sharding import mesh_from_config
from gspo_jax.tasks import Example, expressions, load_tokenizer, prompt_iterator
from gspo_jax.tasks.arithmetic import ArithmeticTask

ROOT = Path(__file__).resolve().parents[1]


def tiny(algorithm="gspo", **mesh):
    c = base_config(algorithm, "tiny")
    c.mesh.update(**mesh)
    return c


def small(algorithm="gspo"):
    """The tiny preset with one MoE stack of two layers of four experts: for identities of the step
    that hold for any model, with about a third less to compile."""
    c = tiny(algorithm)
    c.model.update(num_layers=2, dense_layers=(), num_experts=4)
    return c


class Setup:
    """A run's pieces, built with the trainer's own public functions."""

    def __init__(self, config):
        self.config, self.built = config, build(config)
        self.mesh = mesh_from_config(**config.mesh)
        self.graphdef, self.params = programs_lib.init_policy(self.built, self.mesh)
        self.programs = programs_lib.compile_programs(self.built, self.graphdef, self.params, self.mesh)
        self.mb_size = self.built.rollout.num_groups * self.built.rollout.group_size // config.train.minibatches

    def state(self):
        return programs_lib.init_train_state(self.programs, self.params, self.config.seed)

    def context(self, rollout=None, prompts=None, reference=None) -> RunContext:
        """A run context of these pieces (for `iteration.rl_iteration` and `prepare_batch`)."""
        ctx = RunContext(self.built, self.mesh, self.graphdef, self.programs, rollout, prompts, reference)
        ctx.lag = staleness.PolicyLag.fresh(self.built.rollout.staleness, self.params)
        return ctx

    def step(self, batch: train.TrainBatch):
        return self.programs.train_step(self.state(), jax.device_put(batch, self.programs.batch_shardings))


def minibatch(s: Setup, seed=0) -> train.TrainBatch:
    """A random but well-formed minibatch in the trainer's layout."""
    rng = np.random.default_rng(seed)
    B, P = s.mb_size, s.config.prompt_len
    T = P + s.config.max_new_tokens
    tokens = rng.integers(4, 100, (B, T)).astype(np.int32)
    pmask = np.zeros((B, T), bool)
    cmask = np.zeros((B, T), bool)
    for i in range(B):
        pmask[i, P - rng.integers(3, P) : P] = True
        cmask[i, P : P + rng.integers(1, T - P + 1)] = True
    positions = jnp.where(jnp.asarray(pmask | cmask), jnp.cumsum(pmask | cmask, 1) - 1, -1).astype(jnp.int32)
    b2 = s.programs.batch_shardings.tokens
    logp, topk = s.programs.score(s.params, *jax.device_put((jnp.asarray(tokens), positions), b2))
    old = np.asarray(logp) + rng.normal(0, 0.02, (B, T)).astype(np.float32) * cmask
    return train.TrainBatch(
        tokens=jnp.asarray(tokens),
        positions=positions,
        completion_mask=jnp.asarray(cmask),
        loss_mask=jnp.asarray(cmask, jnp.float32),
        old_logp=jnp.asarray(old, jnp.float32),
        sampler_logp=jnp.asarray(old, jnp.float32),
        ref_logp=jnp.asarray(logp) - 0.01,
        advantages=jnp.asarray(rng.normal(0, 1, B), jnp.float32),
        topk=jnp.asarray(topk),
    )


def values(metrics):
    return {k: float(m.compute()) for k, m in metrics.items()}


# GSPO on the tiny preset (its dense layer's tensor-parallel MLP too), GRPO on `small` (a third less to compile).
@pytest.mark.parametrize("algorithm, size", [("grpo", small), ("gspo", tiny)], ids=["grpo-small", "gspo-tiny"])
def test_sharded_train_step_equals_single_device(algorithm, size):
    single = Setup(size(algorithm))
    c = size(algorithm)
    c.mesh.update(data=2, expert=2, tensor=2)
    sharded = Setup(c)
    assert sharded.mesh.devices.size == 8
    batch = minibatch(single)
    s1, m1, _ = single.step(batch)
    s2, m2, _ = sharded.step(batch)
    m1, m2 = values(m1), values(m2)
    for k in ("loss", "total_loss", "grad_norm", "clip_frac"):
        np.testing.assert_allclose(m1[k], m2[k], rtol=1e-5, atol=1e-7, err_msg=k)
    chex.assert_trees_all_close(s1.params, s2.params, rtol=1e-5, atol=1e-6)
    leaf = jax.tree.leaves(s2.params)[0]
    assert len(leaf.sharding.device_set) > 1  # really sharded
    # ... and expert-parallel: the MoE's tokens travel to their experts with an all-to-all.
    step = sharded.programs.train_step
    args = (sharded.state(), jax.device_put(batch, sharded.programs.batch_shardings))
    assert "all_to_all" in step.lower(*args).as_text()


@pytest.mark.parametrize("algorithm", ["dapo", "grpo"])
def test_microbatches_give_the_same_update(algorithm):
    """The global (minibatch) denominator makes micro-batch sums exact. The MoE aux losses are batch
    statistics, not additive over micro-batches, so they are switched off for the identity."""
    c = small(algorithm)
    c.model.update(lb_loss_coef=0.0, z_loss_coef=0.0)
    one = Setup(c)
    c2 = small(algorithm)
    c2.model.update(lb_loss_coef=0.0, z_loss_coef=0.0)
    if algorithm == "dapo":
        c2.train.microbatches = 2
    else:  # two micro-batches from the token bound: half the minibatch's tokens fit, all of them do not
        rows = c2.rollout.num_groups * c2.rollout.group_size // c2.train.minibatches
        c2.train.microbatch_tokens = rows // 2 * (c2.prompt_len + c2.max_new_tokens)
    two = Setup(c2)
    assert one.programs.step_config.microbatches == 1 and two.built.plan.update_microbatches == 2
    assert two.programs.step_config.microbatches == 2
    batch = minibatch(one, seed=1)
    s1, m1, _ = one.step(batch)
    s2, m2, _ = two.step(batch)
    m1, m2 = values(m1), values(m2)
    for k in ("total_loss", "loss", "policy_loss", "kl_loss", "grad_norm", "clip_frac", "approx_kl", "num_tokens"):
        np.testing.assert_allclose(m1[k], m2[k], rtol=1e-5, atol=1e-8, err_msg=k)
    chex.assert_trees_all_close(s1.params, s2.params, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_bfloat16_sampler_shows_a_mismatch_the_float32_trainer_measures(tmp_path):
    """rollout.dtype=bfloat16 samples with the same weights at bf16: the trainer's float32
    recomputation of π_old then differs from the sampler's log-probs, as an inference engine's would."""
    c = tiny("gspo")
    c.rollout.dtype = "bfloat16"
    c.warm_start.steps = 0
    c.train.update(num_iterations=1, minibatches=1, eval_every=10)
    run_lib.train_and_evaluate(build(c), tmp_path, progress=False)
    row = _metrics(tmp_path)[1]
    assert 1e-3 < row["mismatch_logp_abs_mean"] <= row["old_logp_max_diff"]  # float32 alone: < 1e-4
    assert 0.0 < row["mismatch_kl_k3"] < 0.1
    assert 0.0 <= row["mismatch_router_flip_rate"] <= row["mismatch_token_any_flip"] <= 1.0


def test_masked_is_equals_leaving_those_tokens_out_and_truncated_is_logs_its_weights():
    """MIS through the whole step (denominator included) is the step on a loss mask without the tokens
    it drops, and with 2 micro-batches too; TIS at a uniform weight w < C scales the policy loss by w."""
    steps = {}
    for kind, micro in (("none", 1), ("mis", 1), ("mis", 2), ("tis", 1)):
        c = small("grpo")
        c.model.update(lb_loss_coef=0.0, z_loss_coef=0.0)  # batch statistics: not additive over micro-batches
        c.loss.update(is_correction=kind, is_cap=2.0)
        c.train.microbatches = micro
        steps[kind, micro] = Setup(c)
    batch = minibatch(steps["none", 1], seed=3)
    far = np.zeros(batch.old_logp.shape, np.float32)
    far[::2] = 5.0  # every 2nd sequence: w = e^-5, outside [1/2, 2]
    mis = batch.replace(sampler_logp=batch.old_logp + far)
    dropped = batch.replace(loss_mask=batch.loss_mask * (far == 0))
    _, ref, _ = steps["none", 1].step(dropped)
    ref = values(ref)
    for micro in (1, 2):
        _, got, _ = steps["mis", micro].step(mis)
        got = values(got)
        for k in ("loss", "policy_loss", "grad_norm", "num_tokens", "denominator"):
            np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-8, err_msg=(micro, k))
        frac = float(np.sum(np.asarray(batch.loss_mask)[::2]) / np.sum(np.asarray(batch.loss_mask)))
        assert got["is_cut_frac"] == pytest.approx(frac)
    half = batch.replace(sampler_logp=batch.old_logp + np.log(2.0) * np.asarray(batch.loss_mask))  # w = 1/2
    _, plain, _ = steps["none", 1].step(batch)
    _, tis, _ = steps["tis", 1].step(half)
    plain, tis = values(plain), values(tis)
    np.testing.assert_allclose(tis["policy_loss"], 0.5 * plain["policy_loss"], rtol=1e-5)
    assert tis["is_weight_mean"] == pytest.approx(0.5) and tis["is_cut_frac"] == 0.0


@pytest.mark.parametrize("replay", ["none", "R2"])
def test_the_step_splits_clipping_ratio_noise_and_gradient_by_flipped_routing(replay):
    """Rows whose recorded routing differs (in the last MoE layer) from the policy's own are the
    flipped tokens, with or without replay; the split adds up to the whole (clip fraction) and the
    flipped share of |∂loss/∂logp| equals the hand computation from the loss alone."""
    c = tiny("grpo")
    c.train.routing_replay = replay
    s = Setup(c)
    batch = minibatch(s, seed=5)
    rng = np.random.default_rng(5)
    batch = batch.replace(old_logp=batch.old_logp + rng.normal(0, 0.3, batch.old_logp.shape).astype(np.float32))
    E = s.built.model.num_experts
    topk = np.asarray(batch.topk).copy()
    topk[::2, -1] = (topk[::2, -1] + 1) % E  # the last layer: upstream routing (and hidden states) unchanged
    flipped = np.zeros(topk.shape[0], bool)
    flipped[::2] = True
    _, m, _ = s.step(batch.replace(topk=jnp.asarray(topk)))
    m = values(m)
    mask = np.asarray(batch.loss_mask) > 0
    assert m["flipped_frac"] == pytest.approx(mask[flipped].sum() / mask.sum())
    split = m["flipped_frac"] * m["clip_frac_flipped"] + (1 - m["flipped_frac"]) * m["clip_frac_unflipped"]
    assert m["clip_frac"] > 0 and split == pytest.approx(m["clip_frac"], rel=1e-5)
    forced = jnp.asarray(topk) if replay != "none" else None  # under replay the loss's π_θ routes as told
    temperature = float(s.built.rollout.temperature) or 1.0
    logp, _ = model_lib.score(s.graphdef, temperature, s.params, batch.tokens, batch.positions, forced)
    delta = np.abs(np.asarray(logp) - np.asarray(batch.old_logp))
    assert m["abs_log_ratio_flipped"] == pytest.approx(delta[mask & flipped[:, None]].mean(), rel=1e-4)
    # The tails: beyond [0.5, 2] exactly; the 99th percentile within a histogram bin (3.6%) of the order
    # statistic at rank ceil(0.99 n), per side and for the sequences' length-normalised log-ratios.
    for name, side in (("flipped", mask & flipped[:, None]), ("unflipped", mask & ~flipped[:, None])):
        assert m[f"ratio_tail_frac_{name}"] == pytest.approx((delta[side] > np.log(2)).mean(), abs=1e-6)
        kth = np.sort(delta[side])[int(np.ceil(0.99 * side.sum())) - 1]
        assert m[f"abs_log_ratio_p99_{name}"] == pytest.approx(kth, rel=0.04)
    assert 0 < m["ratio_tail_frac_unflipped"] < 1  # 0.3-nat noise: some tokens leave [0.5, 2]
    signed = np.asarray(logp) - np.asarray(batch.old_logp)
    abs_log_s = np.abs((signed * mask).sum(1) / np.maximum(mask.sum(1), 1))[mask.any(1)]
    assert m["seq_ratio_tail_frac"] == pytest.approx((abs_log_s > np.log(2)).mean(), abs=1e-6)
    kth = np.sort(abs_log_s)[int(np.ceil(0.99 * len(abs_log_s))) - 1]
    assert m["seq_abs_log_ratio_p99"] == pytest.approx(kth, rel=0.04)
    cfg = s.built.loss
    loss = lambda lp: losses.policy_loss(
        cfg,
        lp,
        batch.old_logp,
        batch.advantages,
        batch.loss_mask,
        batch.ref_logp,
        denominator=losses.loss_denominator(cfg, batch.loss_mask > 0),
    )[0]
    g = np.abs(np.asarray(jax.grad(loss)(logp)))
    assert m["grad_share_flipped"] == pytest.approx(g[flipped].sum() / g.sum(), rel=1e-4)


def test_routing_diagnostics_switch_off():
    c = tiny("grpo")
    c.train.routing_diagnostics = False
    s = Setup(c)
    batch = minibatch(s)
    _, m, _ = s.step(batch)
    assert "flipped_frac" not in m and "grad_share_flipped" not in m and "clip_frac" in m
    drift = s.programs.drift(s.params, jax.device_put(batch, s.programs.batch_shardings))
    assert "router_margin" not in drift and "router_flip_rate" in drift


def test_drift_equals_the_own_and_the_replayed_forward():
    """The drift program's metrics equal those computed from two separate forwards of π_θ: routing
    itself, and under π_old's routing replayed (in batch chunks too)."""
    c = tiny()
    c.model.batch_chunks = 2
    s = Setup(c)
    batch = minibatch(s, seed=5)
    c.seed += 1  # another policy than the one that routed the batch: its routing differs
    _, params = programs_lib.init_policy(build(c), s.mesh)
    drift = s.programs.drift(params, jax.device_put(batch, s.programs.batch_shardings))
    temperature = float(s.built.rollout.temperature) or 1.0
    own, aux = model_lib.logprobs(
        s.graphdef, params, batch.tokens, batch.positions, None, temperature, return_router_logits=True
    )
    replayed, _ = model_lib.score(s.graphdef, temperature, params, batch.tokens, batch.positions, batch.topk)
    mask = batch.completion_mask
    want = routing.routing_drift(batch.topk, aux.topk, mask)
    want.update(routing.log_ratio_decomposition(own, replayed, batch.old_logp, mask))
    want.update(routing.routing_diagnostics(batch.topk, aux.topk, aux.router_logits, mask))
    assert set(drift) == set(want)
    assert float(want["router_flip_rate"]) > 0 and float(want["logratio_routing_abs"]) > 0  # the two forwards differ
    for k, v in want.items():
        np.testing.assert_allclose(drift[k], v, rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize(
    "epochs, minibatches, source, replay, shared",
    [
        (1, 1, "trainer", "none", True),
        (1, 1, "trainer", "R2", True),  # R2 replays the routing the forward at π_old chooses anyway
        (1, 1, "trainer", "R3", True),  # the forward replays the sampler's routing, and π_old is scored under it
        (1, 1, "sampler", "none", False),
        (2, 1, "trainer", "none", False),
        (1, 2, "trainer", "none", False),
    ],
)
def test_which_runs_share_the_old_forward(epochs, minibatches, source, replay, shared):
    c = tiny()
    c.train.update(epochs=epochs, minibatches=minibatches, old_logp_source=source, routing_replay=replay)
    plan = build(c).plan
    assert plan.on_policy is shared
    # R2 replays π_old's routing only off the on-policy path; R3 always replays the sampler's.
    assert plan.forces_routing is (replay == "R3" or (replay == "R2" and not shared))


@pytest.mark.parametrize("algorithm, microbatches", [("gspo", 2)])  # sequence ratios, stacked micro-batches
def test_on_policy_step_equals_the_step_on_a_scored_batch(algorithm, microbatches):
    """With one update per batch, the update's own forward at π_old gives π_old's log-probs and routing:
    the step, its metrics and what it returns equal scoring first and stepping on the scored batch."""
    c = small(algorithm)
    c.train.update(minibatches=1, microbatches=microbatches)
    shared = Setup(c)
    assert shared.programs.on_policy
    c2 = small(algorithm)
    c2.train.update(minibatches=1, microbatches=microbatches, old_logp_source="sampler")
    scored_first = Setup(c2)
    assert not scored_first.programs.on_policy
    batch = minibatch(shared, seed=3)
    logp, topk = shared.programs.score(shared.params, batch.tokens, batch.positions)
    junk = batch.replace(old_logp=batch.old_logp + 5.0, topk=(batch.topk + 1) % 8)  # never read
    s1, m1, scored = shared.step(junk)
    s2, m2, none = scored_first.step(batch.replace(old_logp=logp, topk=topk))
    assert none is None
    np.testing.assert_allclose(scored.old_logp, logp, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(scored.topk, topk)
    m1, m2 = values(m1), values(m2)
    assert m1["clip_frac"] == 0.0 and m1["approx_kl"] == 0.0  # ratios exactly 1
    for k in ("total_loss", "loss", "grad_norm", "clip_frac", "approx_kl"):
        np.testing.assert_allclose(m1[k], m2[k], rtol=1e-5, atol=1e-7, err_msg=k)
    chex.assert_trees_all_close(s1.params, s2.params, rtol=1e-5, atol=1e-6)


def test_each_minibatch_of_an_update_equals_an_independent_computation():
    """GSPO at 4 updates per rollout (the headline cell's multi-minibatch path): every update's sequence
    ratios, clipping and loss equal numpy's, computed from π_old's log-probs of the full batch's rows (found
    by their tokens, not by the trainer's indices) and the policy of that update, scored by the scoring
    program; the four minibatches partition the batch."""
    c = small("gspo")
    c.train.update(minibatches=4)
    s = Setup(c)
    s.mb_size = B = s.built.batch_size  # the full batch: `minibatch` draws s.mb_size rows
    full = minibatch(s, seed=5)
    full = full.replace(old_logp=full.old_logp + 0.01 * full.loss_mask)  # some sequences' ratios leave the band
    seen = []
    step = s.programs.train_step

    def recording(state, mb):
        seen.append((jax.tree.map(jnp.copy, state.policy), mb))
        out = step(state, mb)
        seen[-1] += (values(out[1]),)
        return out

    programs = s.programs._replace(train_step=recording)
    iteration_lib._updates(programs, s.built.train, s.state(), full, jax.random.key(3))
    assert len(seen) == 4
    tokens = np.asarray(full.tokens)
    rows, clips = [], []
    lo, hi = s.built.loss.eps_low, s.built.loss.eps_high
    for policy, mb, m in seen:
        idx = [int(np.flatnonzero((tokens == t).all(1))[0]) for t in np.asarray(mb.tokens)]
        rows += idx
        old, mask, adv = (np.asarray(getattr(full, f))[idx] for f in ("old_logp", "loss_mask", "advantages"))
        logp = np.asarray(s.programs.score(policy, mb.tokens, mb.positions)[0], np.float64)
        log_s = np.sum(mask * (logp - old), 1) / np.maximum(mask.sum(1), 1)
        ratio = np.exp(log_s)
        surrogate = np.minimum(ratio * adv, np.clip(ratio, 1 - lo, 1 + hi) * adv)
        assert m["seq_ratio_mean"] == pytest.approx(ratio.mean(), rel=1e-5)
        assert m["seq_ratio_min"] == pytest.approx(ratio.min(), rel=1e-5)
        assert m["seq_ratio_max"] == pytest.approx(ratio.max(), rel=1e-5)
        clipped = (ratio < 1 - lo) & (adv < 0) | (ratio > 1 + hi) & (adv > 0)
        assert m["seq_clip_frac"] == pytest.approx(clipped.mean())
        assert m["loss"] == pytest.approx(-surrogate.mean(), rel=1e-4, abs=1e-7)
        clips.append(clipped)
    assert sorted(rows) == list(range(B))
    assert 0 < np.concatenate(clips).mean() < 1  # both sides of the clip were exercised


@pytest.mark.parametrize("size", [1, 7, 1000, 4099])  # scalar-like, below and past vector widths
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_all_finite_is_exactly_every_element_finite(size, bad):
    """The skip's check, isfinite(sum(x · 0)) per leaf, equals numpy's all(isfinite) wherever the bad
    value sits, past any vectorised loop's width too; integer leaves are not checked."""
    check = jax.jit(optimizer_lib.all_finite)
    rng = np.random.default_rng(size)
    big = np.float32(3e38)  # finite, and |x| of it too: no overflow on the way
    for where in sorted({0, size // 2, size - 1}):
        x = rng.normal(size=size).astype(np.float32)
        x[rng.integers(size)] = big
        tree = {"w": x, "count": np.int32(7), "m": (np.zeros((3, 2), np.float32), np.float32(-big))}
        assert bool(check(tree)) and bool(check(tree["m"], x))
        x[where] = bad
        assert not bool(check(tree)) and not bool(check(tree["m"], x)) and not bool(check(x[where : where + 1]))
    assert bool(check({"count": np.int32(1)}))  # nothing floating: nothing to fail


def _adamw_case(lr=1e-2, weight_decay=0.1, max_grad_norm=1.0):
    """(tx, its 10-update schedule, params, optimizer state, gradients by scale)."""
    cfg = optimizer_lib.OptimizerConfig(lr, weight_decay=weight_decay, max_grad_norm=max_grad_norm)
    tx, schedule = optimizer_lib.make_optimizer(cfg.rule), cfg.schedule(10)
    rng = np.random.default_rng(0)
    params = {
        "w": jnp.asarray(rng.normal(size=(3, 5)), jnp.float32),
        "b": (jnp.asarray(rng.normal(size=7), jnp.float32),),
    }
    opt_state = tx.init(params)
    grads = lambda scale: jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * scale, jnp.float32), params)
    return tx, schedule, params, opt_state, grads


@pytest.mark.parametrize(
    "lr, warmup, total, end_factor",
    [(3e-4, 10, 400, 0.1), (3e-4, 5, 12, 0.1), (1e-6, 10, 2000, 0.0), (3e-4, 0, 6, 0.1), (2.5e-5, 3, 37, 0.05)]
    + [(3e38, 0, 4, 0.1)],
)
def test_the_schedule_given_as_arrays_is_optaxs_with_constants(lr, warmup, total, end_factor):
    """`learning_rate` on `OptimizerConfig.schedule`'s arrays against optax's warmup-cosine schedule with
    the same numbers compiled in, as a step computes it (a scalar count), at every update of the run and
    past its end: within float32 rounding of the peak on any XLA, and bit for bit where XLA compiles
    optax's arithmetic as written. (jax 0.10's XLA folds constant products, π / decay steps among them,
    so optax's own values round differently there; newer ones keep π and only invert the divisors.)"""
    cfg = optimizer_lib.OptimizerConfig(lr, warmup_steps=warmup, end_lr_factor=end_factor)
    ref = jax.jit(
        optax.warmup_cosine_decay_schedule(0.0, lr, max(warmup, 1), max(total, warmup + 1), end_value=lr * end_factor)
    )
    as_written = "constant(3.14159274)" in ref.lower(np.int32(0)).compile().as_text()  # π not folded away
    ours = jax.jit(optimizer_lib.learning_rate)
    bits = lambda x: np.asarray(x, np.float32).view(np.uint32)
    schedule = cfg.schedule(total)
    for count in range(total + 5):
        got, want = ours(schedule, np.int32(count)), ref(np.int32(count))
        assert abs(float(got) - float(want)) <= 4 * np.finfo(np.float32).eps * lr, count
        assert not as_written or bits(got) == bits(want), count
    assert float(ours(schedule, np.int32(max(warmup, 1)))) == np.float32(lr)  # the peak, right after the warmup


def test_runs_that_differ_only_in_learning_rate_and_length_share_one_step_program():
    """The schedule is an argument of the step, not constants in it: the runs of a learning-rate
    sweep, or a run extended, lower to the same program (one compile, in process or from the
    persistent cache), each with its own schedule."""
    a, b = small("grpo"), small("grpo")
    b.train.update(learning_rate=3 * a.train.learning_rate, num_iterations=a.train.num_iterations + 7)
    b.train.update(warmup_steps=a.train.warmup_steps + 2, end_lr_factor=0.5)
    sa, sb = Setup(a), Setup(b)
    assert sa.programs.step_config == sb.programs.step_config

    def lowered(s: Setup) -> str:
        state = programs_lib.abstract_train_state(s.programs, s.params)
        batch = train.TrainBatch.abstract(s.built, s.mb_size, a.prompt_len + a.max_new_tokens)
        return s.programs.train_step.lower(state, sharding_lib.abstract(batch, s.programs.batch_shardings)).as_text()

    assert lowered(sa) == lowered(sb)
    (one,), (other,) = sa.programs.train_step.args, sb.programs.train_step.args
    assert float(one.policy.peak) == np.float32(a.train.learning_rate) != float(other.policy.peak)
    assert float(other.policy.peak) == np.float32(b.train.learning_rate)
    assert int(other.policy.warmup) == int(one.policy.warmup) + 2


def test_clip_is_one_scalar_factor_within_an_ulp_of_optax():
    g = {"a": jnp.asarray([3.0, 4.0]), "b": jnp.asarray([[0.0, -12.0]])}  # ‖g‖ = 13
    clip = optimizer_lib.clip_by_global_norm(1.0)
    out, _ = clip.update(g, clip.init(g))
    np.testing.assert_allclose(out["a"], [3 / 13, 4 / 13], rtol=1e-7)
    np.testing.assert_allclose(out["b"], [[0.0, -12 / 13]], rtol=1e-7)
    ref, _ = optax.clip_by_global_norm(1.0).update(g, optax.EmptyState())
    for x, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        assert np.all(np.abs(np.asarray(x) - np.asarray(r)) <= np.spacing(np.abs(np.asarray(r))))  # ≤ 1 ulp
    out, _ = clip.update(g, clip.init(g), grad_norm=jnp.float32(26.0))  # a norm the caller has: used as is
    np.testing.assert_allclose(out["a"], [3 / 26, 4 / 26], rtol=1e-7)
    loose = optimizer_lib.clip_by_global_norm(13.5)
    chex.assert_trees_all_equal(loose.update(g, loose.init(g))[0], g)  # under the bound: bit for bit


@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
def test_apply_if_finite_is_optax_adamw(max_grad_norm):
    """The two-pass update (check, then a conditional) writes what optax's own clip_by_global_norm +
    adamw chain writes: bit for bit without clipping, within float rounding when it clips (norm 30 > 1;
    a scalar factor instead of optax's per-element divide) or not (norm 0.3 < 1)."""
    tx, schedule, params, opt_state, grads = _adamw_case(max_grad_norm=max_grad_norm)
    lr = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 1, 10, end_value=1e-3)  # the schedule as constants
    adamw = optax.adamw(lr, weight_decay=0.1)
    ref_tx = optax.chain(optax.clip_by_global_norm(max_grad_norm), adamw) if max_grad_norm else adamw

    @jax.jit
    def ours(p, o, g):
        return optimizer_lib.apply_if_finite(tx, schedule, g, optax.tree.norm(g), o, p)

    @jax.jit
    def ref(p, o, g):
        u, o = ref_tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    p, o, rp, ro = params, opt_state, params, ref_tx.init(params)
    for scale in (10.0, 0.1, 10.0):  # the schedule's first step has lr 0: three steps
        g = grads(scale)
        p, o, applied = ours(p, o, g)
        rp, ro = ref(rp, ro, g)
        assert bool(applied)
        if max_grad_norm:
            chex.assert_trees_all_close(p, rp, rtol=1e-6, atol=1e-7)
            chex.assert_trees_all_close(jax.tree.leaves(o), jax.tree.leaves(ro), rtol=1e-5, atol=1e-12)
        else:
            chex.assert_trees_all_equal(p, rp)
            chex.assert_trees_all_equal(jax.tree.leaves(o), jax.tree.leaves(ro))
    assert not np.array_equal(p["w"], params["w"])


@pytest.mark.parametrize("case", ["nan_gradient", "not_ok", "parameter_overflows", "moment_not_finite"])
def test_apply_if_finite_keeps_the_whole_old_state(case):
    """Any non-finite value the update would write (or a caller's `ok` False) leaves every parameter,
    moment and counter as it was, and says so."""
    tx, schedule, params, opt_state, grads = _adamw_case(
        **({"lr": 1e30, "weight_decay": 1e10} if case == "parameter_overflows" else {})
    )
    g, ok = grads(0.1), True
    _, opt_state, _ = optimizer_lib.apply_if_finite(tx, schedule, g, optax.tree.norm(g), opt_state, params)  # lr > 0
    if case == "nan_gradient":
        g = {"w": g["w"].at[1, 2].set(jnp.nan), "b": g["b"]}
    elif case == "not_ok":
        ok = False
    elif case == "moment_not_finite":  # a state that is already bad is not carried forward either
        adam = opt_state[1][0]
        opt_state = (
            opt_state[0],
            (adam._replace(nu={"w": adam.nu["w"], "b": (adam.nu["b"][0].at[3].set(jnp.inf),)}), *opt_state[1][1:]),
        )
    run = jax.jit(lambda p, o, g, ok: optimizer_lib.apply_if_finite(tx, schedule, g, optax.tree.norm(g), o, p, ok))
    p, o, applied = run(params, opt_state, g, jnp.asarray(ok))
    assert not bool(applied)
    chex.assert_trees_all_equal((p, jax.tree.leaves(o)), (params, jax.tree.leaves(opt_state)))
    if case == "parameter_overflows":  # the check is what stopped it: the plain update overflows
        u, _ = tx.update(g, opt_state, params, schedule=schedule)
        assert not np.isfinite(np.asarray(optax.apply_updates(params, u)["w"])).all()


def test_non_finite_loss_skips_the_update():
    s = Setup(tiny("grpo"))
    batch = minibatch(s, seed=2)
    batch = batch.replace(advantages=batch.advantages.at[0].set(jnp.nan))
    state = s.state()
    before = jax.tree.map(np.asarray, state)
    new, m, _ = s.programs.train_step(state, jax.device_put(batch, s.programs.batch_shardings))
    assert float(m["skipped"].compute()) == 1.0 and int(new.step) == 0
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, new), before)


def test_train_state_is_donated_to_the_step():
    s = Setup(tiny("gspo"))
    state = s.state()
    s.programs.train_step(state, jax.device_put(minibatch(s), s.programs.batch_shardings))
    assert all(x.is_deleted() for x in jax.tree.leaves(state.params))


def _metrics(workdir):
    return [json.loads(x) for x in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def _final_params(workdir, config):
    """The params of the newest checkpoint in `workdir`, as numpy arrays."""
    s = Setup(config)
    with Checkpointer(Path(workdir) / "checkpoints") as ckpt:
        restored = checkpoint.resume(ckpt, s.state(), _prompts(s))
    return [np.asarray(x) for x in jax.tree.leaves(restored[1].params)]


def _prompts(s: Setup):
    return prompt_iterator(s.built.task, seed=s.config.seed, split="train")


def _sigterm_after(monkeypatch, iteration):
    """Makes `iteration_lib.rl_iteration` "preempt" the run (SIGTERM) once `iteration` (0-based) finishes."""
    original = iteration_lib.rl_iteration

    def iteration_then_sigterm(ctx, state, it):
        out = original(ctx, state, it)
        if it == iteration:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(iteration_lib, "rl_iteration", iteration_then_sigterm)


@pytest.mark.slow
def test_tiny_end_to_end_compiles_once_checkpoints_and_resumes_bitwise(tmp_path, compile_counter, monkeypatch):
    c = tiny("grpo")  # KL to the reference: exercises the ref model path too
    jax.clear_caches()  # as in a fresh process: earlier tests compiled the same functions
    built = build(c)
    run_lib.train_and_evaluate(built, tmp_path / "full", progress=False)

    with monkeypatch.context() as m, pytest.raises(run_lib.StoppedEarly):
        _sigterm_after(m, 0)  # "interrupted" after iteration 1
        run_lib.train_and_evaluate(built, tmp_path / "resumed", progress=False)
    compile_counter.reset()
    run_lib.train_and_evaluate(built, tmp_path / "resumed", progress=False)  # same process: resumes, compiles nothing
    assert compile_counter.count == 0
    assert run_lib.train_and_evaluate(built, tmp_path / "resumed", progress=False) == {}  # nothing left to do

    for a, b in zip(_final_params(tmp_path / "full", c), _final_params(tmp_path / "resumed", c)):
        np.testing.assert_array_equal(a, b)  # bitwise

    lines = _metrics(tmp_path / "full")
    last = {r["step"]: r for r in lines}
    assert sorted(last) == [0, 1, 2, 3]
    for r in lines[1:]:
        for k in ("loss", "reward_mean", "clip_frac", "approx_kl", "kl_ref", "drift_slot_change_rate"):
            assert np.isfinite(r[k]), (k, r[k])
    assert lines[1]["xla_compiles"] > 0  # the first iteration compiles ...
    assert [r["xla_compiles"] for r in lines[2:]] == [0.0, 0.0]  # ... and nothing compiles after it
    resumed = {r["step"]: r for r in _metrics(tmp_path / "resumed")}
    for s in (1, 2, 3):
        assert resumed[s]["loss"] == last[s]["loss"] and resumed[s]["reward_mean"] == last[s]["reward_mean"]
    assert any((tmp_path / "full" / "checkpoints").iterdir())
    assert list((tmp_path / "full").glob("*.png")) or list((tmp_path / "full").glob("plots/*.png"))
    # routing diagnostics, every iteration: the split of the loss by flipped routing, the router's
    # margin / entropy / load; the per-expert loads of each layer in routing.jsonl (resumed: no duplicates)
    L, E = c.model.num_layers - len(c.model.dense_layers), c.model.num_experts
    for r in lines[1:]:
        assert 0 <= r["flipped_frac"] <= 1 and 0 <= r["drift_router_margin"] <= 1
        assert 0 < r["drift_router_entropy"] <= np.log(E) + 1e-6
        assert sum(r[f"drift_margin_bucket_frac_bucket{i}"] for i in range(5)) == pytest.approx(1.0)
        assert all(1 <= r[f"drift_load_max_layer{i}"] <= E for i in range(L))
    for run in ("full", "resumed"):
        rows = [json.loads(x) for x in (tmp_path / run / "routing.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2, 3]
        assert np.asarray(rows[0]["load_new"]).shape == (L, E)
        np.testing.assert_allclose(np.sum(rows[0]["load_old"], axis=-1), 1.0, rtol=1e-6)
    # held-out completions at each evaluation (steps 0, 2 and the last), the same prompts every time, each
    # with the reward its completion earns; the resumed run logs the same ones once
    samples = {
        run: [json.loads(x) for x in (tmp_path / run / "samples.jsonl").read_text().splitlines()]
        for run in ("full", "resumed")
    }
    full = samples["full"]
    steps = sorted({x["step"] for x in full})
    assert steps == [0, 2, 3] and len(full) == 3 * evaluate_lib.SAMPLES
    assert len({x["prompt"] for x in full}) == evaluate_lib.SAMPLES
    task = ArithmeticTask(**{k: v for k, v in config_lib.task_settings(c).items() if k != "name"})
    for x in full:
        answer = expressions.evaluate(expressions.parse(x["prompt"].removeprefix("What is ").removesuffix("?\n")))
        assert x["reward"] == task.reward(x["completion"], Example(prompt=x["prompt"], answer=str(answer)))
    strip = lambda rows: [{k: v for k, v in x.items() if k != "time"} for x in rows]
    assert strip(samples["resumed"]) == strip(full)


@pytest.mark.slow
def test_one_update_per_batch_shares_the_old_forward_and_subsamples_drift(tmp_path):
    """One update per batch: π_old comes from the update's own forward (no scoring pass, so
    logprob_seconds is ~0), and its first iteration matches the run that takes π_old from the sampler
    (the same model: log-probs equal to float rounding). Drift on every 2nd sequence is finite."""
    rows = {}
    for source in ("trainer", "sampler"):
        c = tiny("gspo")
        c.train.update(minibatches=1, num_iterations=1, old_logp_source=source, drift_subsample=2)
        run_lib.train_and_evaluate(build(c), tmp_path / source, progress=False)
        rows[source] = _metrics(tmp_path / source)[1]
    shared, sampler = rows["trainer"], rows["sampler"]
    assert shared["reward_mean"] == sampler["reward_mean"]  # the same rollout
    assert shared["old_logp_max_diff"] < 1e-4 and shared["clip_frac"] == 0.0
    for row in (shared, sampler):  # the sampler and the trainer are one model at one precision
        assert row["mismatch_kl_k3"] < 1e-8 and row["mismatch_ratio_above_2"] == row["mismatch_ratio_below_half"] == 0
        assert row["mismatch_logp_abs_mean"] <= row["old_logp_max_diff"] < 1e-4
        assert row["mismatch_router_flip_rate"] <= row["mismatch_token_any_flip"] <= 0.01
    for k in ("loss", "grad_norm"):
        np.testing.assert_allclose(shared[k], sampler[k], rtol=1e-4, atol=1e-7, err_msg=k)
    for k in ("drift_slot_change_rate", "drift_router_flip_rate", "drift_jaccard", "drift_logratio_routing_share"):
        assert 0.0 <= shared[k] <= 1.0, (k, shared[k])


@pytest.mark.slow
def test_cli_keeps_compiled_programs_in_the_compilation_cache(tmp_path):
    cache = tmp_path / "xla"
    small = ("--config.model.num_layers=2", "--config.model.dense_layers=()", "--config.model.num_experts=4")
    args = ("--config", "configs/gspo.py:tiny", "--config.train.num_iterations=1", *small, "--noprogress")
    r = run_cli(*args, "--workdir", str(tmp_path / "a"), f"--compilation_cache={cache}")
    assert r.returncode == 0, r.stderr[-2000:]
    entries = set(cache.iterdir())
    assert len(entries) > 5  # the train step, sampler, drift ... and the eager ops they run
    # No flag: JAX's own variable names the default.
    r = run_cli(*args, "--workdir", str(tmp_path / "b"), env={"JAX_COMPILATION_CACHE_DIR": str(cache)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert set(cache.iterdir()) == entries  # the same programs: every one was loaded, none compiled anew


def run_cli(*args, cwd=ROOT, env=None):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
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
    r = train_cli("--config", "configs/gspo.py:tiny", "--workdir", str(work), override)  # in this process
    assert r.returncode == 2, r.stderr
    err = [x for x in r.stderr.strip().splitlines() if x.strip()]
    assert len(err) == 1 and key in err[0], r.stderr
    assert [p.name for p in work.iterdir()] == ["keep.txt"] and (work / "keep.txt").read_text() == "precious"


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "configs").glob("*.py")))
@pytest.mark.parametrize("size", ["tiny", "default", "qwen3_30b_a3b"])
def test_every_config_builds(name, size):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "configs" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    built = build(mod.get_config(size))
    ratios = {
        "gspo": "sequence",
        "gspo_token": "sequence_token",
        "gmpo": "geometric",
        "gspo_sum": "sequence_sum",
        "vespo": "sequence_sum_token",
    }
    assert built.loss.ratio == ratios.get(name, "token")


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_stops_at_the_iteration_boundary(tmp_path, monkeypatch):
    _sigterm_after(monkeypatch, 0)  # "preempted" while iteration 1 finishes
    c = tiny("dapo")
    c.train.checkpoint_every = 100  # only the preemption save can write step 1
    with pytest.raises(run_lib.StoppedEarly, match="SIGTERM after iteration 0"):
        run_lib.train_and_evaluate(build(c), tmp_path, progress=False)
    assert Checkpointer(tmp_path / "checkpoints").all_steps() == [1]
    assert [r["step"] for r in _metrics(tmp_path)] == [0, 1]


@pytest.mark.slow
def test_a_sigterm_during_the_last_iteration_lets_the_run_finish(tmp_path, monkeypatch):
    """Nothing is left to resume: the run ends as finished runs do, with its final checkpoint and plots."""
    c = tiny("dapo")
    c.train.update(num_iterations=2, checkpoint_every=100)
    _sigterm_after(monkeypatch, 1)
    run_lib.train_and_evaluate(build(c), tmp_path, progress=False)  # no StoppedEarly
    assert Checkpointer(tmp_path / "checkpoints").all_steps() == [2]
    assert list((tmp_path / "plots").glob("*.png"))


def test_training_starts_from_a_hugging_face_checkpoint(tmp_path):
    from gspo_jax import hf
    from gspo_jax.rollout import Rollout
    from gspo_jax.sampler import Sampler

    ckpt = ROOT / "tests" / "fixtures" / "qwen3_moe_tiny"
    c = tiny("gspo")
    c.hf_checkpoint = str(ckpt)
    c.warm_start.steps = 0
    s = Setup(c)
    cfg, _, state = hf.load_hf_checkpoint(ckpt)
    assert s.built.model.num_experts == cfg.num_experts and s.built.model.embed_dim == cfg.embed_dim
    chex.assert_trees_all_equal(s.params, state)
    B = s.built.rollout.num_groups * s.built.rollout.group_size
    sampler = Sampler(s.graphdef, s.built.model, B, c.prompt_len, c.max_new_tokens, mesh=s.mesh, state=s.params)
    rollout = Rollout(sampler, s.built.task, load_tokenizer(), s.built.rollout)
    new, metrics = iteration_lib.rl_iteration(s.context(rollout, _prompts(s)), s.state(), 0)
    assert np.isfinite(metrics["loss"]) and int(new.step) == c.train.minibatches
    bad = tiny("gspo")
    bad.hf_checkpoint = str(tmp_path / "missing")
    with pytest.raises(ValueError, match="hf_checkpoint"):
        build(bad)

"""PPO's critic: value alignment, initialisation from the policy, the clipped value loss by hand, GAE on
a batch, the critic's update inside the train step (exact micro-batching, sharded = single device, the
policy's update untouched), config errors, and a tiny PPO run that resumes bitwise, critic included."""

import dataclasses
import json
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_train import Setup, minibatch, small, tiny, values

from gspo_jax import critic as critic_lib
from gspo_jax import run as run_lib
from gspo_jax import train
from gspo_jax.built import build
from gspo_jax.checkpoint import Checkpointer
from gspo_jax.config import base_config
from gspo_jax.validation import ConfigError


def ppo_setup(**mesh) -> Setup:
    return Setup(tiny("ppo", **mesh))


@pytest.fixture(scope="module")
def ppo() -> Setup:
    """One compiled tiny PPO run for the tests that only read it (`state()` is fresh each call)."""
    return ppo_setup()


def with_critic_fields(s: Setup, batch: train.TrainBatch, seed=0) -> train.TrainBatch:
    """The minibatch with per-token advantages, rollout values and returns, as `with_advantages` makes them."""
    rng = np.random.default_rng(seed)
    m = np.asarray(batch.loss_mask)
    per_token = lambda scale: jnp.asarray(rng.normal(0, scale, m.shape) * m, jnp.float32)
    return batch.replace(advantages=per_token(1.0), values=per_token(0.1), returns=per_token(0.5))


def test_values_are_the_head_on_the_previous_positions_hidden_state(ppo):
    s = ppo
    state = s.state()
    params = state.critic.params
    params["value_head"].set_value(jnp.linspace(-1, 1, s.built.critic.model.embed_dim))
    params["value_bias"].set_value(jnp.float32(0.25))
    batch = minibatch(s)
    graphdef = s.programs.step_config.critic.graphdef
    v_BT = critic_lib.values(graphdef, params, batch.tokens, batch.positions)
    critic = nnx.merge(graphdef, params)
    x_BTD, _ = critic.trunk.hidden(batch.tokens, batch.positions)
    expected = x_BTD @ critic.value_head[...] + 0.25
    np.testing.assert_array_equal(v_BT[:, 0], 0.0)
    np.testing.assert_allclose(v_BT[:, 1:], expected[:, :-1], rtol=1e-5, atol=1e-6)


def test_the_critic_starts_as_a_copy_of_the_policys_trunk_with_a_zero_head(ppo):
    s = ppo
    state = s.state()
    policy = dict(nnx.to_flat_state(state.params))
    critic = dict(nnx.to_flat_state(state.critic.params))
    trunk = {k[1:]: v for k, v in critic.items() if k[0] == "trunk"}
    assert set(trunk) == {k for k in policy if k[0] != "lm_head"}
    for k, v in trunk.items():
        np.testing.assert_array_equal(v.get_value(), policy[k].get_value(), err_msg=str(k))
    assert not np.any(critic[("value_head",)].get_value()) and float(critic[("value_bias",)].get_value()) == 0.0
    # its own parameters: training the policy leaves the critic's trunk as it was, and vice versa
    batch = jax.device_put(with_critic_fields(s, minibatch(s)), s.programs.batch_shardings)
    new = state
    for _ in range(2):  # the warmup's first learning rate is 0
        new, _, _ = s.programs.train_step(new, batch)
    moved = lambda a, b: any(
        np.any(np.asarray(x) != np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )
    assert moved(new.params, s.state().params) and moved(new.critic.params, s.state().critic.params)
    np.testing.assert_array_equal(  # the policy's update did not write into the critic's copy
        np.asarray(s.state().critic.params["trunk"]["embed_tokens"].get_value()),
        np.asarray(s.params["embed_tokens"].get_value()),
    )


def test_a_separate_critic_has_its_own_architecture_and_random_trunk():
    c = tiny("ppo")
    c.critic.update(trunk="separate")
    c.critic.model.update(num_layers=2, embed_dim=32, head_dim=8, mlp_dim=64, moe_mlp_dim=16)
    s = Setup(c)
    state = s.state()
    assert state.critic.params["trunk"]["embed_tokens"].get_value().shape == (c.model.vocab_size, 32)
    out, metrics, _ = s.programs.train_step(
        state, jax.device_put(with_critic_fields(s, minibatch(s)), s.programs.batch_shardings)
    )
    assert np.isfinite(values(metrics)["value_loss"]) and int(out.critic.step) == 1


def test_clipped_value_loss_by_hand():
    v = jnp.array([[0.0, 1.0, 0.5, 0.2, 9.0]])
    old = jnp.array([[0.0, 0.5, 0.5, 0.0, 9.0]])
    g = jnp.array([[0.0, 0.0, 1.0, 1.0, 0.0]])
    mask = jnp.array([[0.0, 1.0, 1.0, 1.0, 0.0]])
    loss, m = critic_lib.value_loss(v, old, g, mask, 0.2, jnp.float32(3.0))
    # token 1: v − old = 0.5 clips to 0.7: (1 − 0)² = 1 vs (0.7 − 0)² = 0.49 → 1, not clipped
    # token 2: v = old: 0.25 either way, not clipped
    # token 3: v − old = 0.2 stays 0.2 → (0.2 − 1)² = 0.64 either way, not clipped
    np.testing.assert_allclose(loss, 0.5 * (1.0 + 0.25 + 0.64) / 3, rtol=1e-6)
    assert float(m["value_clip_frac"].compute()) == 0.0
    # v moved past the clip away from the target: the clipped error is larger and wins
    v2 = jnp.array([[0.0, -1.0, 0.5, 0.2, 9.0]])
    loss2, m2 = critic_lib.value_loss(v2, old, g, mask, 0.2, jnp.float32(3.0))
    # token 1: v − old = −1.5 clips to −0.2 → 0.3² = 0.09 vs (−1)² = 1 → max is 1, unclipped wins
    np.testing.assert_allclose(loss2, 0.5 * (1.0 + 0.25 + 0.64) / 3, rtol=1e-6)
    # token 1 moves onto its target but −0.5 clips to −0.2: (0.3 − 0)² = 0.09 wins over 0;
    # token 3 jumps onto its target: +1 clips to +0.2: (0.2 − 1)² = 0.64 wins over 0
    v3 = jnp.array([[0.0, 0.0, 0.5, 1.0, 9.0]])
    loss3, m3 = critic_lib.value_loss(v3, old, g, mask, 0.2, jnp.float32(3.0))
    np.testing.assert_allclose(loss3, 0.5 * (0.09 + 0.25 + 0.64) / 3, rtol=1e-6)
    np.testing.assert_allclose(m3["value_clip_frac"].compute(), 2 / 3, rtol=1e-6)
    plain, _ = critic_lib.value_loss(v3, old, g, mask, 0.0, jnp.float32(3.0))  # no clip: ½ MSE
    np.testing.assert_allclose(plain, 0.5 * (0.0 + 0.25 + 0.0) / 3, rtol=1e-6)
    # masked positions (the 9s) contribute nothing; the loss is the metric's mean over the same tokens
    np.testing.assert_allclose(float(m3["value_loss"].compute()), float(loss3), rtol=1e-6)


@pytest.mark.parametrize("jit", [False, True])
def test_estimate_with_a_fresh_critic_gives_each_token_its_reward(jit, ppo):
    """A zero head values everything 0, so with γ = 1 every δ is the token's reward and a loss token's GAE
    advantage is λ^(loss tokens after it) × its sequence's reward; returns equal advantages; whitening
    then standardises them over the tokens."""
    s = ppo
    state, batch = s.state(), minibatch(s)
    rewards = jnp.arange(batch.tokens.shape[0], dtype=jnp.float32) % 3
    cfg = s.built.critic
    graphdef = s.programs.step_config.critic.graphdef
    fn = critic_lib.estimate
    if jit:
        fn = jax.jit(fn, static_argnums=(0, 1))
    args = (batch.tokens, batch.positions, batch.loss_mask, rewards, batch.old_logp, batch.ref_logp)
    adv, v, ret, metrics = fn(cfg, graphdef, state.critic.params, *args)
    m = np.asarray(batch.loss_mask) > 0
    after = np.cumsum(m[:, ::-1], axis=1)[:, ::-1] - 1  # loss tokens after each one
    raw = np.where(m, np.asarray(rewards)[:, None] * cfg.lam ** np.maximum(after, 0), 0.0)
    np.testing.assert_array_equal(np.asarray(v), 0.0)
    np.testing.assert_allclose(ret, raw, atol=1e-6)
    expected = (raw - raw[m].mean()) / np.sqrt(raw[m].var(ddof=1) + 1e-8)
    np.testing.assert_allclose(np.asarray(adv)[m], expected[m], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(adv)[~m], 0.0)
    np.testing.assert_allclose(metrics["advantage_mean"], raw[m].mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["explained_variance"], 1 - raw[m].var() / raw[m].var(), atol=1e-6)
    np.testing.assert_allclose(metrics["advantage_max"], raw[m].max(), rtol=1e-6)
    assert float(metrics["advantage_min"]) == 0.0


def test_kl_in_the_reward_needs_the_reference_and_a_scoring_pass(ppo):
    c = tiny("ppo")
    c.train.minibatches = 1
    assert build(c).plan.on_policy and not build(c).plan.reference
    c.critic.kl_reward_coef = 0.05
    assert not build(c).plan.on_policy and build(c).plan.reference
    s = ppo
    batch = minibatch(s)
    cfg = dataclasses.replace(s.built.critic, kl_reward_coef=0.5, whiten_advantages=False)
    graphdef = s.programs.step_config.critic.graphdef
    zero = jnp.zeros(batch.tokens.shape[0])
    args = (batch.tokens, batch.positions, batch.loss_mask, zero, batch.old_logp, batch.ref_logp)
    adv, _, _, _ = critic_lib.estimate(cfg, graphdef, s.state().critic.params, *args)
    # ref_logp = logp − 0.01 and old ≈ logp: each token's reward is −0.5·(old − ref); γ = 1, V = 0, so
    # λ's weights sum the rewards to go: A_t = Σ_{t' ≥ t} λ^(t'−t)·r_t' with λ = 0.95
    m = np.asarray(batch.loss_mask) > 0
    r = np.where(m, -0.5 * (np.asarray(batch.old_logp) - np.asarray(batch.ref_logp)), 0.0)
    row = int(np.argmax(m.sum(1)))
    idx = np.flatnonzero(m[row])
    want = [sum(0.95**j * r[row, t] for j, t in enumerate(idx[i:])) for i in range(len(idx))]
    np.testing.assert_allclose(np.asarray(adv)[row, idx], want, rtol=1e-4, atol=1e-7)


def test_microbatches_give_the_same_critic_update():
    def setup(microbatches):
        c = small("ppo")
        c.model.update(lb_loss_coef=0.0, z_loss_coef=0.0)  # batch statistics: not additive over micro-batches
        c.train.microbatches = microbatches
        return Setup(c)

    one, two = setup(1), setup(2)
    batch = with_critic_fields(one, minibatch(one, seed=1))
    s1, m1, _ = one.step(batch)
    s2, m2, _ = two.step(batch)
    m1, m2 = values(m1), values(m2)
    for k in ("value_loss", "value_clip_frac", "critic_grad_norm", "loss", "grad_norm"):
        np.testing.assert_allclose(m1[k], m2[k], rtol=1e-5, atol=1e-8, err_msg=k)
    chex.assert_trees_all_close(s1.critic.params, s2.critic.params, rtol=1e-5, atol=1e-6)
    assert m1["value_loss"] > 0 and m1["critic_grad_norm"] > 0


def test_the_critic_leaves_the_policy_update_as_it_was(ppo):
    """The same batch with per-token advantages through GRPO-shaped PPO with and without a critic
    section: the policy's update is identical; only the critic's state and metrics are added."""
    s = ppo
    batch = with_critic_fields(s, minibatch(s, seed=2))
    with_critic, m1, _ = s.step(batch)
    state = s.state()
    static = s.programs.step_config
    no_critic = dataclasses.replace(static, critic=None)
    schedules = s.programs.train_step.args[0]._replace(critic=None)
    fn = jax.jit(train.train_step, static_argnums=0)
    without, m2, _ = fn(no_critic, schedules, state.replace(critic=None), batch.replace(values=None, returns=None))
    chex.assert_trees_all_equal(with_critic.params, without.params)
    assert "value_loss" in m1 and "value_loss" not in m2
    assert values(m1)["loss"] == values(m2)["loss"]


def test_sharded_critic_step_equals_single_device(ppo):
    single, sharded = ppo, ppo_setup(data=2, expert=2, tensor=2)
    batch = with_critic_fields(single, minibatch(single, seed=3))
    s1, m1, _ = single.step(batch)
    s2, m2, _ = sharded.step(batch)
    m1, m2 = values(m1), values(m2)
    for k in ("value_loss", "critic_grad_norm", "loss", "grad_norm"):
        np.testing.assert_allclose(m1[k], m2[k], rtol=1e-5, atol=1e-7, err_msg=k)
    chex.assert_trees_all_close(s1.critic.params, s2.critic.params, rtol=1e-5, atol=1e-6)
    leaf = s2.critic.params["trunk"]["embed_tokens"].get_value()
    assert len(leaf.sharding.device_set) > 1


@pytest.mark.parametrize(
    "key, value, words",
    [
        ("critic.trunk", "shared", "trunk"),
        ("critic.gamma", 1.5, "gamma"),
        ("critic.lam", -0.1, "lam"),
        ("critic.value_clip", -1.0, "value_clip"),
        ("critic.learning_rate", 0.0, "learning_rate"),
        ("critic.model.vocab_size", 256, "vocab_size"),
    ],
)
def test_bad_critic_values_are_refused_at_build_naming_the_key(key, value, words):
    c = base_config("ppo", "tiny")
    c.critic.trunk = "separate"
    if key == "critic.trunk":
        c.critic.trunk = value
    else:
        section, *rest = key.split(".")[1:]
        target = c.critic
        for part in [section, *rest][:-1]:
            target = target[part]
        target[[section, *rest][-1]] = value
    with pytest.raises(ConfigError, match=words):
        build(c)


def test_a_separate_critic_must_fit_the_mesh_and_the_batch():
    c = base_config("ppo", "tiny")
    c.critic.trunk = "separate"
    c.critic.model.num_experts, c.mesh.expert = 6, 4  # the policy's 8 experts split over 4; the critic's 6 do not
    with pytest.raises(ConfigError, match=r"mesh.expert.*critic.model.num_experts=6"):
        build(c, device_count=4)
    c = base_config("ppo", "tiny")
    c.critic.trunk = "separate"
    c.critic.model.batch_chunks = 3
    with pytest.raises(ConfigError, match=r"critic.model.batch_chunks=3"):
        build(c)


def test_only_a_critic_algorithm_has_a_critic_section():
    assert "critic" in base_config("ppo", "tiny") and "critic" not in base_config("grpo", "tiny")
    c = base_config("ppo", "tiny")
    del c["critic"]
    with pytest.raises(ConfigError, match="critic"):
        build(c)


@pytest.mark.slow
def test_tiny_ppo_run_logs_the_critic_and_resumes_bitwise_with_it(tmp_path, monkeypatch):
    from test_train import _metrics, _sigterm_after

    c = tiny("ppo")
    run_lib.train_and_evaluate(build(c), tmp_path / "full", progress=False)
    with monkeypatch.context() as m, pytest.raises(run_lib.StoppedEarly):
        _sigterm_after(m, 0)
        run_lib.train_and_evaluate(build(c), tmp_path / "resumed", progress=False)
    run_lib.train_and_evaluate(build(c), tmp_path / "resumed", progress=False)

    def final(workdir):
        s = Setup(c)
        with Checkpointer(Path(workdir) / "checkpoints") as ckpt:
            step, state, _ = ckpt.restore_latest(s.state())
        return step, state

    (step_a, a), (step_b, b) = final(tmp_path / "full"), final(tmp_path / "resumed")
    assert step_a == step_b == 3 and int(a.critic.step) == 3 * c.train.minibatches
    chex.assert_trees_all_equal(a, b)  # bitwise, the critic and its optimizer state included
    rows = _metrics(tmp_path / "full")
    for r in rows[1:]:
        for k in ("value_loss", "value_clip_frac", "critic_grad_norm", "advantage_std", "value_mean", "return_mean"):
            assert np.isfinite(r[k]), (k, r[k])
        assert r["xla_compiles"] == 0 or r["step"] == 1
    assert rows[-1]["xla_compiles"] == 0.0
    resumed = {r["step"]: r for r in _metrics(tmp_path / "resumed")}
    for r in rows[1:]:
        assert resumed[r["step"]]["value_loss"] == r["value_loss"]
    json.dumps(rows)  # every metric is JSON

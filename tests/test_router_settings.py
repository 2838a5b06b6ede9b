"""The router settings RL stacks use: a frozen router (`train.freeze_router`: no gradient step, no
weight decay, no share of the clipping norm, its weights bitwise unchanged by real updates, a state
that shards and checkpoints) and the auxiliary losses off (`model.lb_loss_coef = z_loss_coef = 0`:
still computed and logged, adding nothing to the objective)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_train import Setup, minibatch, small, values

from gspo_jax import optimizer as optimizer_lib
from gspo_jax import programs as programs_lib
from gspo_jax.built import build
from gspo_jax.checkpoint import Checkpointer
from gspo_jax.config import base_config
from gspo_jax.validation import ConfigError


def _bits(x) -> np.ndarray:
    """The bit pattern of a float array (−0.0 and 0.0 differ)."""
    x = np.asarray(x)
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def _steps(cfg: optimizer_lib.OptimizerConfig, params, grads, n=3):
    tx, schedule = optimizer_lib.make_optimizer(cfg.rule), cfg.schedule(10)
    state = tx.init(params)
    for _ in range(n):
        params, state, ok = optimizer_lib.apply_if_finite(tx, schedule, grads, optax.tree.norm(grads), state, params)
        assert ok
    return params, state


def test_a_frozen_router_gets_no_step_no_decay_and_no_share_of_the_clipping():
    router = jnp.array([[-0.0, 1.0], [2.0, -3.0]])  # −0.0: x + 0.0 would flip its sign bit
    params = {"layers": {"mlp": {"router": router, "up_proj": jnp.ones((2, 3))}}}
    # gradients small enough that AdamW's eps shows a clipped step: a router gradient in the clipping
    # norm would shrink the rest's step about 1,000-fold
    grads = {"layers": {"mlp": {"router": jnp.full((2, 2), 1e3), "up_proj": jnp.full((2, 3), 1e-6)}}}
    opt = dict(learning_rate=0.1, warmup_steps=0, weight_decay=0.1, max_grad_norm=1.0)
    frozen, state = _steps(optimizer_lib.OptimizerConfig(**opt, freeze_router=True), params, grads)
    np.testing.assert_array_equal(_bits(frozen["layers"]["mlp"]["router"]), _bits(router))
    moments = [x for x in jax.tree.leaves(state) if x.shape == router.shape]
    assert len(moments) == 2 and all(not np.any(np.asarray(m)) for m in moments)  # its moments stay 0
    # the rest trains as if the router were not there: its gradient is out of the clipping norm
    mlp, mlp_grads = params["layers"]["mlp"], grads["layers"]["mlp"]
    alone, _ = _steps(
        optimizer_lib.OptimizerConfig(**opt), {"up_proj": mlp["up_proj"]}, {"up_proj": mlp_grads["up_proj"]}
    )
    np.testing.assert_allclose(frozen["layers"]["mlp"]["up_proj"], alone["up_proj"], rtol=1e-6)
    moved, _ = _steps(optimizer_lib.OptimizerConfig(**opt), params, grads)  # unfrozen: the router moves
    assert not np.array_equal(moved["layers"]["mlp"]["router"], router)
    step = lambda p: np.asarray(p["up_proj"] if "up_proj" in p else p["layers"]["mlp"]["up_proj"]) - 1.0
    assert np.all(np.abs(step(moved)) < 0.2 * np.abs(step(alone)))  # the router's gradient in the norm (decay left)


def test_a_frozen_router_is_bitwise_unchanged_by_train_steps_while_the_rest_trains(tmp_path):
    """Three real updates (weight decay on, auxiliary losses off) on an FSDP mesh: every router weight
    keeps its bits, every other parameter moves; the optimizer state shards like the parameters and
    checkpoints; lb / z losses are still logged but add nothing to the objective."""
    c = small("grpo")
    c.mesh.update(fsdp=2)
    c.train.update(freeze_router=True, weight_decay=0.1, learning_rate=1e-2, warmup_steps=0)
    c.model.update(lb_loss_coef=0.0, z_loss_coef=0.0)  # NeMo-RL / slime's RL setting
    s = Setup(c)
    assert s.built.optimizer.freeze_router
    state = s.state()
    is_router = lambda path, _: optimizer_lib.is_router(path)
    flags = jax.tree_util.tree_map_with_path(is_router, state.params)
    assert sum(jax.tree.leaves(flags)) == 1  # the scanned MoE stack's router
    before = [np.asarray(x) for x in jax.tree.leaves(state.params)]
    for seed in range(3):  # the first update has learning rate 0 (the schedule starts there)
        state, metrics, _ = s.programs.train_step(state, jax.device_put(minibatch(s, seed), s.programs.batch_shardings))
        m = values(metrics)
        assert m["skipped"] == 0 and m["lb_loss"] > 0 and m["z_loss"] > 0  # computed and logged ...
        assert m["total_loss"] == m["loss"]  # ... but no part of the objective
    for router, b, a in zip(jax.tree.leaves(flags), before, jax.tree.leaves(state.params)):
        if router:
            np.testing.assert_array_equal(_bits(a), _bits(b))
        else:
            assert not np.array_equal(np.asarray(a), b)
    shardings = {p: x.sharding for p, x in jax.tree_util.tree_flatten_with_path(state.params)[0] if is_router(p, x)}
    [(path, sharding)] = shardings.items()
    assert len(sharding.device_set) == 2  # the router is sharded over fsdp, and so are its moments
    mu = [x for p, x in jax.tree_util.tree_flatten_with_path(state.opt_state)[0] if p[-len(path) :] == path]
    assert len(mu) == 2 and all(x.sharding.is_equivalent_to(sharding, x.ndim) for x in mu)
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, state, {}, force=True)
        _, restored, _ = ckpt.restore_latest(programs_lib.abstract_train_state(s.programs, s.params))
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(_bits(a), _bits(b))


@pytest.mark.parametrize(
    "set_key, words",
    [
        (lambda c: c.model.update(dense_layers=(0, 1, 2)), "no MoE layer"),  # nothing to freeze
        (lambda c: c.train.update(freeze_router="yes"), "True or False"),
    ],
    ids=["dense-model", "not-a-bool"],
)
def test_a_freeze_that_cannot_work_is_refused_at_build_in_one_line(set_key, words):
    c = base_config("gspo", "tiny")
    with c.ignore_type():
        c.train.freeze_router = True
        set_key(c)
    with pytest.raises(ConfigError, match="train.freeze_router") as e:
        build(c)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_the_freeze_key_is_the_policys_only():
    """`train.freeze_router` exists for the RL update; the warm start and the critic keep their
    sections (and the warm start's cache key) as they were."""
    c = base_config("ppo", "tiny")
    assert c.train.freeze_router is False
    assert "freeze_router" not in c.warm_start and "freeze_router" not in c.critic
    built = build(c)
    assert not built.warm_start.optimizer.freeze_router and not built.critic_optimizer.freeze_router

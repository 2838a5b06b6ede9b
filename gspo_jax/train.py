"""The RL trainer: a typed train state and batch, a jitted and sharded `train_step`, and the loop.

One iteration (`rl_iteration`): rollout with π_old → old log-probs (the sampler's, or the trainer's
recomputation; the max difference is logged) → ref log-probs when kl_coef > 0 → with a critic (PPO),
its values and GAE advantages in place of the group ones → `epochs` ×
`minibatches` shuffled minibatches of `train_step` → routing drift of the updated policy against
π_old. `train_and_evaluate` wraps it with the warm start, evaluation, logging and checkpoints. Every
jitted function has fixed shapes and compiles once per run. Shape letters: `gspo_jax/__init__.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import signal
import time
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx, struct

from gspo_jax import compiles, hf, losses, mismatch, multihost, plots, routing
from gspo_jax import config as config_lib
from gspo_jax import critic as critic_lib
from gspo_jax import metrics as metrics_lib
from gspo_jax import model as model_lib
from gspo_jax import optimizer as optimizer_lib
from gspo_jax import sharding as sharding_lib
from gspo_jax import workdir as workdir_lib
from gspo_jax.checkpoint import Checkpointer, PreemptionGuard
from gspo_jax.compiles import CompileCounter
from gspo_jax.evaluate import evaluate
from gspo_jax.metrics import Count, Mean, Sum
from gspo_jax.progress import Progress
from gspo_jax.rollout import Rollout
from gspo_jax.sampler import Sampler
from gspo_jax.tasks import load_tokenizer, prompt_iterator
from gspo_jax.validation import ConfigError
from gspo_jax.warm_start import warm_start
from gspo_jax.writers import MetricWriter

log = logging.getLogger(__name__)
Array = jax.Array


@struct.dataclass
class TrainState:
    step: Array  # int32: optimizer updates applied (a skipped update does not count)
    params: nnx.State
    opt_state: optax.OptState
    rng: Array  # uint32 key data: portable across PRNG implementations and orbax versions
    critic: critic_lib.CriticState | None = None  # PPO's value model and its optimizer (`config.critic`)


@struct.dataclass
class TrainBatch:
    """A rollout as the trainer consumes it; every field batch-first, so `jax.tree.map(lambda x:
    x[idx], batch)` takes a minibatch."""

    tokens: Array  # int32 [B, T]
    positions: Array  # int32 [B, T]; -1 on padding
    completion_mask: Array  # bool [B, T]: generated tokens (drift is measured on them)
    loss_mask: Array  # float32 [B, T]: completion tokens that train (fill / filtered ones do not)
    old_logp: Array  # float32 [B, T]: π_old
    sampler_logp: Array  # float32 [B, T]: π_sampler, what the sampler reported (corrections weigh by old / it)
    ref_logp: Array  # float32 [B, T]: π_ref (zeros without a KL term)
    advantages: Array  # float32 [B], or [B, T] with a critic (GAE)
    topk: Array  # int32 [B, L, T, K]: π_old's routing, replayed under R2 / R3
    values: Array | None = None  # float32 [B, T]: the critic's V(s_t) at the rollout (critic only)
    returns: Array | None = None  # float32 [B, T]: GAE's returns, the value targets (critic only)


def abstract_batch(built: config_lib.Built, B: int, T: int) -> TrainBatch:
    """A TrainBatch of B sequences of T tokens as shapes and dtypes (ahead-of-time lowering)."""
    S, m = jax.ShapeDtypeStruct, built.model
    per_token = (lambda: S((B, T), jnp.float32)) if built.critic else (lambda: None)
    return TrainBatch(
        tokens=S((B, T), jnp.int32),
        positions=S((B, T), jnp.int32),
        completion_mask=S((B, T), jnp.bool_),
        loss_mask=S((B, T), jnp.float32),
        old_logp=S((B, T), jnp.float32),
        sampler_logp=S((B, T), jnp.float32),
        ref_logp=S((B, T), jnp.float32),
        advantages=S((B, T) if built.critic else (B,), jnp.float32),
        topk=S((B, m.num_moe_layers, T, max(m.top_k, 1)), jnp.int32),
        values=per_token(),
        returns=per_token(),
    )


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """The static part of `train_step`: hashable, so equal configs share one compilation."""

    graphdef: nnx.GraphDef
    loss: losses.LossConfig
    optimizer: optimizer_lib.OptimizerConfig
    total_steps: int
    temperature: float  # log-probs are scored at the sampling temperature
    replay: bool  # route with the batch's top-k (R2 / R3) instead of the live router
    microbatches: int
    routing_diagnostics: bool = False  # the flipped-vs-unflipped split of the loss's diagnostics
    # The update is the only one on its batch and starts at π_old (`shares_old_forward`): its own
    # forward gives π_old's log-probs and routing (old_logp = stop_gradient(logp), exactly ratio 1),
    # and the step returns them, so the batch needs no separate scoring forward.
    on_policy: bool = False
    critic: critic_lib.CriticStep | None = None  # PPO: the critic's update, on the same micro-batches


def shares_old_forward(
    train_cfg, loss_cfg: losses.LossConfig | None = None, critic_cfg: critic_lib.CriticConfig | None = None
) -> bool:
    """Whether π_old's log-probs can come from the update's own forward instead of a scoring pass:
    one update per batch (epochs = minibatches = 1), recomputed by the trainer, with the live routing
    (R2 replays π_old's own routing, which the forward at π_old chooses anyway; R3 replays the
    sampler's, which differs), and no masked-IS correction (its mask changes the loss denominator,
    which must be known before the first micro-batch), and no KL penalty in a critic's rewards (GAE
    needs π_old's log-probs before the update)."""
    t = train_cfg
    mis = loss_cfg is not None and loss_cfg.is_correction == "mis"
    kl_reward = critic_cfg is not None and critic_cfg.kl_reward_coef > 0
    single = t.epochs * t.minibatches == 1
    return single and t.old_logp_source == "trainer" and t.routing_replay != "R3" and not mis and not kl_reward


class Scored(NamedTuple):
    """An on-policy update's forward at π_old: the batch's π_old log-probs and routing."""

    logp: Array  # float32 [B, T]
    topk: Array  # int32 [B, L, T, K]


def train_step(
    static: StepConfig, state: TrainState, batch: TrainBatch
) -> tuple[TrainState, dict[str, Any], Scored | None]:
    """One optimizer update on one minibatch, accumulated over `microbatches` with the minibatch's
    loss denominator, so the policy loss and its gradient equal the full minibatch's (the MoE load-
    balancing and z losses are batch statistics, computed per micro-batch as everywhere). A non-finite
    loss or gradient leaves the state untouched and is counted in `skipped`. Metrics are per update
    (`metrics.per_update`). With `static.on_policy`, `batch.old_logp` and `batch.topk` are not read:
    the forward provides them, and they come back as `Scored`. With `static.critic` (PPO) the critic
    is updated too, on the same micro-batches, with its own optimizer (`critic.update`)."""
    cfg, M = static.loss, static.microbatches
    tx = optimizer_lib.make_optimizer(static.optimizer, static.total_steps)
    correct = lambda old_BT, b: mismatch.correction(
        cfg.is_correction, cfg.is_level, cfg.is_cap, old_BT, b.sampler_logp, b.loss_mask, cfg.log_ratio_clamp
    )
    # MIS drops tokens from the denominator too: it is the minibatch's, corrected (never on-policy).
    denom = losses.loss_denominator(cfg, correct(batch.old_logp, batch).mask_BT)
    micro = jax.tree.map(lambda x: model_lib.split_batch(x, M), batch)  # strided: see `split_batch`

    # π_θ's routing against π_old's, per token: on-policy they are the same policy, so nothing to split.
    split = static.routing_diagnostics and not static.on_policy and batch.topk.shape[1] > 0

    def loss_fn(params, mb: TrainBatch):
        forced = mb.topk if static.replay and not static.on_policy else None
        logp_BT, aux = model_lib.logprobs(
            static.graphdef, params, mb.tokens, mb.positions, forced, static.temperature, split and forced is not None
        )
        old_BT = jax.lax.stop_gradient(logp_BT) if static.on_policy else mb.old_logp
        ref_BT = mb.ref_logp if cfg.kl_coef > 0 else None
        c = correct(old_BT, mb)
        flipped_BT = None
        if split:  # under replay the forward used π_old's routing; the router's own choice is its top-k
            own_BLTK = aux.topk if forced is None else jax.lax.top_k(aux.router_logits, mb.topk.shape[-1])[1]
            flipped_BT = routing.flipped_tokens(mb.topk, own_BLTK)
        pl = functools.partial(
            losses.policy_loss,
            cfg,
            old_logp=old_BT,
            advantages=mb.advantages,
            mask=c.mask_BT,
            ref_logp=ref_BT,
            denominator=denom,
            is_weight=c.weight,
        )
        loss, metrics = pl(logp_BT, flipped=flipped_BT)
        if split:  # each token's |∂loss/∂logp_t|: how much of the update flipped tokens drive
            g_BT = jnp.abs(jax.grad(lambda lp: pl(lp)[0])(jax.lax.stop_gradient(logp_BT)))
            metrics["grad_share_flipped"] = Mean(jnp.sum(jnp.where(flipped_BT, g_BT, 0.0)), jnp.sum(g_BT), math.nan)
        metrics.update(c.metrics)
        total = loss + aux.aux_loss / M
        metrics.update(lb_loss=Mean(aux.lb_loss, 1), z_loss=Mean(aux.z_loss, 1), total_loss=Sum(total))
        return total, (metrics, Scored(old_BT, aux.topk))

    def accumulate(grads, mb):
        (_, (metrics, scored)), g = jax.value_and_grad(loss_fn, has_aux=True)(state.params, mb)
        return jax.tree.map(jnp.add, grads, g), (metrics, scored if static.on_policy else None)

    grads, (stacked, scored) = jax.lax.scan(accumulate, jax.tree.map(jnp.zeros_like, state.params), micro)
    if scored is not None:
        scored = jax.tree.map(model_lib.merge_batch, scored)
    metrics = metrics_lib.reduce(stacked)
    grad_norm = optax.tree.norm(grads)
    # Skip the update if anything it would write is not finite (the loss and gradient, but also an
    # overflowing optimizer moment or parameter): a run never saves a non-finite state.
    params, opt_state, ok = optimizer_lib.apply_if_finite(
        tx, grads, grad_norm, state.opt_state, state.params, jnp.isfinite(metrics["total_loss"].total)
    )
    state = state.replace(step=state.step + ok.astype(jnp.int32), params=params, opt_state=opt_state)
    metrics.update(grad_norm=Mean(grad_norm, 1), skipped=Count((~ok).astype(jnp.float32)))
    if static.critic is not None:  # its own loss, gradient, optimizer and skip; the same micro-batches
        critic_state, critic_metrics = critic_lib.update(static.critic, state.critic, micro)
        state = state.replace(critic=critic_state)
        metrics.update(critic_metrics)
    return state, metrics_lib.per_update(metrics), scored


# ---------------------------------------------------------------------------------------------- setup


class Programs(NamedTuple):
    """A run's jitted functions, with explicit shardings over its mesh."""

    train_step: Any  # (state, minibatch) -> (state, metrics, Scored | None); state donated
    take: Any  # (batch, rows) -> the batch's rows, on the mesh (minibatches, drift sub-samples)
    take_scored: Any  # (Scored, rows) -> its rows, on the mesh
    score: Any  # (params, tokens, positions) -> (logp [B, T], topk [B, L, T, K])
    drift: Any  # (params, batch) -> drift metrics (routing.measure_drift)
    estimate: Any  # (critic params, batch, rewards [B]) -> (batch with GAE advantages, metrics); None: no critic
    init_critic: Any  # (policy params) -> the critic's initial state; None: no critic
    on_policy: bool  # π_old's log-probs come from the update's forward (`shares_old_forward`)
    optimizer: optax.GradientTransformation
    state_shardings: TrainState
    batch_shardings: TrainBatch


def init_policy(config: ml_collections.ConfigDict, model_cfg: model_lib.ModelConfig, mesh):
    """(graphdef, params on the mesh): from `config.hf_checkpoint`, or a random init from `config.seed`."""
    if config.hf_checkpoint:
        _, graphdef, params = hf.load_hf_checkpoint(
            config.hf_checkpoint, dtype=model_cfg.param_dtype, dispatch=model_cfg.dispatch, mesh=mesh
        )
        return graphdef, jax.device_put(params, sharding_lib.param_shardings(mesh, params))
    shardings = sharding_lib.param_shardings(mesh, model_lib.abstract_model(model_cfg)[1])
    return model_lib.init(model_cfg, config.seed, shardings)


def compile_programs(config, built: config_lib.Built, graphdef, params, mesh) -> Programs:
    """Jits `train_step`, the scoring forward and the drift measurement for this run's shapes."""
    t = config.train
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    bs = lambda ndim: sharding_lib.batch_sharding(mesh, ndim)
    param_sh = sharding_lib.param_shardings(mesh, params)
    opt_cfg = optimizer_lib.OptimizerConfig.from_config(t, "config.train")
    total_steps = t.num_iterations * t.epochs * t.minibatches
    tx = optimizer_lib.make_optimizer(opt_cfg, total_steps)
    opt_sh = optimizer_lib.state_shardings(tx, params, param_sh, mesh)
    state_sh = TrainState(step=rep, params=param_sh, opt_state=opt_sh, rng=rep)
    # Module-level functions with their static arguments marked, not closures: equal configs (a run
    # resumed in the same process) reuse the compilation.
    on_mesh = functools.partial(sharding_lib.under_mesh, mesh=mesh)
    b2 = bs(2)
    critic_cfg = built.critic
    batch_sh = TrainBatch(
        tokens=b2,
        positions=b2,
        completion_mask=b2,
        loss_mask=b2,
        old_logp=b2,
        sampler_logp=b2,
        ref_logp=b2,
        advantages=b2 if critic_cfg else bs(1),
        topk=bs(4),
        values=b2 if critic_cfg else None,
        returns=b2 if critic_cfg else None,
    )
    critic_static = estimate = init_critic = None
    options = compiles.step_options(config.cpu_fast_compile)  # XLA:CPU's fast-compile code generation or not
    if critic_cfg:
        critic_graphdef, abstract_critic = critic_lib.abstract(critic_cfg.model)
        critic_opt = optimizer_lib.OptimizerConfig.from_config(config.critic, "config.critic")
        critic_static = critic_lib.CriticStep(critic_graphdef, critic_opt, total_steps, critic_cfg.value_clip)
        critic_sh = critic_lib.state_shardings(critic_static, abstract_critic, mesh)
        state_sh = state_sh.replace(critic=critic_sh)
        estimate = jax.jit(
            on_mesh(with_advantages),
            static_argnums=(0, 1),
            in_shardings=(critic_sh.params, batch_sh, bs(1)),
            out_shardings=(batch_sh, rep),
            compiler_options=options,
        )
        estimate = functools.partial(estimate, critic_cfg, critic_graphdef)
        init_critic = functools.partial(critic_lib.init_state, critic_cfg, critic_static, critic_sh, config.seed + 2)
    temperature = float(built.rollout.temperature) or 1.0  # greedy rollouts are scored at temperature 1
    static = StepConfig(
        graphdef=graphdef,
        loss=built.loss,
        optimizer=opt_cfg,
        total_steps=total_steps,
        temperature=temperature,
        replay=t.routing_replay != "none",
        microbatches=built.microbatches,
        routing_diagnostics=bool(t.routing_diagnostics),
        on_policy=shares_old_forward(t, built.loss, critic_cfg),
        critic=critic_static,
    )
    step = jax.jit(
        on_mesh(train_step),
        static_argnums=0,
        in_shardings=(state_sh, batch_sh),
        out_shardings=(state_sh, rep, Scored(b2, bs(4)) if static.on_policy else None),
        donate_argnums=1,
        compiler_options=options,
    )
    score = jax.jit(
        on_mesh(model_lib.score),
        static_argnums=(0, 1),
        in_shardings=(param_sh, b2, b2),
        out_shardings=(b2, bs(4)),
        compiler_options=options,
    )
    drift = jax.jit(
        on_mesh(routing.measure_drift),
        static_argnums=(0, 1, 2),
        in_shardings=(param_sh, batch_sh),
        out_shardings=rep,
        compiler_options=options,
    )
    return Programs(
        train_step=functools.partial(step, static),
        take=jax.jit(take_rows, in_shardings=(batch_sh, rep), out_shardings=batch_sh),
        take_scored=jax.jit(take_rows, in_shardings=(Scored(b2, bs(4)), rep), out_shardings=Scored(b2, bs(4))),
        score=functools.partial(score, graphdef, temperature),
        drift=functools.partial(drift, graphdef, temperature, bool(t.routing_diagnostics)),
        estimate=estimate,
        init_critic=init_critic,
        on_policy=static.on_policy,
        optimizer=tx,
        state_shardings=state_sh,
        batch_shardings=batch_sh,
    )


def compile_in_background(programs: Programs, config, built: config_lib.Built, params) -> Programs:
    """`programs` with the train step and the drift measurement compiled now, on a background thread, for
    the shapes `rl_iteration` calls them with, while the run initialises, evaluates and samples its first
    rollout (on 2 CPU cores the `iteration` shape's first row comes ~1 s sooner)."""
    t = config.train
    B, T = built.rollout.num_groups * built.rollout.group_size, config.prompt_len + config.max_new_tokens
    placed = functools.partial(jax.tree.map, lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh))
    batch = lambda rows: placed(abstract_batch(built, rows, T), programs.batch_shardings)
    step = compiles.Background(programs.train_step, abstract_train_state(programs, params), batch(B // t.minibatches))
    if not t.drift_metrics:
        return programs._replace(train_step=step)
    abstract_params = placed(params, programs.state_shardings.params)
    drift = compiles.Background(programs.drift, abstract_params, batch(B // t.drift_subsample))
    return programs._replace(train_step=step, drift=drift)


def with_advantages(
    cfg: critic_lib.CriticConfig, graphdef, critic_params, batch: TrainBatch, rewards_B
) -> tuple[TrainBatch, dict[str, Array]]:
    """The batch with PPO's GAE advantages, the critic's values and the returns (`critic.estimate`)."""
    args = (batch.tokens, batch.positions, batch.loss_mask, rewards_B, batch.old_logp, batch.ref_logp)
    adv_BT, v_BT, ret_BT, metrics = critic_lib.estimate(cfg, graphdef, critic_params, *args)
    return batch.replace(advantages=adv_BT, values=v_BT, returns=ret_BT), metrics


def take_rows(tree, rows):
    """Rows `rows` of every batch-first array of `tree` (jitted with the batch's shardings: the
    gather stays on the mesh instead of passing through one device or the host)."""
    return jax.tree.map(lambda x: x[rows], tree)


def init_train_state(programs: Programs, params, seed: int) -> TrainState:
    """A fresh train state on the mesh. It owns a copy of `params`: `train_step` donates its state,
    and the caller's params may still be needed (the reference policy)."""
    sh = programs.state_shardings
    # The critic's trunk copies the (warm-started) policy's, before the policy trains.
    critic = None if programs.init_critic is None else programs.init_critic(params)
    params = jax.tree.map(jnp.copy, params)
    opt_state = optimizer_lib.init_state(programs.optimizer, params, sh.params, sh.opt_state)
    rng = jax.random.key_data(jax.random.key(seed))
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state, rng=rng, critic=critic)
    return jax.device_put(state, sh)


# ---------------------------------------------------------------------------------------------- the loop


def rl_iteration(
    programs: Programs, rollout: Rollout, config, state: TrainState, prompts, iteration: int, ref_params=None
) -> tuple[TrainState, dict[str, float]]:
    """One RL iteration (see the module docstring); returns the new state and the iteration's metrics."""
    t = config.train
    key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), iteration)
    t0 = time.perf_counter()
    batch, metrics = rollout(state.params, prompts, jax.random.fold_in(key, 0))
    t_rollout = time.perf_counter() - t0
    full = prepare_batch(programs, state.params, batch, t.old_logp_source, t.routing_replay, ref_params, metrics)
    if programs.estimate is not None:  # PPO: the critic's values and GAE replace the group advantages
        b2 = programs.batch_shardings.tokens
        rewards = jax.device_put(
            batch.rewards, jax.sharding.NamedSharding(b2.mesh, jax.sharding.PartitionSpec(b2.spec[0]))
        )
        full, estimated = programs.estimate(state.critic.params, full, rewards)  # host rewards, the same everywhere
        metrics.update({k: float(v) for k, v in jax.device_get(estimated).items()})
    t_logprobs = time.perf_counter() - t0 - t_rollout  # synchronised: metrics are on the host

    B, num_mb = batch.tokens.shape[0], t.minibatches
    mb_size = B // num_mb
    step_metrics = []  # left on the device until every update is dispatched: no host sync in the loop
    for epoch in range(t.epochs):
        perm = np.asarray(jax.random.permutation(jax.random.fold_in(key, 1 + epoch), B))
        for m in range(num_mb):
            idx = perm[m * mb_size : (m + 1) * mb_size]
            state, step, scored = programs.train_step(state, programs.take(full, idx))
            step_metrics.append(step)
            if scored is not None:  # the only update: its forward scored π_old, in the minibatch's order
                scored = programs.take_scored(scored, np.argsort(idx))
                full = full.replace(old_logp=scored.logp, topk=scored.topk)
    if programs.on_policy:  # the update's forward was the trainer's recomputation of π_old
        metrics.update(sampler_mismatch(batch, full.old_logp, full.topk))
    host = [jax.tree.map(float, s) for s in jax.device_get(step_metrics)]  # float64 from here
    metrics.update(metrics_lib.compute(functools.reduce(metrics_lib.merge, host)))
    t_updates = time.perf_counter() - t0 - t_rollout - t_logprobs  # synchronised: metrics are on the host
    if metrics["skipped"]:
        log.warning(
            "iteration %d: %d of %d updates skipped (non-finite loss, gradient or update)",
            iteration,
            metrics["skipped"],
            t.epochs * num_mb,
        )
    t_drift = time.perf_counter()
    if t.drift_metrics:
        sub = full if t.drift_subsample == 1 else programs.take(full, np.arange(0, B, t.drift_subsample))
        drift = programs.drift(state.params, sub)
        metrics.update(drift_to_log(drift))
        if (loads := expert_loads(drift)) is not None:
            metrics["expert_loads"] = loads  # not a scalar: `_run` writes it to routing.jsonl
    metrics.update(
        rollout_seconds=t_rollout,
        logprob_seconds=t_logprobs,
        update_seconds=t_updates,
        drift_seconds=time.perf_counter() - t_drift,
        iteration_seconds=time.perf_counter() - t0,
    )
    return state, metrics


def sampler_mismatch(batch, trainer_logp_BT, trainer_topk_BLTK) -> dict[str, float]:
    """`mismatch.mismatch_metrics` of the batch's sampler log-probs and routing against the trainer's, as
    `mismatch_*` (the largest |δ| keeps its older name, `old_logp_max_diff`); reduced on the mesh, so
    only scalars reach the host."""
    out = _mismatch(batch.old_logp, trainer_logp_BT, batch.completion_mask, batch.topk, trainer_topk_BLTK)
    out = {("old_logp_max_diff" if k == "logp_abs_max" else f"mismatch_{k}"): float(v) for k, v in out.items()}
    return out


_mismatch = jax.jit(mismatch.mismatch_metrics)


def prepare_batch(programs: Programs, params, batch, old_logp_source, replay, ref_params, metrics) -> TrainBatch:
    """The rollout on the mesh: π_old's log-probs from `old_logp_source`, π_old's routing from the
    sampler (R3) or the trainer (R2, none), π_ref's log-probs when there is a reference. Logs
    `old_logp_max_diff` (trainer vs sampler log-probs) into `metrics`. With `programs.on_policy` the
    trainer's log-probs and routing are left for the update's own forward to fill in."""
    b2 = programs.batch_shardings.tokens
    tokens = jax.device_put(batch.tokens, b2)
    positions = jax.device_put(_positions(batch.prompt_mask, batch.completion_mask), b2)
    sampler_logp = batch.old_logp
    if programs.on_policy:
        old_logp, topk = sampler_logp, batch.topk  # placeholders, replaced by the update
    else:
        logp_trainer, topk_trainer = programs.score(params, tokens, positions)
        metrics.update(sampler_mismatch(batch, logp_trainer, topk_trainer))
        old_logp = logp_trainer if old_logp_source == "trainer" else sampler_logp
        topk = batch.topk if replay == "R3" else topk_trainer  # R2 and none: the trainer's
    ref_logp = jnp.zeros_like(old_logp) if ref_params is None else programs.score(ref_params, tokens, positions)[0]
    per_token = programs.estimate is not None  # placeholders for the critic's estimate
    zeros = lambda: jnp.zeros(tokens.shape, jnp.float32) if per_token else None
    full = TrainBatch(
        tokens=tokens,
        positions=positions,
        completion_mask=batch.completion_mask,
        loss_mask=batch.loss_mask,
        old_logp=old_logp,
        sampler_logp=sampler_logp,
        ref_logp=ref_logp,
        advantages=zeros() if per_token else batch.advantages,  # host, the same on every process
        topk=topk,
        values=zeros(),
        returns=zeros(),
    )
    return jax.device_put(full, programs.batch_shardings)


@jax.jit
def _positions(prompt_mask_BT, completion_mask_BT):
    return model_lib.positions_from_mask(prompt_mask_BT | completion_mask_BT)


def drift_to_log(drift: dict[str, Array]) -> dict[str, float]:
    """`drift_*` scalars: per-layer values `x_per_layer` as `drift_x_layer{i}` (`drift_flip_rate_layer{i}`),
    per-bucket ones as `drift_x_bucket{i}`; the [L, E] expert loads stay out (`expert_loads`)."""
    out = {}
    for k, v in jax.device_get(drift).items():
        v = np.asarray(v)
        if k in ("load_old", "load_new"):
            continue
        if k.endswith("_per_layer"):
            out.update({f"drift_{k[: -len('_per_layer')]}_layer{i}": float(x) for i, x in enumerate(v)})
        elif v.ndim == 1:  # by margin bucket
            out.update({f"drift_{k}_bucket{i}": float(x) for i, x in enumerate(v)})
        else:
            out[f"drift_{k}"] = float(v)
    return out


def expert_loads(drift: dict[str, Array]) -> dict[str, list] | None:
    """π_old's and π_θ's per-expert load of each MoE layer ([L][E] lists), when the drift measured them."""
    if "load_new" not in drift:
        return None
    return {k: np.asarray(drift[k]).tolist() for k in ("load_old", "load_new")}


class StoppedEarly(Exception):
    """The run stopped at an iteration boundary on SIGTERM or SIGINT, after saving a checkpoint;
    running it again resumes there. `scripts/train.py` exits with `EXIT_STOPPED` for it."""

    def __init__(self, signum: int, iteration: int):
        self.signum, self.iteration = signum, iteration
        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name} after iteration {iteration}; checkpoint saved, rerun to resume")


class CheckpointMismatch(ConfigError):
    """The workdir has checkpoints but none restores into this run's state: training would never save."""


def train_and_evaluate(
    config: ml_collections.ConfigDict,
    workdir: str | Path,
    *,
    progress: bool = True,
    log_every: int = 1,
    allow_config_change: bool = False,
) -> dict[str, float]:
    """The main job: warm start, then RL iterations with evaluation, logging and checkpoints, resuming
    from the workdir's latest good checkpoint. One run per workdir (a lock), and only with the config
    the workdir was started with (`workdir.RESUMABLE_KEYS` aside) unless `allow_config_change`.
    SIGTERM / SIGINT save a checkpoint at the next iteration boundary and raise `StoppedEarly`.
    Progress goes to stderr: a bar on a terminal, else one line every `log_every` iterations.
    With several processes (`multihost.initialize`) every process calls this with the same arguments;
    the mesh must span every process's devices. Returns the last iteration's metrics ({} when nothing
    was left to do)."""
    workdir, built = Path(workdir), config_lib.build(config)
    is_main = jax.process_index() == 0
    mesh_size = math.prod(sharding_lib.mesh_from_config(**config.mesh).devices.shape)
    if jax.process_count() > 1 and mesh_size != jax.device_count():
        raise ConfigError(
            f"config.mesh: {dict(config.mesh)} covers {mesh_size} of the {jax.device_count()} devices of "
            f"{jax.process_count()} processes; a multi-process mesh must use them all (set one axis to -1)"
        )
    changes = workdir_lib.check_config(workdir, config, allow_change=allow_config_change)  # reads only
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"workdir {str(workdir)!r} cannot be created: {e.strerror}") from None
    with workdir_lib.Lock(workdir) if is_main else contextlib.nullcontext():
        if is_main:
            workdir_lib.record_config(workdir, config, changes)
        return _run(config, built, workdir, progress=progress, log_every=log_every)


def _run(config, built: config_lib.Built, workdir: Path, *, progress: bool, log_every: int) -> dict[str, float]:
    t, is_main = config.train, jax.process_index() == 0
    mesh = sharding_lib.mesh_from_config(**config.mesh)
    sharding_lib.warn_idle_devices(mesh)  # after every refusal: a refused run still prints one line
    graphdef, params = init_policy(config, built.model, mesh)
    programs = compile_in_background(compile_programs(config, built, graphdef, params, mesh), config, built, params)
    batch_size = built.rollout.num_groups * built.rollout.group_size
    sampler_graphdef, sampler_model = graphdef, built.model
    if built.rollout.dtype:  # the same weights, computed at the sampler's precision
        sampler_model = dataclasses.replace(built.model, dtype=built.rollout.dtype)
        sampler_graphdef = model_lib.abstract_model(sampler_model)[0]
    sampler = Sampler(
        sampler_graphdef,
        sampler_model,
        batch_size,
        config.prompt_len,
        config.max_new_tokens,
        mesh=mesh,
        state=params,
        threads=built.rollout.threads(mesh.devices.size),
        compiler_options=compiles.step_options(config.cpu_fast_compile),
    )
    rollout = Rollout(sampler, built.task, load_tokenizer(config.tokenizer_path or None), built.rollout)
    evaluation = functools.partial(evaluate, rollout, seed=config.seed + 1, num_batches=t.eval_batches)
    prompts = prompt_iterator(built.task, seed=config.seed, split="train")
    ckpt = Checkpointer(workdir / "checkpoints", max_to_keep=t.keep_checkpoints, save_every=t.checkpoint_every)
    with ckpt, MetricWriter(workdir) as writer, PreemptionGuard(sigint=True) as guard:
        restored = resume(ckpt, abstract_train_state(programs, params), prompts)  # before any work
        params, warm_start_info = warm_start(config, graphdef, params, mesh=mesh, rollout=rollout, workdir=workdir)
        kl_reward = built.critic is not None and built.critic.kl_reward_coef > 0
        ref_params = params if built.loss.kl_coef > 0 or kl_reward else None
        start, state = restored or (0, init_train_state(programs, params, config.seed))
        if is_main:  # rows past the restored step were logged by work the resumed run redoes
            workdir_lib.drop_rows_after(workdir, start if restored else -1)
        if not restored:
            writer.write(0, {**evaluation(state.params), **{k: float(v) for k, v in warm_start_info.items()}})
        last: dict[str, float] = {}
        bar = Progress(t.num_iterations, start, config.algorithm, every=log_every, enabled=progress)
        for it in range(start, t.num_iterations):
            counter = CompileCounter()  # logged as xla_compiles: 0 after the first iteration
            state, metrics = rl_iteration(programs, rollout, config, state, prompts, it, ref_params)
            t0 = time.perf_counter()
            if (it + 1) % t.eval_every == 0 or it + 1 == t.num_iterations:
                metrics.update(evaluation(state.params), eval_seconds=time.perf_counter() - t0)
            metrics["xla_compiles"] = float(counter.count)
            if (loads := metrics.pop("expert_loads", None)) is not None:
                writer.write_routing(it + 1, loads)
            writer.write(it + 1, metrics)  # before the save: a step is never checkpointed without its row
            last = metrics
            meta = dict(iteration=it, prompts=prompts.state())
            stop = multihost.any_process(guard.requested)  # a signal may reach only some hosts
            ckpt.save(it + 1, state, meta, force=stop or it + 1 == t.num_iterations)
            bar.update(metrics)
            if stop and it + 1 < t.num_iterations:  # a stop during the last iteration: the run has finished
                bar.close()
                raise StoppedEarly(guard.signum or signal.SIGTERM, it)
        bar.close()
    if is_main and start < t.num_iterations:
        plots.plot_run(workdir)
    return last


def abstract_train_state(programs: Programs, params) -> TrainState:
    """The train state's shapes, dtypes and shardings, without computing it (what `resume` fills)."""
    abstract = jax.eval_shape(functools.partial(init_train_state, programs, seed=0), params)
    return jax.tree.map(
        lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), abstract, programs.state_shardings
    )


def resume(ckpt: Checkpointer, abstract: TrainState, prompts) -> tuple[int, TrainState] | None:
    """(first iteration to run, restored state) from the newest good checkpoint, or None when the
    directory has none; restores the prompt iterator's position in place. Raises
    `CheckpointMismatch` when checkpoints exist but none restores: the run would never save."""
    restored = ckpt.restore_latest(abstract)
    if restored is None:
        if ckpt.all_steps():
            raise CheckpointMismatch(
                f"no checkpoint in {ckpt.directory} (steps {ckpt.all_steps()}) restores into this run's state: "
                "they hold another model, or are all corrupt; use a new workdir"
            )
        return None
    _, state, meta = restored
    prompts.restore(meta["prompts"])
    log.info("resumed from iteration %d", int(meta["iteration"]))
    return int(meta["iteration"]) + 1, state

"""The RL trainer: its typed state and batch, the update (`train_step`) and one RL iteration.

`rl_iteration`: rollout with π_old → old log-probs (the sampler's, or the trainer's recomputation; the
max difference is logged) → ref log-probs when kl_coef > 0 → with a critic (PPO), its values and GAE
advantages in place of the group ones → `epochs` × `minibatches` shuffled minibatches of `train_step`
→ routing drift of the updated policy against π_old. Programs: `programs.py`; the run: `run.py`."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct

from gspo_jax import config as config_lib
from gspo_jax import critic as critic_lib
from gspo_jax import losses, mismatch, routing
from gspo_jax import metrics as metrics_lib
from gspo_jax import model as model_lib
from gspo_jax import optimizer as optimizer_lib
from gspo_jax import sharding as sharding_lib
from gspo_jax.config import TrainConfig
from gspo_jax.metrics import Count, Mean, Sum
from gspo_jax.rollout import Rollout

if TYPE_CHECKING:  # programs.py builds on this module
    from gspo_jax.programs import Programs

log = logging.getLogger(__name__)
Array = jax.Array


@struct.dataclass
class TrainState:
    step: Array  # int32: optimizer updates applied (a skipped update does not count)
    params: nnx.State
    opt_state: optax.OptState
    rng: Array  # uint32 key data: portable across PRNG implementations and orbax versions
    critic: critic_lib.CriticState | None = None  # PPO's value model and its optimizer (`config.critic`)


# Each TrainBatch field's dtype and axes: where its shapes, shardings and placeholders come from.
# With a critic, advantages are per token (GAE) and the critic's fields are there; without, None.
_FIELDS: dict[str, tuple[Any, str]] = dict(
    tokens=(jnp.int32, "BT"),
    positions=(jnp.int32, "BT"),
    completion_mask=(jnp.bool_, "BT"),
    **dict.fromkeys(("loss_mask", "old_logp", "sampler_logp", "ref_logp"), (jnp.float32, "BT")),
    advantages=(jnp.float32, "B"),
    topk=(jnp.int32, "BLTK"),
)
_CRITIC_FIELDS = dict.fromkeys(("advantages", "values", "returns"), (jnp.float32, "BT"))


@struct.dataclass
class TrainBatch:
    """A rollout as the trainer consumes it; every field batch-first, so `jax.tree.map(lambda x:
    x[idx], batch)` takes a minibatch. Dtypes and axes: `spec`."""

    tokens: Array  # [B, T]
    positions: Array  # [B, T]; -1 on padding
    completion_mask: Array  # [B, T]: generated tokens (drift is measured on them)
    loss_mask: Array  # [B, T]: completion tokens that train (fill / filtered ones do not)
    old_logp: Array  # [B, T]: π_old
    sampler_logp: Array  # [B, T]: π_sampler, what the sampler reported (corrections weigh by old / it)
    ref_logp: Array  # [B, T]: π_ref (zeros without a KL term)
    advantages: Array  # [B], or [B, T] with a critic (GAE)
    topk: Array  # [B, L, T, K]: π_old's routing, replayed under R2 / R3
    values: Array | None = None  # [B, T]: the critic's V(s_t) at the rollout (critic only)
    returns: Array | None = None  # [B, T]: GAE's returns, the value targets (critic only)

    @staticmethod
    def spec(critic: bool) -> dict[str, tuple[Any, str]]:
        """Each field's (dtype, axes); the critic's fields only with one."""
        return {**_FIELDS, **(_CRITIC_FIELDS if critic else {})}

    @classmethod
    def abstract(cls, built: config_lib.Built, B: int, T: int) -> TrainBatch:
        """B sequences of T tokens as shapes and dtypes (ahead-of-time lowering)."""
        dims = dict(B=B, T=T, L=built.model.num_moe_layers, K=max(built.model.top_k, 1))
        return cls(**{k: _shaped(f, dims, jax.ShapeDtypeStruct) for k, f in cls.spec(bool(built.critic)).items()})

    @classmethod
    def shardings(cls, mesh: jax.sharding.Mesh, critic: bool) -> TrainBatch:
        """Every field's rows split over the mesh's data axes."""
        return cls(**{k: sharding_lib.batch_sharding(mesh, len(axes)) for k, (_, axes) in cls.spec(critic).items()})

    @classmethod
    def filled(cls, critic: bool, **given) -> TrainBatch:
        """A batch of the `given` fields, the rest zeros of their shape: placeholders (for the critic's
        estimate to fill in)."""
        (B, T), (_, L, _, K) = given["tokens"].shape, given["topk"].shape
        zeros = lambda f: _shaped(f, dict(B=B, T=T, L=L, K=K), jnp.zeros)
        return cls(**{k: given[k] if k in given else zeros(f) for k, f in cls.spec(critic).items()})


def _shaped(field: tuple[Any, str], dims: dict[str, int], make):
    return make(tuple(dims[a] for a in field[1]), field[0])


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """The static part of `train_step`: hashable, so equal configs share one compilation."""

    graphdef: nnx.GraphDef
    loss: losses.LossConfig
    optimizer: optimizer_lib.OptimizerConfig
    total_steps: int
    temperature: float  # log-probs are scored at the sampling temperature
    replay: str  # config.REPLAY: route with the batch's top-k (R2 / R3) instead of the live router
    microbatches: int
    routing_diagnostics: bool = False  # the flipped-vs-unflipped split of the loss's diagnostics
    # The update is the only one on its batch and starts at π_old (`shares_old_forward`): its own
    # forward gives π_old's log-probs and routing (old_logp = stop_gradient(logp), exactly ratio 1),
    # and the step returns them, so the batch needs no separate scoring forward.
    on_policy: bool = False
    critic: critic_lib.CriticStep | None = None  # PPO: the critic's update, on the same micro-batches


def shares_old_forward(
    t: TrainConfig,
    loss_cfg: losses.LossConfig | None = None,
    critic_cfg: critic_lib.CriticConfig | None = None,
) -> bool:
    """Whether π_old's log-probs can come from the update's own forward instead of a scoring pass:
    one update per batch (epochs = minibatches = 1), recomputed by the trainer, under the routing the
    update uses (live; R2 replays π_old's own routing, which the forward at π_old chooses anyway; R3
    replays the sampler's, and π_old is scored under it too), and no masked-IS correction (its mask
    changes the loss denominator, which must be known before the first micro-batch), and no KL
    penalty in a critic's rewards (GAE needs π_old's log-probs before the update)."""
    mis = loss_cfg is not None and loss_cfg.is_correction == "mis"
    kl_reward = critic_cfg is not None and critic_cfg.kl_reward_coef > 0
    single = t.epochs * t.minibatches == 1
    return single and t.old_logp_source == "trainer" and not mis and not kl_reward


def forces_routing(replay: str, on_policy: bool) -> bool:
    """Whether the update routes with the batch's top-k: R3 always (the sampler's routing); R2 only off
    the on-policy path (there the forward at π_old chooses π_old's routing itself)."""
    return replay == "R3" or (replay == "R2" and not on_policy)


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
        forced = mb.topk if forces_routing(static.replay, static.on_policy) else None
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
        given = dict(old_logp=old_BT, advantages=mb.advantages, mask=c.mask_BT, ref_logp=ref_BT)
        pl = functools.partial(losses.policy_loss, cfg, **given, denominator=denom, is_weight=c.weight)
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


def rl_iteration(
    programs: Programs, rollout: Rollout, t: TrainConfig, state: TrainState, prompts, iteration: int, ref_params=None
) -> tuple[TrainState, dict[str, float]]:
    """One RL iteration (see the module docstring); returns the new state and the iteration's metrics."""
    key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), iteration)
    t0 = time.perf_counter()
    batch, metrics = rollout(state.params, prompts, jax.random.fold_in(key, 0))
    t_rollout = time.perf_counter() - t0
    full = prepare_batch(programs, state.params, batch, t, ref_params, metrics)
    if programs.estimate is not None:  # PPO: the critic's values and GAE replace the group advantages
        rewards = jax.device_put(batch.rewards, sharding_lib.batch_sharding(programs.batch_shardings.tokens.mesh, 1))
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
    if programs.on_policy and t.routing_replay != "R3":  # the update's forward was π_old's, routed live
        metrics.update(mismatch.sampler_mismatch(batch, full.old_logp, full.topk))
    host = [jax.tree.map(float, s) for s in jax.device_get(step_metrics)]  # float64 from here
    metrics.update(metrics_lib.compute(functools.reduce(metrics_lib.merge, host)))
    t_updates = time.perf_counter() - t0 - t_rollout - t_logprobs  # synchronised: metrics are on the host
    if metrics["skipped"]:
        what = "iteration %d: %d of %d updates skipped (non-finite loss, gradient or update)"
        log.warning(what, iteration, metrics["skipped"], t.epochs * num_mb)
    t_drift = time.perf_counter()
    if t.drift_metrics:
        sub = full if t.drift_subsample == 1 else programs.take(full, np.arange(0, B, t.drift_subsample))
        drift = programs.drift(state.params, sub)
        metrics.update(routing.drift_to_log(drift))
        if (loads := routing.expert_loads(drift)) is not None:
            metrics["expert_loads"] = loads  # not a scalar: the run writes it to routing.jsonl
    metrics.update(
        rollout_seconds=t_rollout,
        logprob_seconds=t_logprobs,
        update_seconds=t_updates,
        drift_seconds=time.perf_counter() - t_drift,
        iteration_seconds=time.perf_counter() - t0,
    )
    return state, metrics


def prepare_batch(programs: Programs, params, batch, t: TrainConfig, ref_params, metrics) -> TrainBatch:
    """The rollout on the mesh: π_old's routing from the sampler (R3) or the trainer (R2, none), π_old's
    log-probs from `t.old_logp_source` (the trainer's scored under that same routing, so the update's
    ratio is exactly 1 at θ_old), π_ref's log-probs when there is a reference. Logs the sampler–trainer
    mismatch against the trainer's live routing (`mismatch.sampler_mismatch`) into `metrics`. With
    `programs.on_policy` the trainer's log-probs (and, but under R3, routing) are left for the update's
    own forward to fill in."""
    b2 = programs.batch_shardings.tokens
    tokens = jax.device_put(batch.tokens, b2)
    positions = jax.device_put(_positions(batch.prompt_mask, batch.completion_mask), b2)
    sampler_logp, r3 = batch.old_logp, t.routing_replay == "R3"
    logp_live = None
    if not programs.on_policy or r3:  # the mismatch is against the live routing: R3 needs a forward for it
        logp_live, topk_live = programs.score(params, tokens, positions)
        metrics.update(mismatch.sampler_mismatch(batch, logp_live, topk_live))
    if programs.on_policy:
        old_logp, topk = sampler_logp, batch.topk  # placeholders, replaced by the update (R3: its routing)
    else:
        topk = batch.topk if r3 else topk_live  # R2 and none: the trainer's
        old_logp = sampler_logp
        if t.old_logp_source == "trainer":  # π_old under the routing the update replays
            old_logp = programs.score_replayed(params, tokens, positions, topk)[0] if r3 else logp_live
    ref_logp = jnp.zeros_like(old_logp) if ref_params is None else programs.score(ref_params, tokens, positions)[0]
    given = dict(tokens=tokens, positions=positions, completion_mask=batch.completion_mask, loss_mask=batch.loss_mask)
    given.update(old_logp=old_logp, sampler_logp=sampler_logp, ref_logp=ref_logp, topk=topk)
    critic = programs.estimate is not None  # its fields are placeholders for the critic's estimate
    if not critic:
        given["advantages"] = batch.advantages  # host, the same on every process
    return jax.device_put(TrainBatch.filled(critic, **given), programs.batch_shardings)


@jax.jit
def _positions(prompt_mask_BT, completion_mask_BT):
    return model_lib.positions_from_mask(prompt_mask_BT | completion_mask_BT)

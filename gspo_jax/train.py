"""The RL trainer: its typed state and batch, and the update (`train_step`). One RL iteration, which
calls it: `iteration.py`; the jitted programs: `programs.py`; the run: `run.py`."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from gspo_jax import built as built_lib
from gspo_jax import critic as critic_lib
from gspo_jax import lora, losses, mismatch, routing
from gspo_jax import metrics as metrics_lib
from gspo_jax import model as model_lib
from gspo_jax import optimizer as optimizer_lib
from gspo_jax import router_shift as router_shift_lib
from gspo_jax import sharding as sharding_lib
from gspo_jax.metrics import Count, Mean, Sum

Array = jax.Array


@struct.dataclass
class TrainState:
    step: Array  # int32: optimizer updates applied (a skipped update does not count)
    params: nnx.State
    opt_state: optax.OptState
    rng: Array  # uint32 key data: portable across PRNG implementations and orbax versions
    critic: critic_lib.CriticState | None = None  # PPO's value model and its optimizer (`config.critic`)
    # LoRA (`Plan.lora`): the frozen base, and `params` its adapters only (no gradient, no optimizer
    # state for it). Donated with the state and passed through aliased: nothing else may hold it.
    frozen: nnx.State | None = None

    @property
    def policy(self) -> nnx.State:
        """The whole policy: `params`, or under LoRA the frozen base with them (`lora.union`, no copy)."""
        return self.with_adapters(self.params)

    def with_adapters(self, params) -> nnx.State:
        """The policy of these trainable `params` (a lagged policy's): under LoRA on the state's base."""
        return params if self.frozen is None else lora.union(self.frozen, params)


def trainable(params: nnx.State, lora_on: bool) -> tuple[nnx.State, nnx.State | None]:
    """(what trains, the frozen base or None) of a whole policy: its adapters and base under LoRA."""
    return lora.split(params) if lora_on else (params, None)


# Each TrainBatch field's dtype and axes, from the one batch field table (`sharding.BATCH_FIELDS`):
# where its shapes, shardings and placeholders come from. With a critic, advantages are per token (GAE)
# and the critic's fields are there; without, None.
_fields = lambda *names: {k: sharding_lib.BATCH_FIELDS[k] for k in names}
_LOGPS = ("old_logp", "sampler_logp", "ref_logp")  # π_old (the ratio's denominator), π_sampler, π_ref
_FIELDS = _fields("tokens", "positions", "completion_mask", "loss_mask", *_LOGPS, "advantages", "topk")
_CRITIC_FIELDS = {**_fields("values", "returns"), "advantages": (jnp.float32, "BT")}  # GAE's: per token
_WEIGHT_REPLAY_FIELDS = _fields("gates")  # R3W only: 4·K·L more bytes per token
_OLD_ROUTER_FIELDS = _fields("old_router_logp")  # RSPO off the on-policy path only


@struct.dataclass
class TrainBatch:
    """A rollout as the trainer consumes it; every field batch-first, so `jax.tree.map(lambda x:
    x[idx], batch)` takes a minibatch. Dtypes and axes: `spec`."""

    tokens: Array  # [B, T]
    positions: Array  # [B, T]; -1 on padding
    completion_mask: Array  # [B, T]: generated tokens (drift is measured on them)
    loss_mask: Array  # [B, T]: completion tokens that train (fill / filtered ones do not)
    old_logp: Array  # [B, T]: π_old, the ratio's denominator: the trainer's scoring, or `sampler_logp` by mode
    sampler_logp: Array  # [B, T]: π_sampler, the rollout's own (corrections weigh by old / it)
    ref_logp: Array  # [B, T]: π_ref (zeros without a KL term)
    advantages: Array  # [B], or [B, T] with a critic (GAE)
    topk: Array  # [B, L, T, K]: π_old's routing, replayed under R2 / R3 / R3W
    values: Array | None = None  # [B, T]: the critic's V(s_t) at the rollout (critic only)
    returns: Array | None = None  # [B, T]: GAE's returns, the value targets (critic only)
    gates: Array | None = None  # [B, L, T, K]: the sampler's combine weights of `topk` (R3W only)
    old_router_logp: Array | None = None  # [B, L, T, K]: π_old's router log-probs at `topk` (RSPO only)

    @staticmethod
    def spec(critic: bool, weight_replay: bool = False, old_router: bool = False) -> dict[str, tuple[Any, str]]:
        """Each field's (dtype, axes); the critic's fields only with one, the gates only under R3W, π_old's
        router log-probs only when RSPO needs them (`Plan.old_router`)."""
        spec = {**_FIELDS, **(_CRITIC_FIELDS if critic else {}), **(_WEIGHT_REPLAY_FIELDS if weight_replay else {})}
        return {**spec, **(_OLD_ROUTER_FIELDS if old_router else {})}

    @classmethod
    def abstract(cls, built: built_lib.Built, B: int, T: int) -> TrainBatch:
        """B sequences of T tokens as shapes and dtypes (ahead-of-time lowering)."""
        dims = dict(B=B, T=T, L=built.model.num_moe_layers, K=max(built.model.top_k, 1))
        spec = cls.spec(bool(built.critic), built.plan.weight_replay, built.plan.old_router)
        return cls(**{k: _shaped(f, dims, jax.ShapeDtypeStruct) for k, f in spec.items()})

    @classmethod
    def shardings(
        cls, mesh: jax.sharding.Mesh, critic: bool, weight_replay: bool = False, old_router: bool = False
    ) -> TrainBatch:
        """Every field's rows split over the mesh's data axes."""
        spec = cls.spec(critic, weight_replay, old_router)
        return cls(**sharding_lib.field_shardings(mesh, spec, spec))

    @classmethod
    def filled(cls, critic: bool, **given) -> TrainBatch:
        """A batch of the `given` fields, the rest zeros of their shape: placeholders (for the critic's
        estimate to fill in). The gates and π_old's router log-probs are there when given."""
        (B, T), (_, L, _, K) = given["tokens"].shape, given["topk"].shape
        zeros = lambda f: _shaped(f, dict(B=B, T=T, L=L, K=K), jnp.zeros)
        spec = cls.spec(critic, given.get("gates") is not None, given.get("old_router_logp") is not None)
        return cls(**{k: given[k] if k in given else zeros(f) for k, f in spec.items()})


def _shaped(field: tuple[Any, str], dims: dict[str, int], make):
    return make(tuple(dims[a] for a in field[1]), field[0])


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """The static part of `train_step`: hashable, so equal configs share one compilation."""

    graphdef: nnx.GraphDef
    loss: losses.LossConfig
    optimizer: optimizer_lib.AdamW  # its schedule is an argument (`Schedules`)
    temperature: float  # log-probs are scored at the sampling temperature
    microbatches: int  # per update (`Plan.update_microbatches`)
    forces_routing: bool = False  # route with the batch's top-k, not the live router (`Plan.forces_routing`)
    weight_replay: bool = False  # ... and with the batch's combine weights (R3W)
    routing_diagnostics: bool = False  # the flipped-vs-unflipped split of the loss's diagnostics
    # The update is the only one on its batch and starts at π_old (`Plan.on_policy`): its own
    # forward gives π_old's log-probs and routing (old_logp = stop_gradient(logp), exactly ratio 1),
    # and the step returns them, so the batch needs no separate scoring forward.
    on_policy: bool = False
    critic: critic_lib.CriticStep | None = None  # PPO: the critic's update, on the same micro-batches

    @classmethod
    def of(cls, built: built_lib.Built, graphdef, critic: critic_lib.CriticStep | None = None) -> StepConfig:
        """A built config's step."""
        plan = built.plan
        return cls(
            graphdef=graphdef,
            loss=built.loss,
            optimizer=built.optimizer.rule,
            temperature=plan.scoring_temperature,
            microbatches=plan.update_microbatches,
            forces_routing=plan.forces_routing,
            weight_replay=plan.weight_replay,
            routing_diagnostics=built.train.routing_diagnostics,
            on_policy=plan.on_policy,
            critic=critic,
        )

    def forced_routing(self, batch: TrainBatch):
        """What the update's forward replays (`model.apply`'s `forced_topk`): None (the live router),
        the batch's expert ids, or under R3W the pair (ids, their combine weights)."""
        if not self.forces_routing:
            return None
        return (batch.topk, batch.gates) if self.weight_replay else batch.topk


class Schedules(NamedTuple):
    """The learning-rate schedules of a step, an argument of it: the policy's and the critic's (PPO)."""

    policy: optimizer_lib.Schedule
    critic: optimizer_lib.Schedule | None = None


class Scored(NamedTuple):
    """An on-policy update's forward at π_old: the batch's π_old log-probs and routing, by the names of
    the `TrainBatch` fields they fill."""

    old_logp: Array  # float32 [B, T]
    topk: Array  # int32 [B, L, T, K]


def train_step(
    static: StepConfig, schedules: Schedules, state: TrainState, batch: TrainBatch
) -> tuple[TrainState, dict[str, Any], Scored | None]:
    """One optimizer update on one minibatch, accumulated over `microbatches` with the minibatch's
    loss denominator, so the policy loss and its gradient equal the full minibatch's (the MoE load-
    balancing and z losses are batch statistics, computed per micro-batch as everywhere), at the
    learning rates `schedules` give for the update count (arrays, not constants of the program). A non-finite
    loss or gradient leaves the state untouched and is counted in `skipped`. Metrics are per update
    (`metrics.per_update`). With `static.on_policy`, `batch.old_logp` and `batch.topk` are not read:
    the forward provides them, and they come back as `Scored`. With `static.critic` (PPO) the critic
    is updated too, on the same micro-batches, with its own optimizer (`critic.update`)."""
    tx = optimizer_lib.make_optimizer(static.optimizer)
    # MIS drops tokens from the denominator too: it is the minibatch's, corrected (never on-policy).
    # The masks (IcePop, geometric, off-policy) zero losses inside it: they leave it as it is.
    denom = losses.loss_denominator(static.loss, _corrections(static.loss, batch.old_logp, batch).mask_BT)
    micro = jax.tree.map(lambda x: model_lib.split_batch(x, static.microbatches), batch)  # strided: `split_batch`
    # π_θ's routing against π_old's, per token: on-policy they are the same policy, so nothing to split.
    split = static.routing_diagnostics and not static.on_policy and batch.topk.shape[1] > 0
    # Differentiated wrt `state.params` only: under LoRA the adapters, on the frozen base.
    loss_fn = lambda params, mb: _loss(static, denom, split, state.with_adapters(params), mb)

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
    finite_loss = jnp.isfinite(metrics["total_loss"].total)
    params, opt_state, ok = optimizer_lib.apply_if_finite(
        tx, schedules.policy, grads, grad_norm, state.opt_state, state.params, finite_loss
    )
    state = state.replace(step=state.step + ok.astype(jnp.int32), params=params, opt_state=opt_state)
    metrics.update(grad_norm=Mean(grad_norm, 1), skipped=Count((~ok).astype(jnp.float32)))
    if static.critic is not None:  # its own loss, gradient, optimizer and skip; the same micro-batches
        critic_state, critic_metrics = critic_lib.update(static.critic, schedules.critic, state.critic, micro)
        state = state.replace(critic=critic_state)
        metrics.update(critic_metrics)
    return state, metrics_lib.per_update(metrics), scored


def _loss(static: StepConfig, denom, split: bool, policy, mb: TrainBatch):
    """One micro-batch's loss (its share of the minibatch's, over `denom`) under the whole `policy`, its
    metrics, and what its forward scored at π_old (`Scored`; used on the on-policy path)."""
    cfg, forced = static.loss, static.forced_routing(mb)
    router_logits = (split and forced is not None) or cfg.router_shift
    logp_BT, aux = model_lib.logprobs(
        static.graphdef, policy, mb.tokens, mb.positions, forced, static.temperature, router_logits
    )
    old_BT = jax.lax.stop_gradient(logp_BT) if static.on_policy else mb.old_logp
    corr = _corrections(cfg, old_BT, mb)
    keep, more = _keep(cfg, corr, logp_BT, mb)
    gamma_BT = _router_shift(static, aux, mb, corr.mask_BT, more)
    weights = losses.LossWeights(is_weight=corr.weight, keep=keep, router_shift=gamma_BT)
    ref_BT = mb.ref_logp if cfg.kl_coef > 0 else None
    given = dict(old_logp=old_BT, advantages=mb.advantages, mask=corr.mask_BT, ref_logp=ref_BT, weights=weights)
    pl = functools.partial(losses.policy_loss, cfg, **given, denominator=denom)
    flipped_BT = _flipped(aux, mb, forced) if split else None
    loss, metrics = pl(logp_BT, flipped=flipped_BT)
    if split:  # each token's |∂loss/∂logp_t|: how much of the update flipped tokens drive
        metrics["grad_share_flipped"] = _grad_share(pl, logp_BT, flipped_BT)
    metrics.update(more)
    total = loss + aux.aux_loss / static.microbatches
    metrics.update(lb_loss=Mean(aux.lb_loss, 1), z_loss=Mean(aux.z_loss, 1), total_loss=Sum(total))
    return total, (metrics, Scored(old_BT, aux.topk))


def _corrections(cfg: losses.LossConfig, old_BT, mb: TrainBatch) -> mismatch.Correction:
    """The sampler–trainer correction and the masks π_old and π_sampler decide (`mismatch.corrections`)."""
    return mismatch.corrections(cfg, old_BT, mb.sampler_logp, mb.loss_mask)


def _keep(cfg: losses.LossConfig, corr: mismatch.Correction, logp_BT, mb: TrainBatch):
    """The tokens or sequences whose loss counts, and the masks' metrics: the correction's masks, and
    DeepSeek-V3.2's off-policy mask, which is by π_θ, so here, not in the denominator."""
    keep, more = corr.keep, dict(corr.metrics)
    if cfg.off_policy_mask_delta is not None:
        opsm_keep, opsm = mismatch.off_policy_mask(
            cfg.off_policy_mask_delta, logp_BT, mb.sampler_logp, mb.advantages, corr.mask_BT
        )
        keep = mismatch.and_keep(keep, opsm_keep)
        more.update(opsm)
    return keep, more


def _router_shift(static: StepConfig, aux, mb: TrainBatch, mask_BT, metrics: dict):
    """RSPO's weight γ̃ ([B, T]): the router on π_old's experts now against then (on-policy: the same
    policy, so 1); None without `loss.router_shift`. Its metrics go into `metrics`."""
    if not static.loss.router_shift:
        return None
    at_BLTK = aux.topk if static.on_policy else mb.topk
    new_BLTK = router_shift_lib.expert_logprobs(aux.router_logits, at_BLTK)
    old_BLTK = jax.lax.stop_gradient(new_BLTK) if static.on_policy else mb.old_router_logp
    loss = static.loss
    shift = router_shift_lib.shift_weight(new_BLTK, old_BLTK, mask_BT, loss.router_shift_floor, loss.router_shift_probs)
    metrics.update(shift.metrics)
    return shift.weight_BT


def _flipped(aux, mb: TrainBatch, forced):
    """Tokens whose routing under π_θ differs from π_old's; under replay the forward used π_old's
    routing, so the router's own choice is its top-k."""
    own_BLTK = aux.topk if forced is None else jax.lax.top_k(aux.router_logits, mb.topk.shape[-1])[1]
    return routing.flipped_tokens(mb.topk, own_BLTK)


def _grad_share(pl, logp_BT, flipped_BT) -> Mean:
    """The share of Σ_t |∂loss/∂logp_t| that falls on flipped tokens."""
    g_BT = jnp.abs(jax.grad(lambda lp: pl(lp)[0])(jax.lax.stop_gradient(logp_BT)))
    return Mean(jnp.sum(jnp.where(flipped_BT, g_BT, 0.0)), jnp.sum(g_BT), math.nan)

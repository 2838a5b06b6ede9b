"""One RL iteration (`rl_iteration`): rollout with π_old → old log-probs (the sampler's, or the trainer's
recomputation under the routing the update uses; the mismatch is logged) → ref log-probs when
kl_coef > 0 → with a critic (PPO), its values and GAE advantages in place of the group ones → `epochs`
× `minibatches` shuffled minibatches of `train.train_step` → routing drift of the updated policy
against π_old. It builds on the trainer (`train.py`) and its programs (`programs.py`); `run.py` loops it."""

from __future__ import annotations

import contextlib
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from gspo_jax import metrics as metrics_lib
from gspo_jax import mismatch, overlap, routing, staleness
from gspo_jax import model as model_lib
from gspo_jax import optimizer as optimizer_lib
from gspo_jax import sharding as sharding_lib
from gspo_jax.built import TrainConfig
from gspo_jax.context import RunContext
from gspo_jax.programs import Programs
from gspo_jax.train import TrainBatch, TrainState

log = logging.getLogger(__name__)


class Phases:
    """Seconds per phase of an iteration, each timed where it runs (`with phases("update"):`); a phase
    entered twice adds up. Every phase ends on a host sync (its metrics reach the host), so the times
    are the work's, not its dispatch's."""

    NAMES = ("rollout", "logprob", "update", "drift")  # the order they are logged in

    def __init__(self):
        self.started, self.seconds = time.perf_counter(), dict.fromkeys(self.NAMES, 0.0)

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        """`<phase>_seconds` for each phase, and `iteration_seconds` since the start."""
        done = {f"{k}_seconds": v for k, v in self.seconds.items()}
        return {**done, "iteration_seconds": time.perf_counter() - self.started}


def rl_iteration(ctx: RunContext, state: TrainState, iteration: int) -> tuple[TrainState, dict[str, float]]:
    """One RL iteration (see the module docstring) of the run `ctx`; returns the new state and the
    iteration's metrics. With `rollout.staleness` = k > 0 the lag's oldest policy samples the batch and
    is π_old, its routing drift to today's policy is logged (`stale_*`), and today's joins the lag
    before the update. Across hosts (`ctx.bridge`) every process calls it: the trainer's programs and
    what reads them run where the trainer is (`ctx.trains`), the moves between the meshes everywhere."""
    programs, train, lag = ctx.programs, ctx.built.train, ctx.lag
    key = _key(ctx, state, iteration)
    phases = Phases()
    # Under LoRA the lag holds adapters: the behaviour policy is the base with the lagged ones.
    lagged = state.params if lag is None else lag.behaviour(state.params)
    with phases("rollout"):
        batch, metrics, drawn = _draw(ctx, ctx.for_sampler(state, lagged), iteration, key)
    full = None
    with phases("logprob"):  # with a sampler mesh, π_old is scored with the trainer's own copy of it
        behaviour = ctx.on_trainer(state, lagged)
        del lagged
        if ctx.trains:
            full, mismatch_metrics = prepare_batch(ctx, behaviour, batch, ctx.reference_policy(state))
            metrics.update(mismatch_metrics)
        del behaviour  # the lag's oldest copy is freed once its work is done: k copies at most
        # PPO: the critic's values and GAE replace the group advantages
        if programs.estimate is not None and ctx.trains:
            rewards = jax.device_put(batch.rewards, sharding_lib.field_sharding(programs.mesh, "rewards"))
            full, estimated = programs.estimate(state.critic.params, full, rewards)  # host rewards, everywhere alike
            metrics.update({k: float(v) for k, v in jax.device_get(estimated).items()})
    drift_rows = np.arange(0, batch.tokens.shape[0], train.drift_subsample)
    with phases("drift"):
        if lag is not None and lag.k:
            metrics.update(_lag_step(ctx, state, full, iteration, drift_rows))
    router_before = []
    if ctx.trains:
        with phases("update"):
            router_before = [jnp.copy(x) for x in optimizer_lib.router_leaves(state.params)]  # the update donates them
            state, full, step_metrics = _updates(programs, train, state, full, key)
            if programs.on_policy and not ctx.built.plan.sampler_routing:  # π_old's forward, routed live
                metrics.update(mismatch.sampler_mismatch(batch, full.old_logp, full.topk))
            host = [jax.tree.map(_float64, s) for s in jax.device_get(step_metrics)]  # float64 from here
            metrics.update(metrics_lib.compute(functools.reduce(metrics_lib.merge, host)))
    if ctx.ahead is not None:  # today's parameters start towards the sampler's mesh at once
        lag.stage(state.params)
    if router_before:  # 0 exactly with `train.freeze_router`
        router_after = optimizer_lib.router_leaves(state.params)
        metrics["router_update_norm"] = float(optimizer_lib.distance(router_before, router_after))
    if metrics.get("skipped"):
        what = "iteration %d: %d of %d updates skipped (non-finite loss, gradient or update)"
        log.warning(what, iteration, metrics["skipped"], train.epochs * train.minibatches)
    with phases("drift"):
        if train.drift_metrics and ctx.trains:
            sub = full if train.drift_subsample == 1 else programs.take(full, drift_rows)
            drift = programs.drift(state.policy, sub)
            metrics.update(routing.drift_to_log(drift))
            if (loads := routing.expert_loads(drift)) is not None:
                metrics["expert_loads"] = loads  # not a scalar: the run writes it to routing.jsonl
    metrics.update(phases.metrics())
    if ctx.ahead is not None:  # the sampler's own seconds, and how many of them the trainer did not wait for
        metrics.update(overlap.timing(drawn, metrics))
    return state, metrics


def _draw(ctx: RunContext, behaviour, iteration: int, key):
    """The iteration's batch (on the trainer's mesh) and rollout metrics, and the `overlap.Drawn` when it
    was drawn ahead during the last update (`ctx.ahead`), else drawn now with `behaviour` (across hosts
    through `ctx.ahead` too: the sampler's processes draw it, then it crosses)."""
    drawn = None if ctx.ahead is None else ctx.ahead.take(iteration)
    if drawn is None and ctx.bridge is not None:
        ctx.ahead.start(iteration, behaviour, jax.random.fold_in(key, 0))
        drawn = ctx.ahead.take(iteration)
    if drawn is not None:
        return drawn.batch, drawn.metrics, drawn
    batch, metrics = ctx.rollout(behaviour, ctx.prompts, jax.random.fold_in(key, 0))
    return (batch if ctx.sampler_mesh is None else overlap.batch_to(batch, ctx.mesh)), metrics, None


def _lag_step(ctx: RunContext, state: TrainState, full, iteration: int, drift_rows) -> dict[str, float]:
    """Staleness k > 0, before the update: the lag and the drift of today's policy against the batch's
    behaviour policy (`stale_*`); then today's policy joins the lag, whose oldest is the next batch's
    behaviour policy: with a sampler mesh that batch starts drawing now (`ctx.ahead`)."""
    programs, train, lag = ctx.programs, ctx.built.train, ctx.lag
    metrics = dict(staleness=float(lag.k), policy_lag=float(staleness.policy_lag(lag.k, iteration)))
    if train.drift_metrics and ctx.trains:
        sub = full if train.drift_subsample == 1 else programs.take(full, drift_rows)
        metrics.update(staleness.drift_to_log(programs.drift(state.policy, sub)))
    lag.advance(state.params)
    if ctx.ahead is not None and iteration + 1 < train.num_iterations:
        next_key = jax.random.fold_in(_key(ctx, state, iteration + 1), 0)
        ctx.ahead.start(iteration + 1, ctx.for_sampler(state, lag.behaviour(state.params)), next_key)
    return metrics


def _key(ctx: RunContext, state: TrainState, iteration: int):
    """Iteration `iteration`'s key (its rollout draws from `fold_in(key, 0)`). Across hosts from the seed
    on the host (`TrainState.rng` is `init_train_state`'s key of it, never updated), as the sampler's
    processes hold none of the state."""
    rng = state.rng if ctx.bridge is None else jax.random.key_data(jax.random.key(ctx.built.seed))
    return jax.random.fold_in(jax.random.wrap_key_data(rng), iteration)


def _float64(x):
    """A metric's leaf on the host in float64: a Python float, or an array (a `Quantile`'s counts)."""
    return float(x) if np.ndim(x) == 0 else np.asarray(x, np.float64)


def _updates(programs: Programs, train: TrainConfig, state: TrainState, full: TrainBatch, key):
    """`train.epochs` × `train.minibatches` shuffled minibatches of `train_step`: (state, the batch with what an
    on-policy update scored at π_old filled in, each update's metrics left on the device)."""
    B, num_mb = full.tokens.shape[0], train.minibatches
    mb_size = B // num_mb
    step_metrics = []  # left on the device until every update is dispatched: no host sync in the loop
    for epoch in range(train.epochs):
        perm = np.asarray(jax.random.permutation(jax.random.fold_in(key, 1 + epoch), B))
        for m in range(num_mb):
            idx = perm[m * mb_size : (m + 1) * mb_size]
            state, step, scored = programs.train_step(state, programs.take(full, idx))
            step_metrics.append(step)
            if scored is not None:  # the only update: its forward scored π_old, in the minibatch's order
                scored = programs.take_scored(scored, np.argsort(idx))
                full = full.replace(**scored._asdict())
    return state, full, step_metrics


def prepare_batch(ctx: RunContext, params, batch, reference=None) -> tuple[TrainBatch, dict[str, float]]:
    """The rollout on the mesh: π_old's routing from the sampler (R3) or the trainer (R2, none), π_old's
    log-probs from `train.old_logp_source` (the trainer's scored under that same routing, so the update's
    ratio is exactly 1 at θ_old), π_ref's log-probs when there is a reference; and the sampler–trainer
    mismatch against the trainer's live routing (`mismatch.sampler_mismatch`), empty when the update's
    own forward will measure it (`rl_iteration`). With
    `programs.on_policy` the trainer's log-probs (and, but under R3 / R3W, its routing) are left for the
    update's own forward to fill in. For RSPO off that path, π_old's scoring forward also gives its router
    log-probs at `topk` (`programs.score_router`). π_ref: `reference` (`RunContext.reference_policy`),
    else `ctx.reference`."""
    programs, plan, train = ctx.programs, ctx.built.plan, ctx.built.train
    sh = programs.batch_shardings
    tokens = jax.device_put(batch.tokens, sh.tokens)
    positions = jax.device_put(_positions(batch.prompt_mask, batch.completion_mask), sh.positions)
    sampler_logp, r3 = batch.sampler_logp, plan.sampler_routing
    gates = batch.gates if plan.weight_replay else None
    logp_live = old_router = None
    measured: dict[str, float] = {}
    rspo = programs.score_router is not None  # π_old's router log-probs at `topk`, from π_old's forward
    if not programs.on_policy or r3:  # the mismatch is against the live routing: R3 needs a forward for it
        if rspo and not r3:  # none / R2: the live forward is π_old's, its router log-probs come with it
            logp_live, topk_live, old_router = programs.score_router(params, tokens, positions, None)
        else:
            logp_live, topk_live = programs.score(params, tokens, positions)
        measured = mismatch.sampler_mismatch(batch, logp_live, topk_live)
    if programs.on_policy:
        old_logp, topk = sampler_logp, batch.topk  # placeholders, replaced by the update (R3: its routing)
    else:
        topk = batch.topk if r3 else topk_live  # R2 and none: the trainer's
        old_logp = sampler_logp
        forced = (topk, gates) if gates is not None else topk
        if r3 and rspo:  # π_old under the replayed routing, with its router log-probs
            logp_replayed, _, old_router = programs.score_router(params, tokens, positions, forced)
        elif r3 and train.old_logp_source == "trainer":
            logp_replayed = programs.score_replayed(params, tokens, positions, forced)[0]
        if train.old_logp_source == "trainer":  # π_old under the routing the update replays
            old_logp = logp_replayed if r3 else logp_live
    ref = ctx.reference if reference is None else reference
    ref_logp = jnp.zeros_like(old_logp) if ref is None else programs.score(ref, tokens, positions)[0]
    given = dict(tokens=tokens, positions=positions, completion_mask=batch.completion_mask, loss_mask=batch.loss_mask)
    given.update(old_logp=old_logp, sampler_logp=sampler_logp, ref_logp=ref_logp, topk=topk, gates=gates)
    given.update(old_router_logp=old_router)
    critic = programs.estimate is not None  # its fields are placeholders for the critic's estimate
    if not critic:
        given["advantages"] = batch.advantages  # host, the same on every process
    return jax.device_put(TrainBatch.filled(critic, **given), sh), measured


@jax.jit
def _positions(prompt_mask_BT, completion_mask_BT):
    return model_lib.positions_from_mask(prompt_mask_BT | completion_mask_BT)

"""A run's jitted programs over its mesh: the policy's parameters placed on it, the train state's and
batch's shardings, and `train_step`, the scoring forward, the drift measurement and the critic's
estimate jitted with explicit in/out shardings (`compile_programs`). Each is a `compiles.Program`:
called like the function, lowered as it is for AOT compiles and profiles."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from gspo_jax import built as built_lib
from gspo_jax import compiles, hf, routing
from gspo_jax import critic as critic_lib
from gspo_jax import model as model_lib
from gspo_jax import optimizer as optimizer_lib
from gspo_jax import sharding as sharding_lib
from gspo_jax.compiles import Program
from gspo_jax.train import Schedules, Scored, StepConfig, TrainBatch, TrainState, train_step


class Programs(NamedTuple):
    """A run's jitted functions, with explicit shardings over its mesh."""

    train_step: Program  # (state, minibatch) -> (state, metrics, Scored | None); state donated
    take: Callable  # (batch, rows) -> the batch's rows, on the mesh (minibatches, drift sub-samples)
    take_scored: Callable  # (Scored, rows) -> its rows, on the mesh
    score: Program  # (params, tokens, positions) -> (logp [B, T], topk [B, L, T, K])
    score_replayed: Program  # (params, tokens, positions, topk or (topk, gates)) -> the same, so routed (R3)
    drift: Program  # (params, batch) -> drift metrics (routing.measure_drift)
    estimate: Program | None  # (critic params, batch, rewards [B]) -> (batch with GAE advantages, metrics)
    init_critic: Callable[[nnx.State], critic_lib.CriticState] | None  # (policy params) -> the critic's state
    step_config: StepConfig  # `train_step`'s static part
    optimizer: optax.GradientTransformation
    state_shardings: TrainState
    batch_shardings: TrainBatch
    mesh: jax.sharding.Mesh  # the one every program's shardings are on
    # (params, tokens, positions, None or as score_replayed's) -> (logp, topk, router log-probs at topk
    # [B, L, T, K]): π_old's scoring with its router, for RSPO (`Plan.old_router`); else None
    score_router: Program | None = None

    @property
    def on_policy(self) -> bool:
        """π_old's log-probs come from the update's forward (`Plan.on_policy`)."""
        return self.step_config.on_policy


def init_policy(built: built_lib.Built, mesh: jax.sharding.Mesh) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params on the mesh): from `hf_checkpoint`, or a random init from `seed`."""
    model_cfg = built.model
    if built.hf_checkpoint:
        _, graphdef, params = hf.load_hf_checkpoint(
            built.hf_checkpoint, dtype=model_cfg.param_dtype, dispatch=model_cfg.dispatch, mesh=mesh
        )
        return graphdef, jax.device_put(params, sharding_lib.param_shardings(mesh, params))
    shardings = sharding_lib.param_shardings(mesh, model_lib.abstract_model(model_cfg)[1])
    return model_lib.init(model_cfg, built.seed, shardings)


def compile_programs(built: built_lib.Built, graphdef, params, mesh: jax.sharding.Mesh) -> Programs:
    """Jits `train_step`, the scoring forward and the drift measurement for this run's shapes."""
    train = built.train
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    param_sh = sharding_lib.param_shardings(mesh, params)
    tx = optimizer_lib.make_optimizer(built.optimizer.rule)
    opt_sh = optimizer_lib.state_shardings(tx, params, param_sh, mesh)
    state_sh = TrainState(step=rep, params=param_sh, opt_state=opt_sh, rng=rep)
    # Module-level functions with their static arguments marked, not closures: equal configs (a run
    # resumed in the same process) reuse the compilation.
    on_mesh = functools.partial(sharding_lib.under_mesh, mesh=mesh)
    critic_cfg, plan = built.critic, built.plan
    batch_sh = TrainBatch.shardings(mesh, bool(critic_cfg), plan.weight_replay, plan.old_router)
    scored_sh = Scored(old_logp=batch_sh.old_logp, topk=batch_sh.topk)
    options = compiles.step_options(built.cpu_fast_compile)  # XLA:CPU's fast-compile code generation or not
    critic_static = estimate = init_critic = None
    if critic_cfg:
        critic_static, critic_sh, estimate, init_critic = _critic_programs(built, mesh, batch_sh, options)
        state_sh = state_sh.replace(critic=critic_sh)
    temperature = plan.scoring_temperature
    static = StepConfig.of(built, graphdef, critic_static)
    # Host scalars until the step's first call places them (`Program.args_sharding`): a deviceless
    # AOT compile has no device to put them on.
    critic_schedule = built.critic_optimizer.schedule(train.updates) if critic_cfg else None
    schedules = Schedules(built.optimizer.schedule(train.updates), critic_schedule)
    step = jax.jit(
        on_mesh(train_step),
        static_argnums=0,
        in_shardings=(rep, state_sh, batch_sh),
        out_shardings=(state_sh, rep, scored_sh if static.on_policy else None),
        donate_argnums=2,
        compiler_options=options,
    )
    score, score_replayed, score_router = _scoring_programs(
        mesh, param_sh, batch_sh, options, graphdef, temperature, plan.old_router
    )
    drift = jax.jit(
        on_mesh(routing.measure_drift),
        static_argnums=(0, 1, 2),
        in_shardings=(param_sh, batch_sh),
        out_shardings=rep,
        compiler_options=options,
    )
    return Programs(
        train_step=Program(step, static, args=(schedules,), args_sharding=rep),
        take=jax.jit(take_rows, in_shardings=(batch_sh, rep), out_shardings=batch_sh),
        take_scored=jax.jit(take_rows, in_shardings=(scored_sh, rep), out_shardings=scored_sh),
        score=score,
        score_replayed=score_replayed,
        drift=Program(drift, graphdef, temperature, train.routing_diagnostics),
        estimate=estimate,
        init_critic=init_critic,
        step_config=static,
        optimizer=tx,
        state_shardings=state_sh,
        batch_shardings=batch_sh,
        mesh=mesh,
        score_router=score_router,
    )


def _critic_programs(built: built_lib.Built, mesh, batch_sh: TrainBatch, options):
    """PPO's critic: its step's static half, its state's shardings, the advantage estimate and its init."""
    critic_cfg, rep = built.critic, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    critic_graphdef, abstract_critic = critic_lib.abstract(critic_cfg.model)
    critic_static = critic_lib.CriticStep(critic_graphdef, built.critic_optimizer.rule, critic_cfg.value_clip)
    critic_sh = critic_lib.state_shardings(critic_static, abstract_critic, mesh)
    estimate = jax.jit(
        sharding_lib.under_mesh(critic_lib.with_advantages, mesh=mesh),
        static_argnums=(0, 1),
        in_shardings=(critic_sh.params, batch_sh, sharding_lib.field_sharding(mesh, "rewards")),
        out_shardings=(batch_sh, rep),
        compiler_options=options,
    )
    init_critic = functools.partial(critic_lib.init_state, critic_cfg, critic_static, critic_sh, built.seed + 2)
    return critic_static, critic_sh, Program(estimate, critic_cfg, critic_graphdef), init_critic


def _scoring_programs(mesh, param_sh, batch_sh: TrainBatch, options, graphdef, temperature, old_router: bool):
    """π_old's forwards: live-routed, replayed (R3, R3W), and with the router's log-probs (RSPO) or None."""
    forced_sh = (batch_sh.topk, batch_sh.gates) if batch_sh.gates is not None else batch_sh.topk
    on_mesh = functools.partial(sharding_lib.under_mesh, mesh=mesh)
    inputs = (param_sh, batch_sh.tokens, batch_sh.positions)
    outputs = (batch_sh.old_logp, batch_sh.topk)

    def program(fn, in_shardings, out_shardings):
        jitted = jax.jit(
            on_mesh(fn),
            static_argnums=(0, 1),
            in_shardings=in_shardings,
            out_shardings=out_shardings,
            compiler_options=options,
        )
        return Program(jitted, graphdef, temperature)

    score = program(model_lib.score, inputs, outputs)
    score_replayed = program(model_lib.score, (*inputs, forced_sh), outputs)
    # One program, live (forced None: none, R2) or replayed (R3, R3W): one compile per run.
    router_out = (*outputs, batch_sh.old_router_logp)
    score_router = program(model_lib.score_with_router, (*inputs, forced_sh), router_out) if old_router else None
    return score, score_replayed, score_router


def compile_in_background(programs: Programs, built: built_lib.Built, params) -> Programs:
    """`programs` with the train step and the drift measurement compiled now, on a background thread, for
    the shapes `iteration.rl_iteration` calls them with, while the run initialises, evaluates and samples
    its first rollout (on 2 CPU cores the `iteration` shape's first row comes ~1 s sooner)."""
    train, B, T = built.train, built.batch_size, built.sampler.seq_len
    batch = lambda rows: sharding_lib.abstract(TrainBatch.abstract(built, rows, T), programs.batch_shardings)
    step = programs.train_step.in_background(abstract_train_state(programs, params), batch(B // train.minibatches))
    if not train.drift_metrics:
        return programs._replace(train_step=step)
    abstract_params = sharding_lib.abstract(params, programs.state_shardings.params)
    drift = programs.drift.in_background(abstract_params, batch(B // train.drift_subsample))
    return programs._replace(train_step=step, drift=drift)


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


def abstract_train_state(programs: Programs, params) -> TrainState:
    """The train state's shapes, dtypes and shardings, without computing it (what `resume` fills)."""
    abstract = jax.eval_shape(functools.partial(init_train_state, programs, seed=0), params)
    return sharding_lib.abstract(abstract, programs.state_shardings)

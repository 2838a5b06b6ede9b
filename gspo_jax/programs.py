"""A run's jitted programs over its mesh: the policy's parameters placed on it, the train state's and
batch's shardings, and `train_step`, the scoring forward, the drift measurement and the critic's
estimate jitted with explicit in/out shardings (`compile_programs`). Each is a `compiles.Program`:
called like the function, lowered as it is for AOT compiles and profiles."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from gspo_jax import built as built_lib
from gspo_jax import compiles, hf, lora, routing
from gspo_jax import critic as critic_lib
from gspo_jax import model as model_lib
from gspo_jax import optimizer as optimizer_lib
from gspo_jax import sharding as sharding_lib
from gspo_jax.compiles import Program
from gspo_jax.train import Schedules, Scored, StepConfig, TrainBatch, TrainState, train_step, trainable


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
    # The whole policy's shapes, dtypes and shardings (what the scoring forwards, the drift and the
    # sampler take): under LoRA its base's and adapters' together.
    policy: nnx.State | None = None

    @property
    def lora(self) -> bool:
        """The state trains adapters on a frozen base (`Plan.lora`)."""
        return self.state_shardings.frozen is not None

    @property
    def on_policy(self) -> bool:
        """π_old's log-probs come from the update's forward (`Plan.on_policy`)."""
        return self.step_config.on_policy


def init_policy(built: built_lib.Built, mesh: jax.sharding.Mesh) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params on the mesh): from `hf_checkpoint`, or a random init from `seed`; under LoRA
    the base's, the model with LoRA off (what the warm start trains; `as_base` casts it after)."""
    model_cfg = base_model(built)
    if built.hf_checkpoint:
        _, graphdef, params = hf.load_hf_checkpoint(
            built.hf_checkpoint, dtype=model_cfg.param_dtype, dispatch=model_cfg.dispatch, mesh=mesh
        )
        return graphdef, jax.device_put(params, sharding_lib.param_shardings(mesh, params))
    shardings = sharding_lib.param_shardings(mesh, model_lib.abstract_model(model_cfg)[1])
    return model_lib.init(model_cfg, built.seed, shardings)


def base_model(built: built_lib.Built):
    """The model the base is: `built.model` with LoRA off (itself without LoRA)."""
    return dataclasses.replace(built.model, lora=lora.LoraConfig()) if built.plan.lora else built.model


def abstract_policy(built: built_lib.Built) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, abstract whole policy) of `built.model`: under LoRA its base and adapters."""
    return model_lib.abstract_model(built.model)


def as_base(programs: Programs, params: nnx.State) -> nnx.State:
    """The LoRA base from the base model's parameters: each leaf cast to the adapted model's storage
    dtype for it (`lora.base_dtype`) and placed like it (no copy where nothing changes)."""
    sh = programs.state_shardings.frozen
    like = lora.split(programs.policy)[1]
    same = all(x.dtype == y.dtype for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(like), strict=True))
    if same:
        return jax.device_put(params, sh)
    cast = lambda x, y: x.astype(y.dtype)
    return jax.jit(lambda p: jax.tree.map(cast, p, like), out_shardings=sh)(params)


def compile_programs(built: built_lib.Built, graphdef, params, mesh: jax.sharding.Mesh) -> Programs:
    """Jits `train_step`, the scoring forward and the drift measurement for this run's shapes; `params`
    is the whole policy (or its abstract), under LoRA its base and adapters."""
    train = built.train
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    policy_sh = sharding_lib.param_shardings(mesh, params)  # scoring, drift
    trained, frozen = trainable(params, built.plan.lora)
    param_sh = policy_sh if frozen is None else sharding_lib.param_shardings(mesh, trained)
    frozen_sh = None if frozen is None else sharding_lib.param_shardings(mesh, frozen)
    tx = optimizer_lib.make_optimizer(built.optimizer.rule)
    opt_sh = optimizer_lib.state_shardings(tx, trained, param_sh, mesh)
    state_sh = TrainState(step=rep, params=param_sh, opt_state=opt_sh, rng=rep, frozen=frozen_sh)
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
        mesh, policy_sh, batch_sh, options, graphdef, temperature, plan.old_router
    )
    drift = jax.jit(
        on_mesh(routing.measure_drift),
        static_argnums=(0, 1, 2),
        in_shardings=(policy_sh, batch_sh),
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
        policy=sharding_lib.abstract(params, policy_sh),
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
    drift = programs.drift.in_background(programs.policy, batch(B // train.drift_subsample))
    return programs._replace(train_step=step, drift=drift)


def take_rows(tree, rows):
    """Rows `rows` of every batch-first array of `tree` (jitted with the batch's shardings: the
    gather stays on the mesh instead of passing through one device or the host)."""
    return jax.tree.map(lambda x: x[rows], tree)


def init_train_state(programs: Programs, params, seed: int, frozen=None) -> TrainState:
    """A fresh train state on the mesh. It owns a copy of `params`: `train_step` donates its state,
    and the caller's params may still be needed (the reference policy). Under LoRA `params` are the
    adapters and `frozen` the base, which the state takes as it is (not copied: the caller lets go)."""
    sh = programs.state_shardings
    # The critic's trunk copies the (warm-started) policy's, before the policy trains.
    critic = None if programs.init_critic is None else programs.init_critic(params)
    params = jax.tree.map(jnp.copy, params)
    opt_state = optimizer_lib.init_state(programs.optimizer, params, sh.params, sh.opt_state)
    rng = jax.random.key_data(jax.random.key(seed))
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state, rng=rng, critic=critic)
    return jax.device_put(state.replace(frozen=frozen), sh)


def abstract_train_state(programs: Programs, params) -> TrainState:
    """The train state's shapes, dtypes and shardings, without computing it (what `resume` fills);
    `params` the whole policy (under LoRA the programs' own abstract one is used)."""
    trained, frozen = lora.split(programs.policy) if programs.lora else (params, None)
    abstract = jax.eval_shape(lambda p, f: init_train_state(programs, p, 0, f), trained, frozen)
    return sharding_lib.abstract(abstract, programs.state_shardings)


def init_adapters(built: built_lib.Built, programs: Programs) -> nnx.State:
    """A fresh LoRA policy's adapters (A random, B zero: the model's own init) on the mesh: one jitted
    init of the whole model that returns only the adapters, so the base's init is dead code."""
    sh, opts = programs.state_shardings.params, compiles.run_once_options()
    build = jax.jit(_adapters, static_argnums=0, out_shardings=sh, compiler_options=opts)
    return build(built.model, np.int32(built.seed))


def _adapters(cfg, seed) -> nnx.State:
    return lora.split(model_lib._random_state(cfg, seed))[0]  # the model's own init, less the base

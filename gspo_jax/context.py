"""A run's pieces, set up once from its `Built` (`set_up`): the mesh, the policy, its jitted programs,
the sampler and rollout, the prompt stream; then, once the starting parameters are known (a warm
start, a checkpoint), the train state, the KL reference and the lagged policies (`RunContext.start`).
The main job (`run.py`) and the benchmarks' loop (`benchmarks/run/loop.py`) set a run up with it alike,
and `iteration.rl_iteration` reads everything but the train state from it."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from gspo_jax import built as built_lib
from gspo_jax import checkpoint, compiles, hosts, lora, overlap, staleness
from gspo_jax import model as model_lib
from gspo_jax import programs as programs_lib
from gspo_jax import sharding as sharding_lib
from gspo_jax.programs import Programs
from gspo_jax.rollout import Rollout
from gspo_jax.sampler import Sampler, SamplerOptions
from gspo_jax.tasks import load_tokenizer, prompt_iterator
from gspo_jax.train import TrainState


@dataclasses.dataclass
class RunContext:
    """What one run iterates with: built once, read by every iteration (`iteration.rl_iteration`)."""

    built: built_lib.Built
    mesh: jax.sharding.Mesh
    graphdef: nnx.GraphDef
    programs: Programs
    rollout: Rollout
    prompts: Any  # the train split's resumable prompt iterator (`tasks.prompt_iterator`)
    reference: nnx.State | None = None  # π_ref's parameters where `Plan.reference` (set by `start`)
    lag: staleness.PolicyLag | None = None  # the lagged policies of `rollout.staleness` (set by `start`)
    # LoRA: the base's model (LoRA off; what the warm start trains) and its identity (set by `start`)
    base_graphdef: nnx.GraphDef | None = None
    base: dict | None = None
    sampler_base: nnx.State | None = None  # LoRA with a sampler mesh of its own: the base's copy there
    # `mesh.rollout_devices`: the sampler's own mesh, and the rollout drawn there ahead of the update
    sampler_mesh: jax.sharding.Mesh | None = None
    ahead: overlap.RolloutAhead | None = None
    bridge: hosts.Bridge | None = None  # the sampler's mesh on hosts of its own: how arrays cross

    @property
    def trains(self) -> bool:
        """Whether this process runs the trainer's programs (all but a split over hosts' sampler's)."""
        return self.bridge is None or self.ahead.trains

    def move(self, tree, shardings):
        """`tree` to `shardings` on the other mesh of a split (`jax.device_put`; across hosts the bridge)."""
        return jax.device_put(tree, shardings) if self.bridge is None else self.bridge.move(tree, shardings)

    def start(self, params, restored: tuple[TrainState, staleness.PolicyLag] | None = None) -> TrainState:
        """The train state the run starts from, `restored` from a checkpoint or fresh from `params` (it
        owns a copy); π_ref is `params` where the plan keeps one, and the lag is the restored one or k
        slots of `params`' copy. Under LoRA `params` is the base (`set_up`'s, warm-started): the state
        takes it as its frozen part, cast to `lora.base_dtype` (the caller lets go of it), with fresh
        adapters or the restored ones; π_ref is then built when needed (`reference_policy`)."""
        if self.built.plan.lora:
            return self._start_lora(params, restored)
        self.reference = params if self.built.plan.reference else None
        shardings = self.lag_shardings()
        if restored is not None:
            state, lag = restored
            self.lag = lag if shardings is None else staleness.PolicyLag(lag.policies, shardings, self.move)
            return state
        state = programs_lib.init_train_state(self.programs, params, self.built.seed)
        self.lag = staleness.PolicyLag.fresh(self.built.rollout.staleness, state.params, shardings, self.move)
        return state

    def lag_shardings(self):
        """Where the lagged policies live: the sampler's mesh when it has its own, else (None) the
        trainer's, beside the parameters. Under LoRA they are adapters: their shardings there."""
        if self.sampler_mesh is None:
            return None
        trained = lora.split(self.programs.policy)[0] if self.built.plan.lora else self.programs.policy
        return sharding_lib.param_shardings(self.sampler_mesh, trained)

    def for_sampler(self, state: TrainState, params) -> nnx.State:
        """The whole policy the sampler draws with, from `params` (the lag's oldest or today's; under LoRA
        adapters). Under LoRA with a sampler mesh of its own it is the base's copy there with the adapters,
        which are all that cross; otherwise `params` goes as it is (the sampler places it)."""
        if self.sampler_base is None:
            return state.with_adapters(params)
        return lora.union(self.sampler_base, jax.device_put(params, self.lag_shardings()))

    def on_trainer(self, state: TrainState, params) -> nnx.State:
        """The whole policy with `params` (a lagged policy; under LoRA adapters) on the trainer's mesh,
        for its scoring: moved there from the sampler's mesh when it has its own (under LoRA only the
        adapters move, to join the state's base)."""
        if self.sampler_mesh is not None:
            params = self.move(params, self.programs.state_shardings.params)
        return state.with_adapters(params)

    def prompts_state(self):
        """The train prompt stream's position as a checkpoint records it: before a rollout drawn ahead."""
        return self.prompts.state() if self.ahead is None else self.ahead.prompts_state()

    def _start_lora(self, params, restored) -> TrainState:
        base = programs_lib.as_base(self.programs, params)
        self.base = checkpoint.base_identity(base, base_source(self.built))
        shardings = self.lag_shardings()  # the adapters' on a sampler mesh of its own, which gets the base once
        if shardings is not None:
            on_sampler = sharding_lib.param_shardings(self.sampler_mesh, lora.split(self.programs.policy)[1])
            self.sampler_base = jax.device_put(base, on_sampler)
        if restored is not None:
            state, lag = restored
            self.lag = lag if shardings is None else staleness.PolicyLag(lag.policies, shardings, self.move)
            return state.replace(frozen=base)
        adapters = programs_lib.init_adapters(self.built, self.programs)
        state = programs_lib.init_train_state(self.programs, adapters, self.built.seed, frozen=base)
        self.lag = staleness.PolicyLag.fresh(self.built.rollout.staleness, state.params, shardings, self.move)
        return state

    def reference_policy(self, state: TrainState) -> nnx.State | None:
        """π_ref's parameters where the plan keeps one: the kept start, or under LoRA the state's base
        with its adapters zero (the base exactly; no second copy of the weights)."""
        if not (self.built.plan.lora and self.built.plan.reference):
            return self.reference
        return state.with_adapters(jax.tree.map(jnp.zeros_like, state.params))

    def abstract_state(self) -> TrainState:
        """The train state's shapes, dtypes and shardings (what a checkpoint restores into, less the
        base: `staleness.saved`)."""
        return programs_lib.abstract_train_state(self.programs, self.programs.policy)


def set_up(built: built_lib.Built, mesh: jax.sharding.Mesh | None = None) -> tuple[RunContext, nnx.State]:
    """The run's context and its policy's initial parameters (on the mesh): the mesh (`built.mesh`'s
    resolved axes unless given), the policy (`programs.init_policy`), its programs (the train step and
    drift compiling in the background), the rollout and the prompt stream. Under LoRA the parameters
    are the base's (the model with LoRA off): the programs and sampler take the adapted policy's shapes."""
    sampler_mesh = None
    if mesh is None:
        mesh, sampler_mesh = overlap.meshes(built)
        sharding_lib.warn_idle_devices(mesh, also=sampler_mesh)
    base_graphdef, params = programs_lib.init_policy(built, mesh)
    graphdef, policy = (base_graphdef, params) if not built.plan.lora else programs_lib.abstract_policy(built)
    programs = programs_lib.compile_programs(built, graphdef, policy, mesh)
    if sampler_mesh is None or hosts.holds(mesh):  # across hosts the sampler's processes never train
        programs = programs_lib.compile_in_background(programs, built, policy)
    rollout = make_rollout(built, graphdef, programs.policy if built.plan.lora else params, sampler_mesh or mesh)
    prompts = prompt_iterator(built.task, seed=built.seed, split="train")
    ctx = RunContext(built, mesh, graphdef, programs, rollout, prompts, base_graphdef=base_graphdef)
    if sampler_mesh is not None:
        ctx.bridge = hosts.Bridge(mesh, sampler_mesh) if hosts.split(mesh, sampler_mesh) else None
        ctx.sampler_mesh, ctx.ahead = sampler_mesh, overlap.RolloutAhead(rollout, prompts, mesh, ctx.bridge)
    return ctx, params


def base_source(built: built_lib.Built) -> str:
    """Where a LoRA run's base comes from, as its checkpoints record it: the Hugging Face checkpoint or
    the random init's seed, and the warm start's cache key when there is one."""
    source = f"hf_checkpoint={built.hf_checkpoint}" if built.hf_checkpoint else f"random init, seed={built.seed}"
    return source + (f"; warm_start_key={built.warm_start_key}" if built.warm_start.steps else "")


def make_rollout(built: built_lib.Built, graphdef, params, mesh: jax.sharding.Mesh) -> Rollout:
    """The run's sampler, at the rollout's precision when it has its own, and the rollout around it."""
    sampler_graphdef, sampler_model = graphdef, built.model
    if built.rollout.dtype:  # the same weights, computed at the sampler's precision
        sampler_model = dataclasses.replace(built.model, dtype=built.rollout.dtype)
        sampler_graphdef = model_lib.abstract_model(sampler_model)[0]
    options = SamplerOptions(
        threads=built.rollout.threads(mesh.devices.size),
        record_gates=built.plan.weight_replay,
        compiler_options=compiles.step_options(built.cpu_fast_compile),
    )
    sampler = Sampler(
        sampler_graphdef,
        sampler_model,
        built.batch_size,
        built.sampler.prompt_len,
        built.sampler.max_new_tokens,
        mesh=mesh,
        state=params,
        options=options,
    )
    return Rollout(sampler, built.task, load_tokenizer(built.tokenizer_path or None), built.rollout)

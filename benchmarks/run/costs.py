"""What the research instruments (drift, the routing split) and PPO's critic cost on the default
config, each measured where it runs."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.run.iterations import median_iteration
from benchmarks.run.shapes import pieces, random_batch, shape_config
from benchmarks.run.step import train_step_time
from benchmarks.run.timing import best_time
from gspo_jax import programs as programs_lib
from gspo_jax import sharding as sharding_lib


def diagnostics_cost(tiny: bool, repeats: int) -> dict:
    """What the research instruments cost on the default config, measured where each one runs: the
    drift pass (its own timer, inside a run with everything on) and the routing split inside the
    train step (the step with and without it, best of many, back to back in this process), against
    the instrumented iteration. Whole runs with everything on and off are kept for context only: on
    a shared 2-core machine their difference swings by ±10% of an iteration from run to run."""
    c = shape_config("tiny" if tiny else "default")
    c.train.update(num_iterations=6 if tiny else 14, eval_every=1000, checkpoint_every=1000)
    out = {}
    for name, on in (("on", True), ("off", False)):
        run = c.copy_and_resolve_references()
        run.train.update(drift_metrics=on, routing_diagnostics=on)
        out[name] = median_iteration(run)
    steps = {}
    for name, on in (("step_with_split", True), ("step_without_split", False)):
        run = c.copy_and_resolve_references()
        run.train.routing_diagnostics = on
        steps[name] = train_step_time(run, max(repeats, 1) * 4)[0]
    updates = c.train.epochs * c.train.minibatches
    split_cost = max(0.0, steps["step_with_split"] - steps["step_without_split"]) * updates
    out.update(steps, updates_per_iteration=updates)
    out["drift_share"] = out["on"]["split"]["drift_seconds"] / out["on"]["seconds"]
    out["split_share"] = split_cost / out["on"]["seconds"]
    out["share"] = out["drift_share"] + out["split_share"]
    return out


def critic_cost(tiny: bool, repeats: int) -> dict:
    """What PPO's critic adds on the default config, measured where it runs: its update inside the
    train step (the same step with and without it, best of many, back to back), its values pass (the
    GAE estimate) against the policy's scoring forward of the same batch, its memory (parameters,
    AdamW moments, the compiled step's temporaries), and whole iterations against the critic-free runs."""
    c = shape_config("tiny" if tiny else "default", "ppo")
    if tiny:  # the PPO run's length below: its programs are then these, loaded from the compilation cache
        c.train.num_iterations = 6
    built, graphdef, params, programs = pieces(c)
    B = built.rollout.num_groups * built.rollout.group_size
    mb = B // c.train.minibatches
    full = random_batch(programs, params, B, c.prompt_len, c.max_new_tokens)
    zeros = jnp.zeros(full.tokens.shape, jnp.float32)
    full = jax.device_put(full.replace(advantages=zeros, values=zeros, returns=zeros), programs.batch_shardings)
    state = programs_lib.init_train_state(programs, params, 0)
    rewards = jnp.asarray(np.random.default_rng(0).random(B) < 0.3, jnp.float32)
    out = {}
    out["estimate_seconds"] = best_time(lambda: programs.estimate(state.critic.params, full, rewards), repeats * 4)
    out["score_seconds"] = best_time(lambda: programs.score(state.policy, full.tokens, full.positions), repeats * 4)
    full, _ = programs.estimate(state.critic.params, full, rewards)
    batch = programs.take(full, np.arange(mb))
    # The run's own step, and the same config's step without the critic (compiled as a run compiles
    # its step: shardings, donation, compile options); the PPO runs below load the first.
    free = programs_lib.compile_programs(dataclasses.replace(built, critic=None), graphdef, params, programs.mesh)
    variants = dict(
        with_critic=(programs.train_step, state, batch),
        without_critic=(free.train_step, state.replace(critic=None), batch.replace(values=None, returns=None)),
    )
    for name, (program, s0, b) in variants.items():
        held = [jax.tree.map(jnp.copy, s0)]
        compiled = program.compile(*sharding_lib.abstract((held[0], b)))  # one compile: timed, its memory read

        def run(compiled=compiled, b=b, held=held):
            held[0], m, _ = compiled(held[0], b)
            return m

        out[f"step_{name}_seconds"] = best_time(run, repeats * 4)
        mem = compiled.executable.memory_analysis()
        out[f"step_{name}_temp_bytes"] = int(getattr(mem, "temp_size_in_bytes", 0)) if mem is not None else 0
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    out.update(
        policy_param_bytes=nbytes(state.policy),
        policy_opt_bytes=nbytes(state.opt_state),
        critic_param_bytes=nbytes(state.critic.params),
        critic_opt_bytes=nbytes(state.critic.opt_state),
        updates_per_iteration=c.train.epochs * c.train.minibatches,
    )
    runs = {}
    for algorithm in ("ppo", "grpo", "gspo"):
        run = shape_config("tiny" if tiny else "default", algorithm)
        # tiny: 6 iterations as the scaling and diagnostics runs, whose compiled GSPO programs (the
        # schedule's length is in them) the persistent compilation cache then serves.
        run.train.update(num_iterations=6 if tiny else 12, eval_every=1000, checkpoint_every=1000)
        runs[algorithm] = median_iteration(run)
    out["iterations"] = runs
    per_iteration = out["updates_per_iteration"] * (
        out["step_with_critic_seconds"] - out["step_without_critic_seconds"]
    )
    out["critic_share"] = (max(per_iteration, 0.0) + out["estimate_seconds"]) / runs["ppo"]["seconds"]
    return out

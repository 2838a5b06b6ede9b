"""The RL iteration against its own parts, in one process: the `loop` section.

It builds a run's pieces as `gspo_jax.run` builds them (mesh, policy, programs with the train step and
drift compiled in the background, the sampler and rollout, the prompt stream, train state, reference
and lagged policies; no warm start, evaluation, checkpoints or logging), runs a few RL iterations
through `iteration.rl_iteration`, and times beside them, on the same parameters:
  decode    the rollout's seconds per decode step; the sampler's, called exactly as the rollout calls
            it (its sampling settings, log-prob and router recording, prefill, host threads: timed in
            the loop by a wrapper, `TimedSampler`); with one host thread where the run has more; and
            the bare decode step at the same batch and cache length (`accelerator.bare_decode_seconds`)
  update    the update's seconds per token in the loop against the isolated train step's, on the
            last minibatch the loop trained on
  drift     its share of an iteration
  start-up  a second build with the persistent compilation cache that the first filled (as a rerun
            of `scripts/train.py --compilation_cache` loads it): its first iteration against a warm one

At real dims on an accelerator (`accelerator.real_dims_config` at `--real-layers`), the `tiny` shape
at `--size tiny`, the `iteration` shape on a CPU otherwise. The first iteration here takes the
sampler's first call (compile or cache load), which a run's step-0 evaluation would take instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time

import jax
import numpy as np
from jax.experimental.compilation_cache import compilation_cache

from benchmarks.run import accelerator
from benchmarks.run.shapes import shape_config
from benchmarks.run.timing import best_time, cold_cache_dir
from gspo_jax import compiles, context
from gspo_jax import iteration as iteration_lib
from gspo_jax import model as model_lib
from gspo_jax.built import build
from gspo_jax.compiles import CompileCounter
from gspo_jax.flops import train_flops

SPLIT = ("rollout_seconds", "logprob_seconds", "update_seconds", "drift_seconds", "iteration_seconds")
ITERATIONS = 3  # the first compiles; the others are the warm ones (6 at tiny: a steadier median)
# The targets: rollout / bare decode step, update / isolated train step per token, drift's
# share of an iteration, the first iteration with a filled compilation cache / a warm one.
TARGETS = dict(decode_ratio=1.3, update_ratio=1.1, drift_share=0.05, first_iteration_ratio=2.0)


def loop_config(tiny: bool, layers: int):
    """The shape the section runs (see the module docstring), evaluation and saves out of the way."""
    if tiny:
        c = shape_config("tiny")
    elif jax.default_backend() != "cpu":
        c = accelerator.real_dims_config(layers=layers)
    else:
        c = shape_config("iteration")
    # tiny: a schedule of 6 iterations (its length is in the train step), as the tiny runs of the
    # sections after this one (`scaling`, `diagnostics`, `critic`): the programs stay loaded for them.
    c.train.update(num_iterations=6 if tiny else ITERATIONS, eval_every=10**6, checkpoint_every=10**6)
    return c


def decode_steps(lengths, max_new_tokens: int, chunk: int) -> int:
    """Decode steps a sampler call ran: to its longest completion (EOS included), in whole chunks of
    `chunk` steps per host round trip, at most `max_new_tokens`."""
    longest = int(np.max(lengths))
    return min(max_new_tokens, -(-longest // chunk) * chunk)


class TimedSampler:
    """The run's sampler, each call timed (results ready: the rollout reads them at once anyway) and
    its decode steps counted; everything else is the sampler's."""

    def __init__(self, sampler):
        self.sampler, self.calls, self.last = sampler, [], None

    def __getattr__(self, name):
        return getattr(self.sampler, name)

    def __call__(self, state, *args, **kwargs):
        t0 = time.perf_counter()
        out = jax.block_until_ready(self.sampler(state, *args, **kwargs))
        seconds = time.perf_counter() - t0
        s = self.sampler
        self.calls.append((seconds, decode_steps(jax.device_get(out.lengths), s.max_new_tokens, s.decode_chunk)))
        self.last = (args, kwargs)  # the state aside: the update donates it
        return out


class RecordingStep:
    """The train step, its last minibatch kept (the step donates its state, not the batch)."""

    def __init__(self, program):
        self.program, self.batch = program, None

    def __call__(self, state, batch):
        self.batch = batch
        return self.program(state, batch)


class Loop:
    """A run's pieces, built as `run._run` builds them (see the module docstring), iterated one
    `rl_iteration` at a time; `rows` holds each iteration's split, sampler calls and compiles."""

    def __init__(self, built):
        self.started = time.perf_counter()
        self.built = built
        ctx, params = context.set_up(built)
        self.step = RecordingStep(ctx.programs.train_step)
        ctx.programs = ctx.programs._replace(train_step=self.step)
        self.sampler = ctx.rollout.sampler = TimedSampler(ctx.rollout.sampler)
        self.state = ctx.start(params)
        self.ctx, self.mesh, self.graphdef = ctx, ctx.mesh, ctx.graphdef
        self.rows: list[dict] = []

    def iterate(self) -> dict:
        counter, calls = CompileCounter(), len(self.sampler.calls)
        self.state, metrics = iteration_lib.rl_iteration(self.ctx, self.state, len(self.rows))
        done = time.perf_counter()
        new = self.sampler.calls[calls:]
        row = {k: float(metrics[k]) for k in SPLIT}
        row.update(
            sampler_seconds=float(sum(s for s, _ in new)),
            decode_steps=int(sum(n for _, n in new)),
            compiles=int(counter.count),
            seconds_since_build=done - self.started,
        )
        self.rows.append(row)
        return row


@contextlib.contextmanager
def persistent_cache(directory: str):
    """JAX's persistent compilation cache in `directory`, set as `scripts/train.py` sets it, with the
    in-memory caches emptied (as a new process has them); the settings before it restored after."""
    keys = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    before = {k: jax.config.values[k] for k in keys}
    compiles.use_persistent_cache(directory)
    compilation_cache.reset_cache()  # JAX opens the cache at the first compile after a reset
    jax.clear_caches()
    try:
        yield
    finally:
        for k, v in before.items():
            jax.config.update(k, v)
        compilation_cache.reset_cache()


def _sampler_seconds_per_step(sampler, params, args, kwargs, repeats: int) -> float:
    """Best seconds per decode step of `sampler` called with a recorded call's arguments."""
    best = float("inf")
    jax.block_until_ready(sampler(params, *args, **kwargs))
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(sampler(params, *args, **kwargs))
        seconds = time.perf_counter() - t0
        steps = decode_steps(jax.device_get(out.lengths), sampler.max_new_tokens, sampler.decode_chunk)
        best = min(best, seconds / steps)
    return best


def _isolated(loop: Loop, repeats: int) -> dict:
    """The parts alone, on the loop's parameters after its iterations."""
    built, sampler = loop.built, loop.sampler.sampler
    B, P, C = sampler.batch_size, sampler.prompt_len, sampler.max_new_tokens
    cfg = sampler.model_cfg
    graphdef = loop.graphdef if not built.rollout.dtype else model_lib.abstract_model(cfg)[0]
    repeats = max(repeats, 3)  # cheap calls: a steadier best
    out = dict(bare_decode_seconds=accelerator.bare_decode_seconds(graphdef, cfg, loop.state.policy, B, P, C, repeats))
    if sampler.threads > 1:  # the same sampler with one host thread: what the run's threads cost or give
        one = dataclasses.replace(built, rollout=dataclasses.replace(built.rollout, sampler_threads=1))
        one = context.make_rollout(one, loop.graphdef, loop.state.policy, loop.mesh).sampler
        args, kwargs = loop.sampler.last
        # Two calls after a warm-up: a whole rollout's decode each (seconds at real dims).
        out["one_thread_sampler_seconds"] = _sampler_seconds_per_step(one, loop.state.policy, args, kwargs, 2)
        del one
    box, batch = [loop.state], loop.step.batch

    def step():
        box[0], metrics, _ = loop.step.program(box[0], batch)
        return metrics

    out["train_step_seconds"] = best_time(step, repeats)
    loop.state = box[0]
    out["train_step_rows"] = int(batch.tokens.shape[0])
    return out


def loop_figures(tiny: bool, repeats: int, layers: int = accelerator.REAL_LAYERS, peak: float = 0.0) -> dict:
    """The section's figures (printed by `print_loop`): `ITERATIONS` iterations and the parts beside
    them, then the start-up with the compilation cache filled. `peak`: the measured bf16 peak, where
    known (the `real` section's), for the update's MFU."""
    c = loop_config(tiny, layers)
    built = build(c)
    kind = jax.devices()[0].device_kind
    with cold_cache_dir(tiny) as cache_dir, persistent_cache(cache_dir):
        loop = Loop(built)
        for _ in range(6 if tiny else ITERATIONS):
            loop.iterate()
        rows = loop.rows
        isolated = _isolated(loop, repeats)
        s = loop.sampler.sampler
        threads, chunk = s.threads, s.decode_chunk
        del loop, s
        gc.collect()  # the first build's parameters and state go before the second's come
        jax.clear_caches()  # as a new process: every program traced again, compiled ones loaded from the cache
        again = Loop(built)
        again.iterate()
        restart = again.rows[0]
        del again
        gc.collect()
    warm = {k: float(np.median([r[k] for r in rows[1:]])) for k in (*SPLIT, "sampler_seconds", "decode_steps")}
    B, T = built.batch_size, built.sampler.seq_len
    t = built.train
    mb = B // t.minibatches
    steps = warm["decode_steps"]
    decode = dict(
        steps_per_rollout=steps,
        rollout_ms_per_step=warm["rollout_seconds"] / steps * 1e3,
        sampler_ms_per_step=warm["sampler_seconds"] / steps * 1e3,
        bare_ms_per_step=isolated["bare_decode_seconds"] * 1e3,
        sampler_threads=threads,
        decode_chunk=chunk,
    )
    if "one_thread_sampler_seconds" in isolated:
        decode["one_thread_sampler_ms_per_step"] = isolated["one_thread_sampler_seconds"] * 1e3
    step_flops = train_flops(built.model, mb, T)
    loop_seconds_per_step = warm["update_seconds"] / (t.epochs * t.minibatches)
    update = dict(
        loop_us_per_token=warm["update_seconds"] / (t.epochs * B * T) * 1e6,
        isolated_us_per_token=isolated["train_step_seconds"] / (mb * T) * 1e6,
        isolated_step_seconds=isolated["train_step_seconds"],
        steps_per_iteration=t.epochs * t.minibatches,
        loop=accelerator.throughput(step_flops, loop_seconds_per_step, peak, kind),
        isolated=accelerator.throughput(step_flops, isolated["train_step_seconds"], peak, kind),
    )
    first = dict(
        cold_first_iteration_seconds=rows[0]["iteration_seconds"],
        cold_seconds_to_first_iteration=rows[0]["seconds_since_build"],
        cached_first_iteration_seconds=restart["iteration_seconds"],
        cached_seconds_to_first_iteration=restart["seconds_since_build"],
        cached_compiles=restart["compiles"],
    )
    return dict(
        shape="tiny" if tiny else "real" if jax.default_backend() != "cpu" else "iteration",
        layers=built.model.num_layers,
        batch=B,
        prompt=built.sampler.prompt_len,
        new_tokens=built.sampler.max_new_tokens,
        minibatches=t.minibatches,
        epochs=t.epochs,
        drift_subsample=t.drift_subsample,
        iterations=rows,
        warm=warm,
        compiles_after_warmup=int(sum(r["compiles"] for r in rows[1:])),
        decode=decode,
        update=update,
        startup=first,
        decode_ratio=decode["rollout_ms_per_step"] / decode["bare_ms_per_step"],
        update_ratio=update["loop_us_per_token"] / update["isolated_us_per_token"],
        drift_share=warm["drift_seconds"] / warm["iteration_seconds"],
        first_iteration_ratio=restart["iteration_seconds"] / warm["iteration_seconds"],
        targets=TARGETS,
    )


def print_loop(r: dict) -> None:
    """The section's lines: the iteration, then each ratio on its own line beside its target."""
    w, d, u, s = r["warm"], r["decode"], r["update"], r["startup"]
    kind = jax.devices()[0].device_kind
    name = f"{r['shape']} shape, {r['layers']} layers"
    print(
        f"loop [{name}], {r['batch']} x ({r['prompt']} + {r['new_tokens']}) tokens, {r['minibatches']} minibatches: "
        f"iteration {w['iteration_seconds']:.3f} s (rollout {w['rollout_seconds']:.3f}, log-probs "
        f"{w['logprob_seconds']:.3f}, update {w['update_seconds']:.3f}, drift {w['drift_seconds']:.3f}); "
        f"compiles after the first {r['compiles_after_warmup']}"
    )
    one = d.get("one_thread_sampler_ms_per_step")
    one = f"; with 1 thread {one:.3f} ms" if one is not None else ""
    print(
        f"loop decode [{name}]: {d['steps_per_rollout']:.0f} steps per rollout; rollout {d['rollout_ms_per_step']:.3f} "
        f"ms per step, its sampler as called {d['sampler_ms_per_step']:.3f} ms ({d['sampler_threads']} threads, "
        f"chunks of {d['decode_chunk']}{one}), the bare step {d['bare_ms_per_step']:.3f} ms at batch {r['batch']}, "
        f"{r['prompt'] + r['new_tokens']} cache slots: rollout / bare {r['decode_ratio']:.2f}x "
        f"(target <= {TARGETS['decode_ratio']}x)"
    )
    tflops = f"{u['loop']['tflops_per_s']:.3g} vs {u['isolated']['tflops_per_s']:.3g} TFLOP/s"
    print(
        f"loop update [{name}]: {u['loop_us_per_token']:.2f} us per token in the loop, "
        f"{u['isolated_us_per_token']:.2f} in the isolated train step ({tflops}; "
        f"{accelerator.mfu_text(u['loop'], kind)} in the loop): {r['update_ratio']:.2f}x "
        f"(target <= {TARGETS['update_ratio']}x)"
    )
    print(
        f"loop drift [{name}]: {w['drift_seconds']:.3f} s of a {w['iteration_seconds']:.3f} s iteration (1 sequence "
        f"in {r['drift_subsample']}): {r['drift_share']:.1%} (target <= {TARGETS['drift_share']:.0%})"
    )
    print(
        f"loop start-up [{name}], compilation cache filled: first iteration "
        f"{s['cached_first_iteration_seconds']:.2f} s ({s['cached_seconds_to_first_iteration']:.2f} s from the "
        f"build's start; empty cache {s['cold_first_iteration_seconds']:.2f} s, "
        f"{s['cold_seconds_to_first_iteration']:.2f} s), a warm one {w['iteration_seconds']:.3f} s: "
        f"{r['first_iteration_ratio']:.2f}x (target <= {TARGETS['first_iteration_ratio']}x)"
    )

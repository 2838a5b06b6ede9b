"""The main job, `train_and_evaluate`: a run in its workdir. It sets the run's pieces up (`context.set_up`:
the policy, its programs, the sampler and rollout), warm-starts, then loops `iteration.rl_iteration` with
evaluation, logging and checkpoints, resuming from the workdir's latest good checkpoint (the lagged
policies of `rollout.staleness` included) and stopping cleanly on SIGTERM / SIGINT."""

from __future__ import annotations

import contextlib
import functools
import signal
import time
from pathlib import Path

import jax

from gspo_jax import built as built_lib
from gspo_jax import context, multihost, plots, provenance, staleness, trackers
from gspo_jax import iteration as iteration_lib
from gspo_jax import workdir as workdir_lib
from gspo_jax.checkpoint import Checkpointer, PreemptionGuard, check_base, resume
from gspo_jax.compiles import CompileCounter
from gspo_jax.evaluate import evaluate
from gspo_jax.progress import Progress
from gspo_jax.validation import ConfigError
from gspo_jax.warm_start import warm_start
from gspo_jax.writers import MetricWriter


class StoppedEarly(Exception):
    """The run stopped at an iteration boundary on SIGTERM or SIGINT, after saving a checkpoint;
    running it again resumes there. `scripts/train.py` exits with `exit_codes.EXIT_STOPPED` for it."""

    def __init__(self, signum: int, iteration: int):
        self.signum, self.iteration = signum, iteration
        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name} after iteration {iteration}; checkpoint saved, rerun to resume")


def train_and_evaluate(
    built: built_lib.Built,
    workdir: str | Path,
    *,
    progress: bool = True,
    log_every: int = 1,
    allow_config_change: bool = False,
) -> dict[str, float]:
    """The main job of a built config (`built.build`): warm start, then RL iterations with evaluation,
    logging and checkpoints, resuming from the workdir's latest good checkpoint. One run per workdir (a
    lock), and only with the config the workdir was started with (`workdir.RESUMABLE_KEYS` aside) unless
    `allow_config_change`.
    SIGTERM / SIGINT save a checkpoint at the next iteration boundary and raise `StoppedEarly`.
    Progress goes to stderr: a bar on a terminal, else one line every `log_every` iterations.
    With several processes (`multihost.initialize`) every process calls this with the same arguments;
    the mesh spans every process's devices (`build` refuses one that does not). Returns the last
    iteration's metrics ({} when nothing was left to do)."""
    workdir, is_main = Path(workdir), jax.process_index() == 0
    changes = workdir_lib.check_config(workdir, built.config_json, allow_change=allow_config_change)  # reads only
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"workdir {str(workdir)!r} cannot be created: {e.strerror}") from None
    with workdir_lib.Lock(workdir) if is_main else contextlib.nullcontext():
        if is_main:
            workdir_lib.record_config(workdir, built.config_json, changes)
            provenance.record(workdir)  # where this start ran: host, devices, versions, commit
        return _run(built, workdir, progress=progress, log_every=log_every)


def _run(built: built_lib.Built, workdir: Path, *, progress: bool, log_every: int) -> dict[str, float]:
    train, is_main = built.train, jax.process_index() == 0
    ctx, params = context.set_up(built)
    evaluation = functools.partial(evaluate, ctx.rollout, seed=built.seed + 1, num_batches=train.eval_batches)

    def evaluate_and_log(step: int, state) -> dict[str, float]:  # today's policy, where the sampler reads it
        policy = ctx.for_sampler(state, state.params)
        if ctx.ahead is not None:  # the sampler evaluates once the next batch, drawn ahead, is done
            metrics, samples = ctx.ahead.evaluate(evaluation, policy, ctx.lag_shardings())
        else:
            metrics, samples = evaluation(policy)
        writer.write_samples(step, samples)
        return metrics

    keep, every = train.keep_checkpoints, train.checkpoint_every
    ckpt = Checkpointer(workdir / "checkpoints", max_to_keep=keep, save_every=every, bridge=ctx.bridge)
    closing = contextlib.closing(ctx.ahead) if ctx.ahead is not None else contextlib.nullcontext()
    tracked = trackers.open_trackers(built.logging, workdir, built.config_json, built.seed) if is_main else []
    with closing, ckpt, MetricWriter(workdir, trackers=tracked) as writer, PreemptionGuard(sigint=True) as guard:
        abstract = ctx.abstract_state()
        k = built.rollout.staleness  # its lagged policies are checkpointed beside the train state
        restored = resume(ckpt, staleness.abstract(abstract, k), ctx.prompts, with_meta=True)  # before any work
        params, warm_start_info = warm_start(  # under LoRA the base, trained as the model without adapters
            built, ctx.base_graphdef, params, mesh=ctx.mesh, rollout=ctx.rollout, workdir=workdir, bridge=ctx.bridge
        )
        start = restored[0] if restored else 0
        state = ctx.start(params, staleness.restored(restored[1], abstract) if restored else None)
        del params  # the state owns its copy (under LoRA it is the state's base); π_ref: `ctx.reference_policy`
        if restored and ctx.base is not None:  # adapters resume only on the base they were trained on
            check_base(restored[2].get("base"), ctx.base)
        if is_main:  # rows past the restored step were logged by work the resumed run redoes
            workdir_lib.drop_rows_after(workdir, start if restored else -1)
        if not restored:
            info = {k: float(v) for k, v in warm_start_info.items()}
            writer.write(0, {**evaluate_and_log(0, state), **info})
        last: dict[str, float] = {}
        bar = Progress(train.num_iterations, start, built.algorithm, every=log_every, enabled=progress)
        for it in range(start, train.num_iterations):
            counter = CompileCounter()  # logged as xla_compiles: 0 after the first iteration
            state, metrics = iteration_lib.rl_iteration(ctx, state, it)
            t0 = time.perf_counter()
            if (it + 1) % train.eval_every == 0 or it + 1 == train.num_iterations:
                metrics.update(evaluate_and_log(it + 1, state), eval_seconds=time.perf_counter() - t0)
            metrics["xla_compiles"] = float(counter.count)
            if (loads := metrics.pop("expert_loads", None)) is not None:
                writer.write_routing(it + 1, loads)
            writer.write(it + 1, metrics)  # before the save: a step is never checkpointed without its row
            last = metrics
            meta = dict(iteration=it, prompts=ctx.prompts_state()) | ({"base": ctx.base} if ctx.base else {})
            stop = multihost.any_process(guard.requested)  # a signal may reach only some hosts
            ckpt.save(it + 1, staleness.saved(state, ctx.lag), meta, force=stop or it + 1 == train.num_iterations)
            bar.update(metrics)
            if stop and it + 1 < train.num_iterations:  # a stop during the last iteration: the run has finished
                bar.close()
                raise StoppedEarly(guard.signum or signal.SIGTERM, it)
        bar.close()
    if is_main and start < train.num_iterations:
        plots.plot_run(workdir)
    return last

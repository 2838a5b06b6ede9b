"""The main job, `train_and_evaluate`: a run in its workdir. It builds the run's pieces (the policy,
its programs, the sampler and rollout), warm-starts, then loops `iteration.rl_iteration` with evaluation,
logging and checkpoints, resuming from the workdir's latest good checkpoint (the lagged policies of
`rollout.staleness` included) and stopping cleanly on SIGTERM / SIGINT."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import signal
import time
from pathlib import Path

import jax

from gspo_jax import compiles, multihost, plots, staleness
from gspo_jax import config as config_lib
from gspo_jax import iteration as iteration_lib
from gspo_jax import model as model_lib
from gspo_jax import programs as programs_lib
from gspo_jax import sharding as sharding_lib
from gspo_jax import workdir as workdir_lib
from gspo_jax.checkpoint import Checkpointer, PreemptionGuard, resume
from gspo_jax.compiles import CompileCounter
from gspo_jax.evaluate import evaluate
from gspo_jax.progress import Progress
from gspo_jax.rollout import Rollout
from gspo_jax.sampler import Sampler
from gspo_jax.tasks import load_tokenizer, prompt_iterator
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
    built: config_lib.Built,
    workdir: str | Path,
    *,
    progress: bool = True,
    log_every: int = 1,
    allow_config_change: bool = False,
) -> dict[str, float]:
    """The main job of a built config (`config.build`): warm start, then RL iterations with evaluation,
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
        return _run(built, workdir, progress=progress, log_every=log_every)


def make_rollout(built: config_lib.Built, graphdef, params, mesh: jax.sharding.Mesh) -> Rollout:
    """The run's sampler, at the rollout's precision when it has its own, and the rollout around it."""
    sampler_graphdef, sampler_model = graphdef, built.model
    if built.rollout.dtype:  # the same weights, computed at the sampler's precision
        sampler_model = dataclasses.replace(built.model, dtype=built.rollout.dtype)
        sampler_graphdef = model_lib.abstract_model(sampler_model)[0]
    sampler = Sampler(
        sampler_graphdef,
        sampler_model,
        built.batch_size,
        built.sampler.prompt_len,
        built.sampler.max_new_tokens,
        mesh=mesh,
        state=params,
        threads=built.rollout.threads(mesh.devices.size),
        compiler_options=compiles.step_options(built.cpu_fast_compile),
        record_gates=built.train.routing_replay == "R3W",
    )
    return Rollout(sampler, built.task, load_tokenizer(built.tokenizer_path or None), built.rollout)


def _run(built: config_lib.Built, workdir: Path, *, progress: bool, log_every: int) -> dict[str, float]:
    t, is_main = built.train, jax.process_index() == 0
    mesh = sharding_lib.make_mesh(**built.mesh.axes())  # the run's one mesh: `build` resolved its sizes
    sharding_lib.warn_idle_devices(mesh)  # after every refusal: a refused run still prints one line
    graphdef, params = programs_lib.init_policy(built, mesh)
    programs = programs_lib.compile_programs(built, graphdef, params, mesh)
    programs = programs_lib.compile_in_background(programs, built, params)
    rollout = make_rollout(built, graphdef, params, mesh)
    evaluation = functools.partial(evaluate, rollout, seed=built.seed + 1, num_batches=t.eval_batches)

    def evaluate_and_log(step: int, params) -> dict[str, float]:
        metrics, samples = evaluation(params)
        writer.write_samples(step, samples)
        return metrics

    prompts = prompt_iterator(built.task, seed=built.seed, split="train")
    ckpt = Checkpointer(workdir / "checkpoints", max_to_keep=t.keep_checkpoints, save_every=t.checkpoint_every)
    with ckpt, MetricWriter(workdir) as writer, PreemptionGuard(sigint=True) as guard:
        abstract = programs_lib.abstract_train_state(programs, params)
        k = built.rollout.staleness  # its lagged policies are checkpointed beside the train state
        restored = resume(ckpt, staleness.abstract(abstract, k), prompts)  # before any work
        params, warm_start_info = warm_start(built, graphdef, params, mesh=mesh, rollout=rollout, workdir=workdir)
        kl_reward = built.critic is not None and built.critic.kl_reward_coef > 0
        ref_params = params if built.loss.kl_coef > 0 or kl_reward else None
        if restored:
            start, (state, lag) = restored[0], staleness.restored(restored[1], abstract)
        else:
            start, state = 0, programs_lib.init_train_state(programs, params, built.seed)
            lag = staleness.PolicyLag.fresh(k, state.params)  # k slots, all the warm start
        if is_main:  # rows past the restored step were logged by work the resumed run redoes
            workdir_lib.drop_rows_after(workdir, start if restored else -1)
        if not restored:
            info = {k: float(v) for k, v in warm_start_info.items()}
            writer.write(0, {**evaluate_and_log(0, state.params), **info})
        last: dict[str, float] = {}
        bar = Progress(t.num_iterations, start, built.algorithm, every=log_every, enabled=progress)
        for it in range(start, t.num_iterations):
            counter = CompileCounter()  # logged as xla_compiles: 0 after the first iteration
            state, metrics = iteration_lib.rl_iteration(programs, rollout, t, state, prompts, it, ref_params, lag)
            t0 = time.perf_counter()
            if (it + 1) % t.eval_every == 0 or it + 1 == t.num_iterations:
                metrics.update(evaluate_and_log(it + 1, state.params), eval_seconds=time.perf_counter() - t0)
            metrics["xla_compiles"] = float(counter.count)
            if (loads := metrics.pop("expert_loads", None)) is not None:
                writer.write_routing(it + 1, loads)
            writer.write(it + 1, metrics)  # before the save: a step is never checkpointed without its row
            last = metrics
            meta = dict(iteration=it, prompts=prompts.state())
            stop = multihost.any_process(guard.requested)  # a signal may reach only some hosts
            ckpt.save(it + 1, staleness.saved(state, lag), meta, force=stop or it + 1 == t.num_iterations)
            bar.update(metrics)
            if stop and it + 1 < t.num_iterations:  # a stop during the last iteration: the run has finished
                bar.close()
                raise StoppedEarly(guard.signum or signal.SIGTERM, it)
        bar.close()
    if is_main and start < t.num_iterations:
        plots.plot_run(workdir)
    return last

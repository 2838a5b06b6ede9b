"""Supervised warm start: a few hundred steps of cross-entropy on the task's demonstrations, so RL
starts from a policy that solves some prompts (a random one never earns a reward). Its optimizer
comes from `config.warm_start`; the result is cached in the workdir (or `warm_start.cache_dir`)
through the project's checkpoint module, keyed by everything that determines it
(`config.warm_start_key`, taken at the build).
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gspo_jax import built as built_lib
from gspo_jax import compiles, hosts
from gspo_jax import model as model_lib
from gspo_jax import optimizer as optimizer_lib
from gspo_jax import sharding as sharding_lib
from gspo_jax.checkpoint import Checkpointer
from gspo_jax.rollout import Rollout
from gspo_jax.tasks import prompt_iterator
from gspo_jax.workdir import Lock


def sft_step(graphdef, tx, schedule, params, opt_state, tokens_BT, positions_BT, mask_BT):
    """One supervised step: mean token cross-entropy on the demonstration tokens (+ MoE aux losses)."""

    def loss_fn(p):
        logp_BT, aux = model_lib.logprobs(graphdef, p, tokens_BT, positions_BT)
        return -jnp.sum(logp_BT * mask_BT) / jnp.maximum(jnp.sum(mask_BT), 1.0) + aux.aux_loss

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params, schedule=schedule)
    return optax.apply_updates(params, updates), opt_state, loss


def warm_start(
    built: built_lib.Built, graphdef, params, *, mesh, rollout: Rollout, workdir: Path, bridge=None
) -> tuple[Any, dict[str, float]]:
    """The warm-started parameters (sharded like `params`) and what to log about it; from the cache
    (named by `built.warm_start_key`) when an identical warm start already ran (`bridge`: a split over
    hosts', `checkpoint.Checkpointer`).
    `warm_start.steps = 0` returns `params` as they are."""
    w = built.warm_start
    if w.steps == 0:
        return params, {}
    abstract = sharding_lib.abstract(params)
    cache = Path(w.cache_dir or workdir) / f"warm_start_{built.warm_start_key}"
    cache.parent.mkdir(parents=True, exist_ok=True)
    # Runs sharing a cache (a sweep's) take turns: the first trains and saves, the others wait and
    # restore. One process only: on several, every process must take part in the training steps.
    turn = Lock(cache.parent, f".{cache.name}.lock", wait=True) if jax.process_count() == 1 else None
    with turn or contextlib.nullcontext(), Checkpointer(cache, max_to_keep=1, async_save=False, bridge=bridge) as ckpt:
        restored = ckpt.restore_latest(abstract)
        if restored is not None:
            _, params, info = restored
            return params, {**info, "warm_start_cached": 1.0}
        if bridge is None or hosts.holds(mesh):
            params, info = train_on_demonstrations(built, graphdef, params, mesh=mesh, rollout=rollout)
        else:  # the sampler's processes of a split over hosts: the trainer's devices train, none of theirs
            info = dict(sft_loss_first=float("nan"), sft_loss_last=float("nan"), sft_steps=w.steps)
        ckpt.save(w.steps, params, info, force=True)
    return params, info


def demonstration_ids(ids: list[int], eos: int, budget: int) -> list[int]:
    """A demonstration's tokens then EOS, cut to the completion budget. One that does not fit is cut
    without an EOS, as the sampler cuts a completion: the policy learns that such answers run past the
    budget (truncated in rollouts, where overlong filtering and shaping act), not that a cut answer is
    complete."""
    return (list(ids) + [eos])[:budget]


def train_on_demonstrations(
    built: built_lib.Built, graphdef, params, *, mesh, rollout: Rollout
) -> tuple[Any, dict[str, float]]:
    """`warm_start.steps` supervised steps on batches of (prompt, demonstration + EOS)."""
    w, task, tokenizer = built.warm_start, rollout.task, rollout.tokenizer
    tx = optimizer_lib.make_optimizer(w.optimizer.rule)
    param_sh = jax.tree.map(lambda x: x.sharding, params)
    opt_sh = optimizer_lib.state_shardings(tx, params, param_sh, mesh)
    opt_state = optimizer_lib.init_state(tx, params, param_sh, opt_sh)
    b2 = sharding_lib.batch_sharding(mesh, 2)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    schedule = w.optimizer.schedule(w.steps)  # host scalars, placed by in_shardings
    step = jax.jit(
        sharding_lib.under_mesh(functools.partial(sft_step, graphdef, tx), mesh),
        donate_argnums=(1, 2),
        in_shardings=(rep, param_sh, opt_sh, b2, b2, b2),
        out_shardings=(param_sh, opt_sh, rep),
        compiler_options=compiles.step_options(built.cpu_fast_compile),
    )
    it = prompt_iterator(task, seed=built.seed + 2, split="train")
    C, eos = built.sampler.max_new_tokens, tokenizer.eos_token_id
    sft_losses = []
    for _ in range(w.steps):
        examples = it.next_batch(w.batch_size)
        prompt_BP, pmask_BP = rollout.encode_prompts([e.prompt for e in examples])
        comp_BC = np.zeros((w.batch_size, C), np.int32)
        cmask_BC = np.zeros((w.batch_size, C), bool)
        for i, e in enumerate(examples):
            ids = demonstration_ids(tokenizer.encode(task.demonstration(e), add_special_tokens=False), eos, C)
            comp_BC[i, : len(ids)], cmask_BC[i, : len(ids)] = ids, True
        tokens_BT = np.concatenate([prompt_BP, comp_BC], 1)
        pm_BT = np.concatenate([pmask_BP, np.zeros_like(cmask_BC)], 1)
        cm_BT = np.concatenate([np.zeros_like(pmask_BP), cmask_BC], 1)
        positions_BT = np.asarray(model_lib.positions_from_mask(jnp.asarray(pm_BT | cm_BT)))
        # Host arrays, the same on every process: each places its devices' rows.
        batch = jax.device_put((tokens_BT, positions_BT, cm_BT.astype(np.float32)), b2)
        params, opt_state, loss = step(schedule, params, opt_state, *batch)
        sft_losses.append(float(loss))
    info = dict(sft_loss_first=sft_losses[0], sft_loss_last=float(np.mean(sft_losses[-10:])), sft_steps=w.steps)
    return params, info

"""The RL trainer: a jitted, sharded `train_step`, the supervised warm start, and the loop.

One iteration: rollout with π_old → old log-probs (the sampler's, or the trainer's recomputation; the
max difference is logged) → ref log-probs when kl_coef > 0 → `epochs` × `minibatches` shuffled
minibatches of `train_step` → routing drift of the updated policy against π_old → metrics → checkpoint.
Every jitted function has fixed shapes and compiles once per run.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from gspo_jax import config as config_lib
from gspo_jax import losses, routing
from gspo_jax import model as model_lib
from gspo_jax import sharding as sharding_lib
from gspo_jax.compiles import CompileCounter
from gspo_jax.rollout import Rollout, RolloutBatch
from gspo_jax.sampler import Sampler, sequence_logprobs
from gspo_jax.tasks import load_tokenizer, prompt_iterator

log = logging.getLogger(__name__)
P_ = jax.sharding.PartitionSpec


# ---------------------------------------------------------------------------------------------- pieces


def make_optimizer(t: ml_collections.ConfigDict, total_steps: int) -> optax.GradientTransformation:
    """AdamW with linear warmup then cosine decay to end_lr_factor·lr, after global-norm clipping."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0,
        t.learning_rate,
        max(t.warmup_steps, 1),
        max(total_steps, t.warmup_steps + 1),
        end_value=t.learning_rate * t.end_lr_factor,
    )
    return optax.chain(
        optax.clip_by_global_norm(t.max_grad_norm), optax.adamw(schedule, b1=t.b1, b2=t.b2, weight_decay=t.weight_decay)
    )


def positions_of(prompt_mask, completion_mask):
    return model_lib.positions_from_mask(jnp.asarray(prompt_mask) | jnp.asarray(completion_mask))


def _where_tree(pred, new, old):
    return jax.tree.map(lambda n, o: jnp.where(pred, n, o), new, old)


def train_step(
    graphdef,
    loss_cfg: losses.LossConfig,
    tx,
    temperature: float,
    replay: bool,
    microbatches: int,
    state: dict,
    batch: dict,
) -> tuple[dict, dict]:
    """One optimizer update on one minibatch, accumulated over `microbatches` with the minibatch's
    loss denominator, so the policy loss and its gradient equal the full minibatch's. (The MoE
    load-balancing and z losses are batch statistics, computed per micro-batch as everywhere.)
    A non-finite loss or gradient leaves the state untouched and is counted in `skipped`."""
    denom = losses.loss_denominator(loss_cfg, batch["loss_mask"])
    split = lambda x: x.reshape(microbatches, x.shape[0] // microbatches, *x.shape[1:])  # noqa: E731
    micro = {
        k: (jnp.moveaxis(split(jnp.moveaxis(v, 1, 0)), 1, 2) if k == "topk" else split(v)) for k, v in batch.items()
    }

    def loss_fn(params, mb):
        logits, aux = model_lib.apply(
            graphdef, params, mb["tokens"], mb["positions"], forced_topk=mb["topk"] if replay else None
        )
        logp = sequence_logprobs(logits, mb["tokens"], temperature)
        ref = mb["ref_logp"] if loss_cfg.kl_coef > 0 else None
        loss, metrics = losses.policy_loss(
            loss_cfg, logp, mb["old_logp"], mb["advantages"], mb["loss_mask"], ref, denominator=denom
        )
        metrics.update(lb_loss=aux.lb_loss, z_loss=aux.z_loss)
        return loss + aux.aux_loss / microbatches, metrics

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def accumulate(carry, mb):
        (loss, metrics), grads = grad_fn(state["params"], mb)
        g_acc, l_acc = carry
        return (jax.tree.map(jnp.add, g_acc, grads), l_acc + loss), metrics

    zeros = jax.tree.map(jnp.zeros_like, state["params"])
    (grads, loss), metrics = jax.lax.scan(accumulate, (zeros, jnp.zeros((), jnp.float32)), micro)
    # Loss terms already carry the minibatch denominator, so they add up; diagnostics are averaged.
    additive = ("loss", "policy_loss", "kl_loss")
    metrics = {k: (jnp.sum(v) if k in additive else jnp.mean(v)) for k, v in metrics.items()}
    grad_norm = optax.global_norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    new = dict(
        step=state["step"] + ok.astype(jnp.int32),
        params=_where_tree(ok, params, state["params"]),
        opt_state=_where_tree(ok, opt_state, state["opt_state"]),
        rng=state["rng"],
    )
    metrics.update(total_loss=loss, grad_norm=grad_norm, skipped=(~ok).astype(jnp.float32))
    return new, metrics


def score(graphdef, temperature: float, params, tokens, positions, forced_topk=None):
    """log-probs of the given tokens (aligned to positions) and the router top-k, without gradients."""
    logits, aux = model_lib.apply(graphdef, params, tokens, positions, forced_topk=forced_topk)
    return sequence_logprobs(logits, tokens, temperature), aux.topk


def sft_step(graphdef, tx, params, opt_state, tokens, positions, mask):
    """One supervised step: mean token cross-entropy on the demonstration tokens."""

    def loss_fn(p):
        logits, aux = model_lib.apply(graphdef, p, tokens, positions)
        logp = sequence_logprobs(logits, tokens)
        return -jnp.sum(logp * mask) / jnp.maximum(jnp.sum(mask), 1.0) + aux.aux_loss

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


# ---------------------------------------------------------------------------------------------- trainer


def _resolve_mesh(m) -> jax.sharding.Mesh:
    sizes = dict(data=m.data, fsdp=m.fsdp, expert=m.expert, tensor=m.tensor)
    known = int(np.prod([v for v in sizes.values() if v != -1]))
    for k, v in sizes.items():
        if v == -1:
            sizes[k] = jax.device_count() // known
    if int(np.prod(list(sizes.values()))) > jax.device_count():
        raise ValueError(f"config.mesh {sizes} needs more than the {jax.device_count()} devices present")
    return sharding_lib.make_mesh(**sizes, devices=jax.devices()[: int(np.prod(list(sizes.values())))])


class Trainer:
    """Holds the compiled functions and the run's state; `run()` is the main job."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str | Path):
        self.config, self.workdir = config, Path(workdir)
        self.built = config_lib.build(config)
        c, b = config, self.built
        self.mesh = _resolve_mesh(c.mesh)
        self.tokenizer = load_tokenizer(c.tokenizer_path or None)
        if c.hf_checkpoint:
            from gspo_jax import hf

            _, self.graphdef, params = hf.load_hf_checkpoint(
                c.hf_checkpoint, dtype=b.model.param_dtype, dispatch=b.model.dispatch, mesh=self.mesh
            )
        else:
            self.graphdef, params = nnx.split(model_lib.Transformer(b.model, rngs=nnx.Rngs(c.seed)))
        self.param_sh = sharding_lib.param_shardings(self.mesh, params)
        self.params0 = jax.device_put(params, self.param_sh)
        self.batch_size = b.rollout.num_groups * b.rollout.group_size
        self.mb_size = self.batch_size // c.train.minibatches
        steps = c.train.num_iterations * c.train.epochs * c.train.minibatches
        self.tx = make_optimizer(c.train, steps)
        self.temperature = float(b.rollout.temperature) or 1.0  # greedy rollouts score at temperature 1
        self.sampler = Sampler(
            self.graphdef,
            b.model,
            self.batch_size,
            c.prompt_len,
            c.max_new_tokens,
            max_top_k=64,
            mesh=self.mesh,
            state=params,
        )
        self.rollout = Rollout(self.sampler, b.task, self.tokenizer, b.rollout)
        self._compile(params)

    # -- compiled functions, explicit shardings, state donated
    def _compile(self, params):
        c, b, mesh = self.config, self.built, self.mesh
        rep = jax.sharding.NamedSharding(mesh, P_())
        opt_abstract = jax.eval_shape(self.tx.init, params)
        self.opt_sh = sharding_lib.opt_state_shardings(mesh, opt_abstract, self.param_sh)
        self.state_sh = dict(step=rep, params=self.param_sh, opt_state=self.opt_sh, rng=rep)
        bs = lambda nd: sharding_lib.batch_sharding(mesh, nd)  # noqa: E731
        topk_sh = jax.sharding.NamedSharding(mesh, P_(None, *bs(2).spec))
        self.batch_sh = dict(
            tokens=bs(2),
            positions=bs(2),
            loss_mask=bs(2),
            old_logp=bs(2),
            ref_logp=bs(2),
            advantages=bs(1),
            topk=topk_sh,
        )
        step = functools.partial(
            train_step,
            self.graphdef,
            b.loss,
            self.tx,
            self.temperature,
            c.train.routing_replay != "none",
            c.train.microbatches,
        )
        self.train_step = jax.jit(
            step, in_shardings=(self.state_sh, self.batch_sh), out_shardings=(self.state_sh, None), donate_argnums=(0,)
        )
        sc = functools.partial(score, self.graphdef, self.temperature)
        self.score = jax.jit(sc, in_shardings=(self.param_sh, bs(2), bs(2)), out_shardings=(bs(2), topk_sh))
        self.score_replay = jax.jit(
            sc, in_shardings=(self.param_sh, bs(2), bs(2), topk_sh), out_shardings=(bs(2), topk_sh)
        )
        self.init_opt = jax.jit(self.tx.init, in_shardings=(self.param_sh,), out_shardings=self.opt_sh)
        self.rep, self.bs = rep, bs
        self.copy_params = jax.jit(
            lambda p: jax.tree.map(jnp.copy, p), in_shardings=(self.param_sh,), out_shardings=self.param_sh
        )

    def init_state(self, params) -> dict:
        """A fresh train state on the mesh (as train_step's outputs are). It owns a copy of `params`:
        train_step donates its state, and the caller's params may still be needed (the reference)."""
        rng = jax.random.key_data(jax.random.key(self.config.seed))
        params = self.copy_params(params)
        state = dict(step=jnp.zeros((), jnp.int32), params=params, opt_state=self.init_opt(params), rng=rng)
        return jax.device_put(state, self.state_sh)

    # -- one RL iteration
    def iteration(self, state: dict, prompts, iteration: int, ref_params=None) -> tuple[dict, dict]:
        c, b = self.config, self.built
        key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), iteration)
        t0 = time.perf_counter()
        batch, metrics = self.rollout(state["params"], prompts, jax.random.fold_in(key, 0))
        t_roll = time.perf_counter() - t0
        tokens, positions = jax.device_put(
            (batch.tokens, positions_of(batch.prompt_mask, batch.completion_mask)), self.bs(2)
        )
        logp_tr, topk_tr = self.score(state["params"], tokens, positions)
        cm = np.asarray(batch.completion_mask)
        diff = np.abs(np.asarray(logp_tr) - batch.old_logp)[cm]
        metrics["old_logp_max_diff"] = float(diff.max()) if diff.size else 0.0
        old_logp = logp_tr if c.train.old_logp_source == "trainer" else jnp.asarray(batch.old_logp)
        ref_logp = jnp.zeros_like(old_logp)
        if b.loss.kl_coef > 0:
            ref_logp, _ = self.score(ref_params, tokens, positions)
        topk = {"none": topk_tr, "R2": topk_tr, "R3": jnp.asarray(batch.topk)}[c.train.routing_replay]
        full = dict(
            tokens=tokens,
            positions=positions,
            loss_mask=jnp.asarray(batch.loss_mask),
            old_logp=old_logp,
            ref_logp=ref_logp,
            advantages=jnp.asarray(batch.advantages),
            topk=topk,
        )
        full = jax.device_put(full, self.batch_sh)
        step_metrics = []
        for epoch in range(c.train.epochs):
            perm = np.asarray(jax.random.permutation(jax.random.fold_in(key, 1 + epoch), self.batch_size))
            for m in range(c.train.minibatches):
                idx = perm[m * self.mb_size : (m + 1) * self.mb_size]
                mb = {k: (v[:, idx] if k == "topk" else v[idx]) for k, v in full.items()}
                mb = jax.device_put(mb, self.batch_sh)
                state, sm = self.train_step(state, mb)
                step_metrics.append(sm)
        metrics.update({k: float(np.mean([float(s[k]) for s in step_metrics])) for k in step_metrics[0]})
        metrics["skipped"] = float(sum(float(s["skipped"]) for s in step_metrics))
        if c.train.drift_metrics:
            metrics.update(self.drift(state["params"], full, batch))
        metrics.update(rollout_seconds=t_roll, iteration_seconds=time.perf_counter() - t0)
        return state, metrics

    def drift(self, params, full: dict, batch: RolloutBatch) -> dict[str, float]:
        """How the update moved routing and log-probs on the rollout's own tokens."""
        logp_new, topk_new = self.score(params, full["tokens"], full["positions"])
        logp_rep, _ = self.score_replay(params, full["tokens"], full["positions"], full["topk"])
        valid = jnp.asarray(batch.completion_mask)
        d = routing.routing_drift(full["topk"], topk_new, valid)
        d.update(routing.log_ratio_decomposition(logp_new, logp_rep, full["old_logp"], valid))
        out = {f"drift_{k}": float(v) for k, v in d.items() if k != "flip_rate_per_layer"}
        for i, v in enumerate(np.asarray(d["flip_rate_per_layer"])):
            out[f"drift_flip_rate_layer{i}"] = float(v)
        return out

    # -- evaluation: greedy accuracy on a fixed held-out prompt set
    def evaluate(self, params) -> dict[str, float]:
        c, b = self.config, self.built
        it = prompt_iterator(b.task, seed=c.seed + 1, split="eval")
        correct = []
        for i in range(c.train.eval_batches):
            examples = it.next_batch(self.batch_size)
            tokens, mask = self.rollout.encode_prompts([e.prompt for e in examples])
            out = self.sampler(
                params,
                tokens,
                mask,
                jax.random.key(i),
                temperature=0.0,
                eos_ids=self.rollout.eos_ids,
                pad_id=self.rollout.pad_id,
            )
            texts = self.rollout.decode_completions(np.asarray(out.tokens), np.asarray(out.lengths))
            correct += [b.task.reward(t, e) == 1.0 for t, e in zip(texts, examples)]
        return {"eval_accuracy": float(np.mean(correct))}

    # -- supervised warm start on the task's demonstrations, cached
    def warm_start_key(self) -> str:
        c = self.config
        blob = json.dumps(
            dict(
                model=c.model.to_dict(),
                task=c.task.to_dict(),
                ws={k: v for k, v in c.warm_start.items() if k != "cache_dir"},
                seed=c.seed,
                P=c.prompt_len,
                N=c.max_new_tokens,
            ),
            sort_keys=True,
            default=str,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def warm_start(self) -> tuple[Any, dict]:
        import orbax.checkpoint as ocp

        c = self.config
        w = c.warm_start
        if w.steps == 0:
            return self.params0, {}
        cache = Path(w.cache_dir or self.workdir) / f"warm_start_{self.warm_start_key()}"
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.params0)
        if (cache / "done.json").exists():
            with ocp.StandardCheckpointer() as ckpt:
                params = ckpt.restore((cache / "params").absolute(), abstract)
            return params, {**json.loads((cache / "done.json").read_text()), "warm_start_cached": 1.0}
        info = self._run_sft(w)
        params = info.pop("params")
        cache.mkdir(parents=True, exist_ok=True)
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save((cache / "params").absolute(), params, force=True)
        (cache / "done.json").write_text(json.dumps(info))  # written last: marks a complete cache
        return params, info

    def _run_sft(self, w) -> dict:
        c, b = self.config, self.built
        tx = optax.adamw(
            optax.warmup_cosine_decay_schedule(
                0.0, w.learning_rate, max(w.steps // 10, 1), w.steps, w.learning_rate * 0.1
            )
        )
        params = self.params0
        opt_sh = sharding_lib.opt_state_shardings(self.mesh, jax.eval_shape(tx.init, params), self.param_sh)
        b2 = self.bs(2)
        step = jax.jit(
            functools.partial(sft_step, self.graphdef, tx),
            donate_argnums=(0, 1),
            in_shardings=(self.param_sh, opt_sh, b2, b2, b2),
            out_shardings=(self.param_sh, opt_sh, self.rep),
        )
        opt_state = jax.jit(tx.init, in_shardings=(self.param_sh,), out_shardings=opt_sh)(params)
        it = prompt_iterator(b.task, seed=c.seed + 2, split="train")
        N, eos = c.max_new_tokens, self.tokenizer.eos_token_id
        losses_ = []
        for _ in range(w.steps):
            examples = it.next_batch(w.batch_size)
            tokens, pmask = self.rollout.encode_prompts([e.prompt for e in examples])
            comp = np.zeros((w.batch_size, N), np.int32)
            cmask = np.zeros((w.batch_size, N), bool)
            for i, e in enumerate(examples):
                ids = self.tokenizer.encode(b.task.demonstration(e), add_special_tokens=False)[: N - 1] + [eos]
                comp[i, : len(ids)], cmask[i, : len(ids)] = ids, True
            seq = jnp.asarray(np.concatenate([tokens, comp], 1))
            pos = positions_of(
                np.concatenate([pmask, np.zeros_like(cmask)], 1), np.concatenate([np.zeros_like(pmask), cmask], 1)
            )
            mask = jnp.asarray(np.concatenate([np.zeros_like(pmask), cmask], 1), jnp.float32)
            params, opt_state, loss = step(params, opt_state, *jax.device_put((seq, pos, mask), b2))
            losses_.append(float(loss))
        return dict(
            params=params, sft_loss_first=losses_[0], sft_loss_last=float(np.mean(losses_[-10:])), sft_steps=w.steps
        )

    # -- the main job
    def run(self, *, max_iterations: int | None = None, progress: bool = True) -> dict[str, Any]:
        """Trains (resuming from the workdir's latest good checkpoint), logs, checkpoints, plots.

        max_iterations stops early after that many iterations of this call (tests use it to fake an
        interruption); SIGTERM saves a checkpoint and returns at the next iteration boundary.
        """
        from gspo_jax.checkpoint import Checkpointer, PreemptionGuard
        from gspo_jax.writers import MetricWriter

        c, b = self.config, self.built
        self.workdir.mkdir(parents=True, exist_ok=True)
        is_main = jax.process_index() == 0
        if is_main:
            (self.workdir / "config.json").write_text(c.to_json_best_effort(indent=2))
        writer = MetricWriter(self.workdir)
        ckpt = Checkpointer(
            self.workdir / "checkpoints", max_to_keep=c.train.keep_checkpoints, save_every=c.train.checkpoint_every
        )
        params, ws_info = self.warm_start()
        ref_params = params if b.loss.kl_coef > 0 else None
        state = self.init_state(params)
        prompts = prompt_iterator(b.task, seed=c.seed, split="train")
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        restored = ckpt.restore_latest(abstract)
        start = 0
        if restored is not None:
            _, state, meta = restored
            start = int(meta["iteration"]) + 1
            prompts.restore(meta["prompts"])
            log.info("resumed from iteration %d", start - 1)
        elif c.train.eval_every:
            ev = self.evaluate(state["params"])
            writer.write(0, {**ev, **{k: float(v) for k, v in ws_info.items()}})
            log.info("warm start: %s", ev)
        stop = c.train.num_iterations if max_iterations is None else min(c.train.num_iterations, start + max_iterations)
        bar = None
        if progress and is_main:
            from tqdm.auto import tqdm

            bar = tqdm(total=c.train.num_iterations, initial=start, desc=f"{c.algorithm}", unit="it")
        last: dict[str, Any] = {}
        with PreemptionGuard() as guard:
            for it in range(start, stop):
                compiles = CompileCounter()  # logged as xla_compiles: 0 after the first iteration
                state, metrics = self.iteration(state, prompts, it, ref_params)
                if (it + 1) % c.train.eval_every == 0 or it + 1 == c.train.num_iterations:
                    metrics.update(self.evaluate(state["params"]))
                metrics["xla_compiles"] = float(compiles.count)
                writer.write(it + 1, metrics)
                last = metrics
                meta = dict(iteration=it, prompts=prompts.state())
                ckpt.save(it + 1, state, meta, force=guard.requested or it + 1 == c.train.num_iterations)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(
                        reward=f"{metrics['reward_mean']:.3f}",
                        acc=f"{metrics['accuracy']:.3f}",
                        clip=f"{metrics.get('clip_frac', 0):.4f}",
                    )
                if guard.requested:
                    log.warning("preemption requested: checkpoint saved at iteration %d, stopping", it)
                    break
        ckpt.wait()
        ckpt.close()
        writer.close()
        if bar is not None:
            bar.close()
        if is_main and (max_iterations is None or stop == c.train.num_iterations):
            from gspo_jax import plots

            plots.plot_run(self.workdir)
        self.state = state
        return last

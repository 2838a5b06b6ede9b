"""How close gspo_jax is to this machine's limit: every figure a ratio measured in this one process.

    python -m benchmarks.run                      # everything; writes benchmarks/results.json
    python -m benchmarks.run --only iteration     # one section (repeatable)
    python -m benchmarks.run --size tiny --out /tmp/r.json   # seconds: the CI smoke test

Sections:
  peak       best float32 matmul FLOP/s over several square shapes (the denominator of every MFU)
  train      train-step MFU: analytic useful FLOPs / measured time / peak, on the default config
             and on `bench` (width 512, 8 layers, 16 experts top-2); the best call of those in 3 s
             (at least --repeats), and the median's
  loss       forward + backward of `policy_loss` alone, as a share of the train step, per objective
  moe        MoE dispatch paths (dense, ragged, sparse) against each other, forward + backward; and
             again with two (fake CPU) devices beside the expert-parallel all-to-all path
  sampler    generated tokens/s, against the naive decoder, decode MFU, and against batch size
  iteration  one RL iteration of the `iteration` shape, split (rollout, log-probs, updates, drift,
             evaluation, checkpoint + logging), with drift on every sequence, every 4th, or off; the
             compiles after warm-up and the time to the first finished iteration, cold and with the
             persistent compilation cache filled by a previous run
  scaling    one RL iteration of the default config split into everything a run spends time on
             (rollout, log-probs, updates, drift, host work, evaluation, checkpoint, logging), with
             group size and completion length varied one at a time
  diagnostics  the default config's iteration with drift and routing diagnostics on, drift only, and
             both off: the share of an iteration the research instruments cost
  critic     PPO's extra cost on the default config: the train step with and without the critic's
             update, the critic's values pass against the scoring forward, parameter, optimizer and
             compiled-step memory, and whole iterations of PPO against GRPO and GSPO

It ends with a table of the targets whose sections ran: each figure, its target, and whether this
run met it (the README's table adds the ranges over several runs and what limits each miss).

Useful FLOPs are analytic (`gspo_jax/flops.py`), never XLA's cost analysis (it counts a loop body
once): a train step is 6 × (active matmul parameters) × tokens plus attention, 12 × layers × B × T² ×
H × W; decoding a token is 2 × active matmul parameters per sequence (attention over the cache left
out: small at these lengths).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental.compilation_cache import compilation_cache

from gspo_jax import compiles, losses, moe, train
from gspo_jax import model as model_lib
from gspo_jax.algorithms import ALGORITHMS
from gspo_jax.config import base_config, build
from gspo_jax.flops import matmul_params, train_flops
from gspo_jax.host_memory import reexec_with_huge_pages
from gspo_jax.rollout import RolloutConfig
from gspo_jax.sampler import Sampler, left_pad, sample_logits
from gspo_jax.sharding import make_mesh, mesh_from_config, under_mesh

SECTIONS = ("peak", "train", "loss", "moe", "sampler", "iteration", "scaling", "diagnostics", "critic")
RESULTS = Path(__file__).with_name("results.json")


def call_times(fn, repeats: int, min_seconds: float = 0.0) -> list[float]:
    """Wall times of `fn()` (results ready), after one warm-up call: `repeats` calls, and more until
    `min_seconds` have passed (a 50 ms step timed 5 times samples a shared machine for 0.25 s only)."""
    jax.block_until_ready(fn())
    times, start = [], time.perf_counter()
    while len(times) < repeats or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return times


def best_time(fn, repeats: int) -> float:
    """Best wall time of `fn()` over `repeats` calls, after one warm-up call."""
    return min(call_times(fn, repeats))


# ---------------------------------------------------------------------------------------------- peak


def peak(size: str, repeats: int) -> dict:
    shapes = (128, 256) if size == "tiny" else (256, 512, 1024, 2048)
    out = {}
    for n in shapes:
        a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
        f = jax.jit(lambda x: x @ x)
        out[n] = 2 * n**3 / best_time(lambda f=f, a=a: f(a), repeats)
    return {"flops_per_s": max(out.values()), "by_shape": {str(k): v for k, v in out.items()}}


# ---------------------------------------------------------------------------------------------- train


def run_config(algorithm: str, size: str):
    """The trainer's config of `algorithm` at the `default` size, or at `tiny` for the smoke test: the
    tiny preset with one stack of two MoE layers of four experts (every path of a run, with about a
    quarter less to compile than the preset's dense + MoE stacks of eight experts)."""
    c = base_config(algorithm, "tiny" if size == "tiny" else "default")
    if size == "tiny":
        c.model.update(num_layers=2, dense_layers=(), num_experts=4)
    return c


def bench_config(size: str, algorithm: str = "gspo"):
    """`default` as configured, `bench` wide enough for matmuls to dominate, `tiny` for the smoke test."""
    c = run_config(algorithm, size)
    if size == "bench":
        c.model.update(embed_dim=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64, mlp_dim=1024)
        c.model.update(num_experts=16, top_k=2, moe_mlp_dim=512)
        # A large model on CPU: XLA's default code generation (the fast-compile loops are ~3x slower
        # over its 117 MiB expert stacks: the step 750 -> 905 ms, README).
        c.cpu_fast_compile = False
    c.warm_start.steps = 0
    return c


def _pieces(c):
    built = build(c)
    mesh = mesh_from_config(**c.mesh)
    graphdef, params = train.init_policy(c, built.model, mesh)
    programs = train.compile_programs(c, built, graphdef, params, mesh)
    return built, graphdef, params, programs


def random_batch(programs, params, B: int, P: int, C: int, seed: int = 0) -> train.TrainBatch:
    """A well-formed minibatch: random prompts and completions of random lengths."""
    rng = np.random.default_rng(seed)
    T = P + C
    tokens = rng.integers(4, 100, (B, T)).astype(np.int32)
    pmask, cmask = np.zeros((B, T), bool), np.zeros((B, T), bool)
    for i in range(B):
        pmask[i, P - rng.integers(1, P) : P] = True
        cmask[i, P : P + rng.integers(1, C + 1)] = True
    positions = model_lib.positions_from_mask(jnp.asarray(pmask | cmask))
    logp, topk = programs.score(params, jnp.asarray(tokens), positions)
    return train.TrainBatch(
        tokens=jnp.asarray(tokens),
        positions=positions,
        completion_mask=jnp.asarray(cmask),
        loss_mask=jnp.asarray(cmask, jnp.float32),
        old_logp=logp,
        sampler_logp=logp,
        ref_logp=logp,
        advantages=jnp.asarray(rng.normal(size=B), jnp.float32),
        topk=topk,
    )


def train_step_times(c, repeats: int, min_seconds: float = 0.0) -> tuple[list[float], int, int, model_lib.ModelConfig]:
    built, _, params, programs = _pieces(c)
    B = built.rollout.num_groups * built.rollout.group_size // c.train.minibatches
    batch = jax.device_put(random_batch(programs, params, B, c.prompt_len, c.max_new_tokens), programs.batch_shardings)
    state = [train.init_train_state(programs, params, 0)]

    def step():
        state[0], m, _ = programs.train_step(state[0], batch)
        return m

    return call_times(step, repeats, min_seconds), B, c.prompt_len + c.max_new_tokens, built.model


def train_step_time(c, repeats: int) -> tuple[float, int, int, model_lib.ModelConfig]:
    times, B, T, cfg = train_step_times(c, repeats)
    return min(times), B, T, cfg


def train_mfu(size: str, repeats: int, peak_flops: float) -> dict:
    out = {}
    for name in ("tiny",) if size == "tiny" else ("default", "bench"):
        times, B, T, cfg = train_step_times(bench_config(name), repeats, 0.0 if size == "tiny" else 3.0)
        flops = train_flops(cfg, B, T)
        seconds, median = min(times), float(np.median(times))
        out[name] = dict(seconds=seconds, median_seconds=median, calls=len(times), batch=B, tokens=B * T)
        out[name].update(flops=flops, mfu=flops / seconds / peak_flops, mfu_median=flops / median / peak_flops)
    return out


# ---------------------------------------------------------------------------------------------- loss


def loss_share(size: str, repeats: int) -> dict:
    c = bench_config("tiny" if size == "tiny" else "default")
    step_seconds, B, T, _ = train_step_time(c, repeats)
    rng = np.random.default_rng(0)
    logp = jnp.asarray(-rng.exponential(1.0, (B, T)), jnp.float32)
    old = logp + jnp.asarray(rng.normal(0, 0.1, (B, T)), jnp.float32)
    mask = jnp.asarray(rng.random((B, T)) < 0.5, jnp.float32)
    adv = jnp.asarray(rng.normal(size=B), jnp.float32)
    out = {}
    for name, alg in ALGORITHMS.items():
        cfg = alg.loss_config(T)
        fn = jax.jit(jax.value_and_grad(lambda lp, cfg=cfg: losses.policy_loss(cfg, lp, old, adv, mask, logp)[0]))
        seconds = best_time(lambda fn=fn: fn(logp), repeats)
        out[name] = dict(seconds=seconds, share_of_train_step=seconds / step_seconds)
    return dict(train_step_seconds=step_seconds, by_objective=out)


# ---------------------------------------------------------------------------------------------- moe


def _dispatch_loss(fn, topk, gates, x, *w):
    return jnp.sum(fn(x, topk, gates, *w) ** 2)


def moe_dispatch(size: str, repeats: int) -> dict:
    tokens = (128, 512) if size == "tiny" else (256, 1024, 4096)
    experts = (4, 8) if size == "tiny" else (4, 8, 16)
    D = F = 64 if size == "tiny" else 256
    out = []
    for N in tokens:
        for E in experts:
            keys = jax.random.split(jax.random.key(N * 31 + E), 5)
            x = jax.random.normal(keys[0], (1, N, D))
            w = [jax.random.normal(k, s) * s[-2] ** -0.5 for k, s in zip(keys[1:4], [(E, D, F), (E, D, F), (E, F, D)])]
            topk = jax.random.randint(keys[4], (1, N, 2), 0, E)
            topk = topk.at[..., 1].set((topk[..., 0] + 1 + topk[..., 1] % (E - 1)) % E)  # distinct experts
            gates = jnp.full((1, N, 2), 0.5)
            row = dict(tokens=N, experts=E, top_k=2)
            for name, fn in (
                ("dense", moe.dense_experts),
                ("ragged", moe.ragged_experts),
                ("sparse", moe.sparse_experts),
            ):
                loss = functools.partial(_dispatch_loss, fn, topk, gates)
                f = jax.jit(jax.value_and_grad(loss))
                row[f"{name}_seconds"] = best_time(functools.partial(f, x, *w), repeats)
            if jax.device_count() >= 2:  # the all-to-all path, experts split over two devices, sparse on each
                mesh = make_mesh(expert=2)
                ep = functools.partial(moe.expert_parallel, moe.sparse_experts, mesh.abstract_mesh)
                loss = functools.partial(_dispatch_loss, ep, topk, gates)
                rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
                f = jax.jit(under_mesh(jax.value_and_grad(loss), mesh), in_shardings=rep, out_shardings=rep)
                row["expert_parallel_seconds"] = best_time(functools.partial(f, x, *w), repeats)
            row["useful_flops"] = 3 * 2 * N * 2 * 3 * D * F  # fwd + bwd, k=2 experts, 3 matmuls
            out.append(row)
    return {"rows": out}


def moe_expert_parallel(size: str, repeats: int) -> list[dict]:
    """The MoE rows again in a child process with two fake CPU devices (`XLA_FLAGS` must be set before
    JAX starts), where the expert-parallel path runs beside the others: its ratios come from that one
    process. On two cores the two devices share the machine: what it shows is the exchange's overhead."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "moe.json"
        env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
        cmd = [sys.executable, "-m", "benchmarks.run", "--only", "moe", "--size", size, "--out", str(out)]
        cmd += ["--repeats", str(repeats)]
        subprocess.run(cmd, check=True, env=env, cwd=Path(__file__).parents[1], stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())["moe"]["rows"]


# ---------------------------------------------------------------------------------------------- sampler


def naive_decoder(graphdef, prompt_len: int, max_new: int, max_top_k: int):
    """The full forward over the fixed [B, P+C] buffer at every step: a sampler without a KV cache."""

    @functools.partial(jax.jit, donate_argnums=(1, 2))
    def step(state, seq_BT, valid_BT, key, i, temperature, top_k, top_p):
        logits_BTV, _ = model_lib.apply(graphdef, state, seq_BT, model_lib.positions_from_mask(valid_BT))
        last_BV = jax.lax.dynamic_index_in_dim(logits_BTV, prompt_len + i - 1, axis=1, keepdims=False)
        tok_B, _ = sample_logits(last_BV, key, temperature, top_k, top_p, max_top_k)
        seq_BT = jax.lax.dynamic_update_slice_in_dim(seq_BT, tok_B[:, None], prompt_len + i, axis=1)
        ones_B1 = jnp.ones_like(tok_B, bool)[:, None]
        return seq_BT, jax.lax.dynamic_update_slice_in_dim(valid_BT, ones_B1, prompt_len + i, axis=1)

    def generate(state, prompts, mask, key, temperature, top_k, top_p):
        B = prompts.shape[0]
        seq = jnp.concatenate([jnp.asarray(prompts), jnp.zeros((B, max_new), jnp.int32)], 1)
        valid = jnp.concatenate([jnp.asarray(mask), jnp.zeros((B, max_new), bool)], 1)
        for i in range(max_new):
            key, sub = jax.random.split(key)
            seq, valid = step(state, seq, valid, sub, jnp.int32(i), temperature, top_k, top_p)
        return seq

    return generate


def sampler_throughput(size: str, repeats: int, peak_flops: float) -> dict:
    c = iteration_config("tiny" if size == "tiny" else "iteration")
    cfg, options = build(c).model, compiles.step_options(c.cpu_fast_compile)  # compiled as the trainer does
    graphdef, state = nnx.split(model_lib.Transformer(cfg, rngs=nnx.Rngs(0)))
    P, C = (8, 8) if size == "tiny" else (16, 64)
    rng = np.random.default_rng(0)
    t, k, p = jnp.float32(1.0), jnp.int32(0), jnp.float32(1.0)

    def run(batch: int, threads: int = 1) -> float:
        prompts, mask = left_pad([rng.integers(4, cfg.vocab_size, P) for _ in range(batch)], P)
        sampler = Sampler(graphdef, cfg, batch, P, C, threads=threads, compiler_options=options)
        key = jax.random.key(0)  # no EOS: every row generates C tokens
        return best_time(lambda: sampler(state, prompts, mask, key, temperature=t, top_k=k, top_p=p).tokens, repeats)

    flops_per_token = 2 * matmul_params(cfg)
    batches = (8, 16) if size == "tiny" else (8, 16, 32, 64, 128, 256)
    scaling = []
    for b in batches:
        seconds = run(b)
        tps = b * C / seconds
        scaling.append(dict(batch=b, seconds=seconds, tokens_per_s=tps, decode_mfu=tps * flops_per_token / peak_flops))
    # As the trainer samples on one device: the batch in `rollout.sampler_threads` slices at once.
    threads = RolloutConfig(num_groups=1, group_size=2).threads(devices=1)
    threaded = [dict(batch=b, tokens_per_s=b * C / run(b, threads)) for b in batches[-3:-1]]
    B = 16 if size == "tiny" else 64
    prompts, mask = left_pad([rng.integers(4, cfg.vocab_size, P) for _ in range(B)], P)
    naive = naive_decoder(graphdef, P, C, 64)
    naive_seconds = best_time(lambda: naive(state, prompts, mask, jax.random.key(0), t, k, p), max(1, repeats // 2))
    fast = next(r for r in scaling if r["batch"] == B)
    return dict(
        prompt=P,
        new_tokens=C,
        batch=B,
        tokens_per_s=fast["tokens_per_s"],
        naive_tokens_per_s=B * C / naive_seconds,
        speedup_vs_naive=naive_seconds / fast["seconds"],
        decode_mfu=fast["decode_mfu"],
        by_batch=scaling,
        threads=threads,
        by_batch_threaded=threaded,
    )


# ---------------------------------------------------------------------------------------------- iteration


def iteration_config(size: str):
    """The `iteration` shape: a random MoE of width 256, 4 layers, all MoE with 4 experts top-2 (GQA
    4/2, expert width 256), 16 prompts × 8 samples, prompts of 16 tokens and up to 64 new tokens,
    one optimizer step per iteration, no KL, no warm start."""
    c = run_config("gspo", size)
    if size != "tiny":
        c.model.update(embed_dim=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, dense_layers=())
        c.model.update(num_experts=4, top_k=2, moe_mlp_dim=256)
        c.rollout.update(num_groups=16, group_size=8)
        c.prompt_len, c.max_new_tokens = 16, 64
    c.train.update(minibatches=1, epochs=1, num_iterations=6, eval_every=1000, eval_batches=1, checkpoint_every=1000)
    c.warm_start.steps = 0
    return c


SPLIT = ("rollout_seconds", "logprob_seconds", "update_seconds", "drift_seconds")


def _run_iterations(c, cache_dir: str | None = None, cold: bool = True) -> tuple[list[dict], float]:
    """Runs config `c` in a fresh workdir; returns its metrics rows and its start time. `cold`: with
    empty in-memory jit caches, as a new process has, and `cache_dir` as the only persistent
    compilation cache (so its first iteration is timed as a fresh run's); otherwise the programs
    earlier sections compiled are reused (only the compiled iterations are timed then)."""
    before = jax.config.jax_compilation_cache_dir
    if cold:
        # JAX opens the persistent cache once, at the first compile after a reset, and keeps it.
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        compilation_cache.reset_cache()
        jax.clear_caches()
    try:
        with tempfile.TemporaryDirectory() as workdir:
            t0 = time.time()
            train.train_and_evaluate(c, workdir, progress=False)
            rows = [json.loads(x) for x in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    finally:
        if cold:  # later sections compile with the cache they had (not `cache_dir`, soon deleted)
            jax.config.update("jax_compilation_cache_dir", before)
            compilation_cache.reset_cache()
    return rows, t0


def iteration(size: str, repeats: int) -> dict:
    """The three drift settings, each a fresh run from cold in-memory caches (at `tiny`, the smoke
    test, they share compiled programs: every figure produced, fewer compiles), then the
    compilation-cache pair, always cold."""
    del repeats
    out = {}
    for drift, subsample in ((True, 1), (True, 4), (False, 1)):
        c = iteration_config(size)
        c.train.update(drift_metrics=drift, drift_subsample=subsample)
        rows, t0 = _run_iterations(c, cold=size != "tiny")
        warm = [r for r in rows if 2 <= r["step"] <= 5]  # iterations 2..5: compiled, not the last (it evaluates)
        wall = [b["time"] - a["time"] for a, b in zip(rows[1:], rows[2:]) if 2 <= b["step"] <= 5]
        split = {k: float(np.mean([r[k] for r in warm])) for k in SPLIT}
        split["other_seconds"] = float(np.mean(wall)) - sum(split.values())  # checkpoint, logging, host work
        name = "drift_off" if not drift else "drift_on" if subsample == 1 else f"drift_every_{subsample}th"
        out[name] = dict(
            seconds=float(np.mean(wall)),
            split=split,
            compiles_after_warmup=int(sum(r["xla_compiles"] for r in warm)),
            seconds_to_first_iteration=rows[1]["time"] - t0,
        )
    # A rerun (or the next run of a sweep) with the persistent compilation cache that scripts/train.py
    # keeps: the first run fills it, the second loads from it.
    c = iteration_config(size)
    c.train.num_iterations = 2  # as above, the first iteration is not the last, which also evaluates
    with tempfile.TemporaryDirectory() as cache_dir:
        firsts = [(lambda r: r[0][1]["time"] - r[1])(_run_iterations(c, cache_dir)) for _ in range(2)]
    out["compilation_cache"] = dict(
        seconds_to_first_iteration_cold=firsts[0], seconds_to_first_iteration_warm=firsts[1]
    )
    return out


def _median_iteration(c) -> dict:
    """A whole run of config `c`: the median wall time of its compiled iterations (2 .. the one before
    the last, which evaluates) and the median of each part of the split."""
    rows, _ = _run_iterations(c, cold=False)
    last = c.train.num_iterations - 1
    wall = [b["time"] - a["time"] for a, b in zip(rows[1:], rows[2:]) if 2 <= b["step"] <= last]
    warm = [r for r in rows if 2 <= r["step"] <= last]
    return dict(seconds=float(np.median(wall)), split={k: float(np.median([r[k] for r in warm])) for k in SPLIT})


SCALING = {  # group sizes and completion lengths tried, one varied at a time (the other as configured)
    "full": dict(group_size=(4, 8, 16), max_new_tokens=(6, 12, 24)),
    "tiny": dict(group_size=(4, 8), max_new_tokens=(8, 16)),
}
EVERY = 2  # the scaling runs evaluate and checkpoint every 2nd iteration: both measured in place


def whole_split(rows: list[dict], every: int) -> tuple[float, dict]:
    """(an iteration's seconds, every part of a run's time per compiled iteration (steps 2..)) from
    the metrics rows of a run that evaluated and saved every `every` iterations. An iteration right
    after a save is slower (the save's asynchronous write shares the cores with it), so the
    iteration's own timers (rollout, log-probs, updates, drift, and the host work between them) and
    logging (the wall time between rows beyond the iteration and evaluation timers) come from the
    iterations that do not follow one; evaluation from its timer; a save is the extra wall time of
    an iteration after one: what it blocks, and what its write takes from the next iteration."""
    by_step = {r["step"]: r for r in rows}
    med = lambda xs: float(np.median(list(xs)))
    wall = {
        s: by_step[s]["time"] - by_step[s - 1]["time"] - by_step[s].get("eval_seconds", 0.0) for s in by_step if s >= 2
    }
    plain = [s for s in wall if (s - 1) % every]
    after_save = [s for s in wall if (s - 1) % every == 0]
    out = {k: med(by_step[s][k] for s in plain) for k in SPLIT}
    out["host_seconds"] = med(by_step[s]["iteration_seconds"] - sum(by_step[s][k] for k in SPLIT) for s in plain)
    out["evaluation_seconds"] = med(r["eval_seconds"] for s, r in by_step.items() if s >= 2 and "eval_seconds" in r)
    out["logging_seconds"] = med(wall[s] - by_step[s]["iteration_seconds"] for s in plain)
    out["checkpoint_seconds"] = med(wall[s] for s in after_save) - med(wall[s] for s in plain)
    return med(by_step[s]["iteration_seconds"] for s in plain), out


def iteration_scaling(size: str, repeats: int) -> dict:
    """One RL iteration of the default config split into everything a run spends time on, and how it
    grows with group size and completion length. `seconds` is the iteration alone (what
    `iteration_seconds` logs, where no save precedes it); `seconds_at_config_cadence` adds logging,
    and evaluation and saves amortised at the config's own `eval_every` / `checkpoint_every`."""
    del repeats
    rows = []
    base = run_config("gspo", size)
    G, C = base.rollout.group_size, base.max_new_tokens
    grid = SCALING[size]
    shapes = (
        [(G, C)] + [(g, C) for g in grid["group_size"] if g != G] + [(G, n) for n in grid["max_new_tokens"] if n != C]
    )
    for g, n in shapes:
        c = run_config("gspo", size)
        c.rollout.group_size, c.max_new_tokens = g, n
        c.warm_start.steps = 0
        c.train.update(num_iterations=6 if size == "tiny" else 12, eval_every=EVERY, checkpoint_every=EVERY)
        run, _ = _run_iterations(c, cold=False)
        seconds, split = whole_split(run, EVERY)
        cadence = seconds + split["logging_seconds"]
        cadence += (
            split["evaluation_seconds"] / base.train.eval_every
            + split["checkpoint_seconds"] / base.train.checkpoint_every
        )
        rows.append(
            dict(
                group_size=g,
                max_new_tokens=n,
                sequences=c.rollout.num_groups * g,
                completion_len_mean=float(np.mean([r["completion_len_mean"] for r in run if r["step"] >= 2])),
                seconds=seconds,
                seconds_at_config_cadence=cadence,
                split=split,
                compiles_after_warmup=int(sum(r["xla_compiles"] for r in run if r["step"] >= 2)),
            )
        )
    return dict(
        group_size=G,
        max_new_tokens=C,
        eval_every=base.train.eval_every,
        checkpoint_every=base.train.checkpoint_every,
        rows=rows,
    )


def diagnostics_cost(size: str, repeats: int) -> dict:
    """What the research instruments cost on the default config, measured where each one runs: the
    drift pass (its own timer, inside a run with everything on) and the routing split inside the
    train step (the step with and without it, best of many, back to back in this process), against
    the instrumented iteration. Whole runs with everything on and off are kept for context only: on
    a shared 2-core machine their difference swings by ±10% of an iteration from run to run."""
    c = run_config("gspo", size)
    c.train.update(num_iterations=6 if size == "tiny" else 14, eval_every=1000, checkpoint_every=1000)
    c.warm_start.steps = 0
    out = {}
    for name, on in (("on", True), ("off", False)):
        run = c.copy_and_resolve_references()
        run.train.update(drift_metrics=on, routing_diagnostics=on)
        out[name] = _median_iteration(run)
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


def critic_cost(size: str, repeats: int) -> dict:
    """What PPO's critic adds on the default config, measured where it runs: its update inside the
    train step (the same step with and without it, best of many, back to back), its values pass (the
    GAE estimate) against the policy's scoring forward of the same batch, its memory (parameters,
    AdamW moments, the compiled step's temporaries), and whole iterations against the critic-free runs."""
    c = bench_config("tiny" if size == "tiny" else "default", "ppo")
    built, _, params, programs = _pieces(c)
    B = built.rollout.num_groups * built.rollout.group_size
    mb = B // c.train.minibatches
    full = random_batch(programs, params, B, c.prompt_len, c.max_new_tokens)
    zeros = jnp.zeros(full.tokens.shape, jnp.float32)
    full = jax.device_put(full.replace(advantages=zeros, values=zeros, returns=zeros), programs.batch_shardings)
    state = train.init_train_state(programs, params, 0)
    rewards = jnp.asarray(np.random.default_rng(0).random(B) < 0.3, jnp.float32)
    out = {}
    out["estimate_seconds"] = best_time(lambda: programs.estimate(state.critic.params, full, rewards), repeats * 4)
    out["score_seconds"] = best_time(lambda: programs.score(state.params, full.tokens, full.positions), repeats * 4)
    full, _ = programs.estimate(state.critic.params, full, rewards)
    batch = programs.take(full, np.arange(mb))
    static = programs.train_step.args[0]
    step = jax.jit(train.train_step, static_argnums=0, donate_argnums=1)
    variants = dict(
        with_critic=(static, state, batch),
        without_critic=(
            dataclasses.replace(static, critic=None),
            state.replace(critic=None),
            batch.replace(values=None, returns=None),
        ),
    )
    for name, (st, s0, b) in variants.items():
        held = [jax.tree.map(jnp.copy, s0)]
        compiled = step.lower(st, held[0], b).compile()  # one compile: timed, and its memory read

        def run(compiled=compiled, b=b, held=held):
            held[0], m, _ = compiled(held[0], b)
            return m

        out[f"step_{name}_seconds"] = best_time(run, repeats * 4)
        mem = compiled.memory_analysis()
        out[f"step_{name}_temp_bytes"] = int(getattr(mem, "temp_size_in_bytes", 0)) if mem is not None else 0
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    out.update(
        policy_param_bytes=nbytes(state.params),
        policy_opt_bytes=nbytes(state.opt_state),
        critic_param_bytes=nbytes(state.critic.params),
        critic_opt_bytes=nbytes(state.critic.opt_state),
        updates_per_iteration=c.train.epochs * c.train.minibatches,
    )
    runs = {}
    for algorithm in ("ppo", "grpo", "gspo"):
        run = run_config(algorithm, size)
        run.train.update(num_iterations=4 if size == "tiny" else 12, eval_every=1000, checkpoint_every=1000)
        run.warm_start.steps = 0
        runs[algorithm] = _median_iteration(run)
    out["iterations"] = runs
    per_iteration = out["updates_per_iteration"] * (
        out["step_with_critic_seconds"] - out["step_without_critic_seconds"]
    )
    out["critic_share"] = (max(per_iteration, 0.0) + out["estimate_seconds"]) / runs["ppo"]["seconds"]
    return out


def targets(results: dict) -> list[tuple[str, str, str, bool]]:
    """(figure, measured, target, met) for each of issue 12's targets whose section ran."""
    rows = []
    add = lambda figure, value, target, met: rows.append((figure, value, target, bool(met)))
    for name, r in results.get("train", {}).items():  # `tiny` (the smoke test) stands in for the default config
        bar = 0.35 if name == "bench" else 0.20
        add(f"train-step MFU, {name}", f"{r['mfu']:.1%}", f">= {bar:.0%}", r["mfu"] >= bar)
    if "loss" in results:
        worst = max(r["share_of_train_step"] for r in results["loss"]["by_objective"].values())
        add("policy_loss share of a train step (worst objective)", f"{worst:.1%}", "<= 3%", worst <= 0.03)
    if "sampler" in results:
        s = results["sampler"]
        tps = {r["batch"]: r["tokens_per_s"] for r in s["by_batch"]}
        add(
            f"sampler at batch {s['batch']} against the naive decoder",
            f"{s['speedup_vs_naive']:.1f}x",
            ">= 15x",
            s["speedup_vs_naive"] >= 15,
        )
        top = max(b for b in tps if b <= 128)
        rising = all(tps[a] < tps[b] for a, b in zip(sorted(tps), sorted(tps)[1:]) if b <= top)
        add(f"decode tokens/s rising with batch up to {top}", "yes" if rising else "no", "yes", rising)
    if "iteration" in results:
        it = results["iteration"]
        on, split = it["drift_on"], it["drift_on"]["split"]
        add("one RL iteration, `iteration` shape, drift on", f"{on['seconds']:.2f} s", "<= 3 s", on["seconds"] <= 3)
        largest = max(SPLIT, key=split.get)
        add("its largest part", largest.removesuffix("_seconds"), "rollout", largest == "rollout_seconds")
        compiles = sum(r["compiles_after_warmup"] for k, r in it.items() if k != "compilation_cache")
        add("compiles during iterations 2..5", str(compiles), "0", compiles == 0)
        cold, warm = on["seconds_to_first_iteration"], it["compilation_cache"]["seconds_to_first_iteration_warm"]
        add("first finished iteration, empty compilation cache", f"{cold:.1f} s", "<= 10 s", cold <= 10)
        add("first finished iteration, cache filled by a previous run", f"{warm:.1f} s", "<= 10 s", warm <= 10)
    if "diagnostics" in results:
        share = results["diagnostics"]["share"]
        add("drift + routing diagnostics, share of an iteration", f"{share:.1%}", "<= 15%", share <= 0.15)
    return rows


def print_targets(results: dict) -> None:
    rows = targets(results)
    if not rows:
        return
    width = max(len(r[0]) for r in rows)
    print(f"\n{'figure':{width}}  {'measured':>10}  {'target':>9}  met")
    for figure, value, target, met in rows:
        print(f"{figure:{width}}  {value:>10}  {target:>9}  {'yes' if met else 'no'}")


def machine() -> str:
    """What ran the benchmark: the CPU's model and vector ISA and the cores this process may use (the
    figures move with them: the hosts this project is lent differ from session to session), and JAX's
    devices."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    devices = f"{jax.device_count()} {jax.devices()[0].platform} device(s)"
    return f"{model} ({platform.machine()}{', ' + isa if isa else ''}, {cores} cores), {devices}"


def refuse_unoptimised(ap: argparse.ArgumentParser, tiny_flag: str) -> None:
    """Exit with a usage error if JAX_DISABLE_MOST_OPTIMIZATIONS (the test suite's setting) is on: every
    figure of a full-size run would be of programs compiled without LLVM's optimizations."""
    if jax.config.values["jax_disable_most_optimizations"]:
        ap.error(
            "JAX_DISABLE_MOST_OPTIMIZATIONS is on (the test suite's setting): the figures are of optimised "
            f"programs; unset it, or run {tiny_flag}"
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", choices=SECTIONS, help="run only these sections")
    ap.add_argument("--size", default="full", choices=("full", "tiny"), help="tiny: seconds, for the smoke test")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    if args.size != "tiny":
        refuse_unoptimised(ap, "--size tiny")
    sections = args.only or SECTIONS
    repeats = 1 if args.size == "tiny" else args.repeats
    results = dict(machine=machine())
    results["jax"] = jax.__version__
    results["glibc_tunables"] = os.environ.get("GLIBC_TUNABLES", "")  # huge pages or not: see host_memory
    results["jax_disable_most_optimizations"] = bool(jax.config.values["jax_disable_most_optimizations"])
    results["peak"] = peak(args.size, repeats)
    flops = results["peak"]["flops_per_s"]
    print(f"peak float32 matmul: {flops / 1e9:.1f} GFLOP/s ({results['machine']})")
    if "train" in sections:
        results["train"] = train_mfu(args.size, repeats, flops)
        for name, r in results["train"].items():
            print(
                f"train step [{name}]: {r['seconds'] * 1e3:.1f} ms, MFU {r['mfu']:.1%} (best of {r['calls']} calls; "
                f"median {r['median_seconds'] * 1e3:.1f} ms, {r['mfu_median']:.1%})"
            )
    if "loss" in sections:
        results["loss"] = loss_share(args.size, repeats)
        for name, r in results["loss"]["by_objective"].items():
            print(f"loss [{name}]: {r['seconds'] * 1e3:.2f} ms, {r['share_of_train_step']:.1%} of a train step")
    if "moe" in sections:
        results["moe"] = moe_dispatch(args.size, repeats)
        if jax.device_count() == 1:
            results["moe"]["two_devices"] = moe_expert_parallel(args.size, repeats)
        for r in results["moe"]["rows"]:
            dense_ms, dense = r["dense_seconds"] * 1e3, r["dense_seconds"]
            print(
                f"moe N={r['tokens']} E={r['experts']}: dense {dense_ms:.2f} ms, ragged/dense "
                f"{r['ragged_seconds'] / dense:.2f}, sparse/dense {r['sparse_seconds'] / dense:.2f}"
            )
        for r in results["moe"].get("two_devices", results["moe"]["rows"]):
            if "expert_parallel_seconds" in r:
                print(
                    f"moe N={r['tokens']} E={r['experts']}, 2 devices: expert-parallel/sparse "
                    f"{r['expert_parallel_seconds'] / r['sparse_seconds']:.2f}, expert-parallel/dense "
                    f"{r['expert_parallel_seconds'] / r['dense_seconds']:.2f}"
                )
    if "sampler" in sections:
        results["sampler"] = s = sampler_throughput(args.size, repeats, flops)
        print(
            f"sampler batch {s['batch']}: {s['tokens_per_s']:,.0f} tokens/s, {s['speedup_vs_naive']:.1f}x naive, "
            f"decode MFU {s['decode_mfu']:.1%}; by batch: "
            + ", ".join(f"{r['batch']}: {r['tokens_per_s']:,.0f}" for r in s["by_batch"])
            + f"; with {s['threads']} threads (the trainer's): "
            + ", ".join(f"{r['batch']}: {r['tokens_per_s']:,.0f}" for r in s["by_batch_threaded"])
        )
    if "iteration" in sections:
        results["iteration"] = it = iteration(args.size, repeats)
        cache = it.pop("compilation_cache")
        for name, r in it.items():
            parts = ", ".join(f"{k.removesuffix('_seconds')} {v:.2f}" for k, v in r["split"].items())
            print(
                f"iteration [{name}]: {r['seconds']:.2f} s ({parts}); compiles after warm-up "
                f"{r['compiles_after_warmup']}, first iteration after {r['seconds_to_first_iteration']:.1f} s"
            )
        it["compilation_cache"] = cache
        print(
            f"first iteration (drift on) with a persistent compilation cache: empty "
            f"{cache['seconds_to_first_iteration_cold']:.1f} s, filled by a previous run "
            f"{cache['seconds_to_first_iteration_warm']:.1f} s"
        )
    if "scaling" in sections:
        results["scaling"] = sc = iteration_scaling(args.size, repeats)
        for r in sc["rows"]:
            parts = ", ".join(f"{k.removesuffix('_seconds')} {v:.3f}" for k, v in r["split"].items())
            print(
                f"iteration, {'tiny' if args.size == 'tiny' else 'default'} config, group size {r['group_size']}, "
                f"up to {r['max_new_tokens']} new tokens ({r['sequences']} sequences, mean length "
                f"{r['completion_len_mean']:.1f}): {r['seconds']:.3f} s, {r['seconds_at_config_cadence']:.3f} s with "
                f"evaluation every {sc['eval_every']} and a save every {sc['checkpoint_every']} ({parts})"
            )
    if "diagnostics" in sections:
        results["diagnostics"] = d = diagnostics_cost(args.size, repeats)
        print(
            f"drift + routing diagnostics, {'tiny' if args.size == 'tiny' else 'default'} config: "
            f"{d['share']:.1%} of an iteration (drift pass {d['drift_share']:.1%}, "
            f"the step's routing split {d['split_share']:.1%}: "
            f"{d['step_with_split'] * 1e3:.1f} vs {d['step_without_split'] * 1e3:.1f} ms per update); whole runs "
            f"{d['on']['seconds']:.3f} s/iteration on, {d['off']['seconds']:.3f} off"
        )
    if "critic" in sections:
        results["critic"] = r = critic_cost(args.size, repeats)
        its = r["iterations"]
        print(
            f"critic, {'tiny' if args.size == 'tiny' else 'default'} config: {r['critic_share']:.1%} of a PPO "
            "iteration "
            f"(train step {r['step_with_critic_seconds'] * 1e3:.1f} vs {r['step_without_critic_seconds'] * 1e3:.1f} ms "
            f"without its update; values pass {r['estimate_seconds'] * 1e3:.1f} ms, the scoring forward "
            f"{r['score_seconds'] * 1e3:.1f} ms); memory: critic params {r['critic_param_bytes'] / 2**20:.2f} MiB + "
            f"moments {r['critic_opt_bytes'] / 2**20:.2f} MiB (policy {r['policy_param_bytes'] / 2**20:.2f} + "
            f"{r['policy_opt_bytes'] / 2**20:.2f}), step temporaries {r['step_with_critic_temp_bytes'] / 2**20:.1f} vs "
            f"{r['step_without_critic_temp_bytes'] / 2**20:.1f} MiB; iteration: "
            + ", ".join(f"{k} {v['seconds']:.3f} s" for k, v in its.items())
        )
    print_targets(results)
    Path(args.out).write_text(json.dumps(results, indent=2, default=float))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    reexec_with_huge_pages()  # as scripts/train.py runs: XLA's big per-call buffers on huge pages
    main()

"""The train step: its MFU on the `default` and `bench` shapes, and `policy_loss`'s share of it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.run.shapes import pieces, random_batch, shape_config
from benchmarks.run.timing import best_time, call_times
from gspo_jax import losses
from gspo_jax import programs as programs_lib
from gspo_jax.algorithms import ALGORITHMS
from gspo_jax.flops import train_flops
from gspo_jax.model_config import ModelConfig


def train_step_times(c, repeats: int, min_seconds: float = 0.0) -> tuple[list[float], int, int, ModelConfig]:
    built, _, params, programs = pieces(c)
    B = built.batch_size // built.train.minibatches
    batch = jax.device_put(random_batch(programs, params, B, c.prompt_len, c.max_new_tokens), programs.batch_shardings)
    state = [programs_lib.init_train_state(programs, params, 0)]

    def step():
        state[0], m, _ = programs.train_step(state[0], batch)
        return m

    return call_times(step, repeats, min_seconds), B, c.prompt_len + c.max_new_tokens, built.model


def train_step_time(c, repeats: int) -> tuple[float, int, int, ModelConfig]:
    times, B, T, cfg = train_step_times(c, repeats)
    return min(times), B, T, cfg


def train_mfu(tiny: bool, repeats: int, peak_flops: float) -> dict:
    out = {}
    for name in ("tiny",) if tiny else ("default", "bench"):
        times, B, T, cfg = train_step_times(shape_config(name), repeats, 0.0 if tiny else 3.0)
        flops = train_flops(cfg, B, T)
        seconds, median = min(times), float(np.median(times))
        out[name] = dict(seconds=seconds, median_seconds=median, calls=len(times), batch=B, tokens=B * T)
        out[name].update(flops=flops, mfu=flops / seconds / peak_flops, mfu_median=flops / median / peak_flops)
    return out


def loss_share(tiny: bool, repeats: int) -> dict:
    c = shape_config("tiny" if tiny else "default")
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

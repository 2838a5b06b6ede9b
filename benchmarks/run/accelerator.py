"""The real-dims shape (issue 40): Qwen3-30B-A3B's layer dims with 2 layers, 64 sequences × (512 + 1024)
tokens per iteration in the size's 4 minibatches. On an accelerator: the train step (time, MFU on
analytic FLOPs against `benchmarks.moe_kernels.peak_bf16`, compiled memory) and the decode step against
its memory floor (every weight read once at the measured copy bandwidth). On a CPU:
compile-only memory of the train step per dispatch (XLA's `memory_analysis`), and the decode step's
bytes accessed (XLA's `cost_analysis`) against the weight bytes it must read."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.run.shapes import iteration_config, pieces, random_batch
from benchmarks.run.timing import best_time
from gspo_jax import flops
from gspo_jax import model as model_lib
from gspo_jax import programs as programs_lib
from gspo_jax.config import base_config, build
from gspo_jax.sampler import Sampler, left_pad


def real_dims_config(dispatch: str = "auto", **model):
    """The qwen3_30b_a3b size at 2 layers on one device: 8 prompts × 8 samples of 512 + 1024 tokens;
    `model` overrides model fields (e.g. remat="none")."""
    c = base_config("gspo", "qwen3_30b_a3b")
    c.model.update(num_layers=2, dispatch=dispatch, **model)
    c.rollout.update(num_groups=8, group_size=8)
    c.mesh.update(data=1, fsdp=1, expert=1, tensor=1)
    return c


def _memory(compiled) -> dict:
    m = compiled.memory_analysis()
    if m is None:
        return {}
    return dict(temp_bytes=int(m.temp_size_in_bytes), argument_bytes=int(m.argument_size_in_bytes))


def train_step(dispatch: str, repeats: int, peak: float, compile_only: bool = False, **model) -> dict:
    """One minibatch's train step (16 × 1536 tokens) of the real-dims shape with `dispatch` (and `model`
    overrides)."""
    c = real_dims_config(dispatch, **model)
    built, _, params, programs = pieces(c)
    B, T = built.batch_size // built.train.minibatches, c.prompt_len + c.max_new_tokens
    cfg = built.model
    out = dict(dispatch=dispatch, **model, batch=B, tokens=B * T, flops=flops.train_flops(cfg, B, T))
    if compile_only:
        state = programs_lib.abstract_train_state(programs, params)
        from gspo_jax.train import TrainBatch

        batch = TrainBatch.abstract(built, B, T)
        out.update(_memory(programs.train_step.lower(state, batch).compile()))
        return out
    batch = jax.device_put(random_batch(programs, params, B, c.prompt_len, c.max_new_tokens), programs.batch_shardings)
    state = programs_lib.init_train_state(programs, params, 0)
    compiled = programs.train_step.lower(state, batch).compile()
    out.update(_memory(compiled))
    box = [state]

    def step():
        box[0], metrics, _ = compiled(box[0], batch)
        return metrics

    out["seconds"] = best_time(step, repeats)
    out["tflops_per_s"] = out["flops"] / out["seconds"] / 1e12
    out["mfu"] = out["flops"] / out["seconds"] / peak
    return out


def decode_step(
    dispatch: str, repeats: int, bandwidth: float, steps: int = 64, chunk: int | None = None, shape: str = "real"
) -> dict:
    """Milliseconds per decode step: (time of 8 + `steps` new tokens - time of 8) / steps, so the
    prefill cancels; against the floor of reading every weight once (the embedding table aside: a
    step gathers B of its rows). `shape` "real": batch 64 after 512-token prompts; "iteration": the
    race shape of `benchmarks.run.shapes` (width 256, 4 layers, 4 experts; batch 128 after 16 tokens).
    `chunk`: decode steps per host round trip (`Sampler(decode_chunk=)`; None: the platform's)."""
    if shape == "real":
        cfg, B, P = build(real_dims_config(dispatch)).model, 64, 512
    else:
        c = iteration_config(shape)
        c.model.dispatch = dispatch
        cfg, B, P = build(c).model, c.rollout.num_groups * c.rollout.group_size, c.prompt_len
    graphdef, state = nnx.split(model_lib.Transformer(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    prompts, mask = left_pad([rng.integers(4, cfg.vocab_size, P) for _ in range(B)], P)
    times, used = {}, None
    for C in (8, 8 + steps):
        sampler = Sampler(graphdef, cfg, B, P, C, decode_chunk=chunk)
        used = sampler.decode_chunk
        times[C] = best_time(lambda s=sampler: s(state, prompts, mask, jax.random.key(0)).tokens, repeats)
    seconds = (times[8 + steps] - times[8]) / steps
    # Each weight read once, at the copy's bytes (read + write) per second.
    floor = _weight_bytes(cfg, state) / bandwidth
    return dict(
        dispatch=dispatch,
        shape=shape,
        batch=B,
        prompt=P,
        decode_chunk=used,
        ms_per_step=seconds * 1e3,
        floor_ms=floor * 1e3,
    )


def _weight_bytes(cfg, state) -> int:
    """Bytes a decode step must read: every weight once, the embedding table aside (B rows gathered)."""
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state)) - cfg.vocab_size * cfg.embed_dim
    return n * jnp.dtype(cfg.jnp_param_dtype).itemsize


def decode_step_bytes(dispatch: str, batch: int = 64, prompt: int = 512, new: int = 1024, sliced: bool = True) -> dict:
    """One decode step of the real-dims model (batch 64, a cache of 512 + 1,024 slots) compiled for
    this host, nothing run: XLA's bytes accessed against the weight bytes. The layers come sliced, as
    the sampler's loop gets them (`Transformer.decode_layers`). XLA counts a loop's body once, so a
    dispatch that loops over expert blocks (`sparse`) is under-counted; `dense` reads every expert.
    `sliced=False`: the step slices each layer out of the stacks itself (what XLA:GPU did every step)."""
    cfg = build(real_dims_config(dispatch)).model
    graphdef, state = model_lib.abstract_model(cfg)
    layers = jax.eval_shape(lambda s: nnx.merge(graphdef, s).decode_layers(), state)
    cache = jax.eval_shape(lambda: model_lib.init_cache(cfg, batch, prompt + new))
    tok = jax.ShapeDtypeStruct((batch, 1), jnp.int32)

    def step(state, layers, cache, tokens, positions):
        logits, aux = nnx.merge(graphdef, state)(tokens, positions, cache=cache, layers=layers if sliced else None)
        return logits, aux.cache

    compiled = jax.jit(step, donate_argnums=2).lower(state, layers, cache, tok, tok).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    weights = _weight_bytes(cfg, state)
    accessed = float(cost.get("bytes accessed", float("nan")))
    return dict(dispatch=dispatch, batch=batch, bytes_accessed=accessed, weight_bytes=weights, ratio=accessed / weights)

"""The real-dims shape (issue 40): Qwen3-30B-A3B's layer dims with 2 layers (`--real-layers`: any
depth), 64 sequences × (512 + 1024) tokens per iteration in the size's 4 minibatches. On an
accelerator: the train step (time, TFLOP/s and MFU on analytic FLOPs against both the measured
`benchmarks.moe_kernels.peak_bf16` and the device's spec sheet, `SPEC_PEAK_BF16`, compiled memory)
and the decode step against its memory floor (every weight read once at the measured copy
bandwidth). On a CPU: compile-only memory of the train step per dispatch (XLA's `memory_analysis`),
and the decode step's bytes accessed (XLA's `cost_analysis`) against the weight bytes it must read."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.run.shapes import iteration_config, pieces, random_batch
from benchmarks.run.timing import best_time
from gspo_jax import flops
from gspo_jax import model as model_lib
from gspo_jax import programs as programs_lib
from gspo_jax.built import build
from gspo_jax.config import base_config
from gspo_jax.sampler import Sampler, SamplerOptions, left_pad

REAL_LAYERS = 2  # the real-dims proxy's default depth (the LM head is ~70% of its FLOPs at 2)

# Dense bf16 matmul peaks from the vendors' spec sheets (no sparsity), by a piece of JAX's device kind
# (`jax.devices()[0].device_kind`), first match wins: what "MFU against the spec" divides by. A device
# not listed has no spec MFU (the runner says so).
SPEC_PEAK_BF16 = (
    ("H100 PCIe", "H100 PCIe", 756e12),
    ("H100 NVL", "H100 NVL", 835e12),
    ("H200 NVL", "H200 NVL", 835e12),
    ("H100", "H100 SXM", 989e12),  # "NVIDIA H100 80GB HBM3" is the SXM part
    ("H200", "H200", 989e12),  # GH200's GPU included
    ("A100", "A100", 312e12),
)


def spec_peak(device_kind: str) -> tuple[str, float] | None:
    """(the part's name, its spec dense bf16 FLOP/s) for a JAX device kind, or None if not in the table."""
    for piece, name, flops_per_s in SPEC_PEAK_BF16:
        if piece.lower() in device_kind.lower():
            return name, flops_per_s
    return None


def throughput(flops: float, seconds: float, measured_peak: float, device_kind: str) -> dict:
    """TFLOP/s of `flops` done in `seconds`, and MFU against the peak measured in this process (where
    one was, `measured_peak` > 0) and against the device's spec peak (`spec_peak`; the `spec_*` keys
    are left out for a device not in the table)."""
    per_s = flops / seconds
    out = dict(tflops_per_s=per_s / 1e12)
    if measured_peak:
        out.update(measured_peak_flops=measured_peak, mfu=per_s / measured_peak)
    spec = spec_peak(device_kind)
    if spec is not None:
        out.update(spec_device=spec[0], spec_peak_flops=spec[1], mfu_spec=per_s / spec[1])
    return out


def mfu_text(r: dict, device_kind: str) -> str:
    """'MFU a% of the measured peak, b% of the spec X TFLOP/s (part)' from `throughput`'s figures,
    saying which peak is missing."""
    parts = [f"MFU {r['mfu']:.1%} of the measured peak" if "mfu" in r else "no measured peak"]
    if "mfu_spec" in r:
        parts.append(f"{r['mfu_spec']:.1%} of the spec {r['spec_peak_flops'] / 1e12:.0f} TFLOP/s ({r['spec_device']})")
    else:
        parts.append(f"no spec peak known for {device_kind!r}: spec MFU omitted")
    return ", ".join(parts)


def real_dims_config(dispatch: str = "auto", layers: int = REAL_LAYERS, **model):
    """The qwen3_30b_a3b size at `layers` layers (2 by default) on one device: 8 prompts × 8 samples of
    512 + 1024 tokens; `model` overrides model fields (e.g. remat="none")."""
    c = base_config("gspo", "qwen3_30b_a3b")
    c.model.update(num_layers=layers, dispatch=dispatch, **model)
    c.rollout.update(num_groups=8, group_size=8)
    c.mesh.update(data=1, fsdp=1, expert=1, tensor=1)
    return c


def _memory(compiled) -> dict:
    m = compiled.memory_analysis()
    if m is None:
        return {}
    return dict(temp_bytes=int(m.temp_size_in_bytes), argument_bytes=int(m.argument_size_in_bytes))


def train_step(
    dispatch: str, repeats: int, peak: float, compile_only: bool = False, layers: int = REAL_LAYERS, **model
) -> dict:
    """One minibatch's train step (16 × 1536 tokens) of the real-dims shape at `layers` layers with
    `dispatch` (and `model` overrides)."""
    c = real_dims_config(dispatch, layers, **model)
    built, _, params, programs = pieces(c)
    B, T = built.batch_size // built.train.minibatches, c.prompt_len + c.max_new_tokens
    cfg = built.model
    out = dict(dispatch=dispatch, layers=layers, **model, batch=B, tokens=B * T, flops=flops.train_flops(cfg, B, T))
    if compile_only:
        state = programs_lib.abstract_train_state(programs, params)
        from gspo_jax.train import TrainBatch

        batch = TrainBatch.abstract(built, B, T)
        out.update(_memory(programs.train_step.lower(state, batch).compile()))
        return out
    batch = jax.device_put(random_batch(programs, params, B, c.prompt_len, c.max_new_tokens), programs.batch_shardings)
    state = programs_lib.init_train_state(programs, params, 0)
    compiled = programs.train_step.compile(state, batch)
    out.update(_memory(compiled.executable))
    box = [state]

    def step():
        box[0], metrics, _ = compiled(box[0], batch)
        return metrics

    out["seconds"] = best_time(step, repeats)
    out.update(throughput(out["flops"], out["seconds"], peak, jax.devices()[0].device_kind))
    return out


def decode_step(
    dispatch: str,
    repeats: int,
    bandwidth: float,
    steps: int = 64,
    chunk: int | None = None,
    shape: str = "real",
    layers: int = REAL_LAYERS,
) -> dict:
    """Milliseconds per decode step: (time of 8 + `steps` new tokens - time of 8) / steps, so the
    prefill cancels; against the floor of reading every weight once (the embedding table aside: a
    step gathers B of its rows). `shape` "real": batch 64 after 512-token prompts; "iteration": the
    race shape of `benchmarks.run.shapes` (width 256, 4 layers, 4 experts; batch 128 after 16 tokens).
    `chunk`: decode steps per host round trip (`SamplerOptions.decode_chunk`; None: the platform's).
    `layers`: the real shape's depth."""
    if shape == "real":
        cfg, B, P = build(real_dims_config(dispatch, layers)).model, 64, 512
    else:
        c = iteration_config(shape)
        c.model.dispatch = dispatch
        cfg, B, P = build(c).model, c.rollout.num_groups * c.rollout.group_size, c.prompt_len
    graphdef, state = nnx.split(model_lib.Transformer(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    prompts, mask = left_pad([rng.integers(4, cfg.vocab_size, P) for _ in range(B)], P)
    times, used = {}, None
    for C in (8, 8 + steps):
        sampler = Sampler(graphdef, cfg, B, P, C, options=SamplerOptions(decode_chunk=chunk))
        used = sampler.decode_chunk
        times[C] = best_time(lambda s=sampler: s(state, prompts, mask, jax.random.key(0)).tokens, repeats)
    seconds = (times[8 + steps] - times[8]) / steps
    # Each weight read once, at the copy's bytes (read + write) per second.
    floor = _weight_bytes(cfg, state) / bandwidth
    return dict(
        dispatch=dispatch,
        shape=shape,
        layers=cfg.num_layers,
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


def _one_decode_step(graphdef, sliced: bool = True):
    """One decode step of the model alone, jitted with the cache donated: a token per row through every
    layer against the cache, no sampling. `sliced`: the layers come in sliced out of the stacks, as the
    sampler's loop has them (`Transformer.decode_layers`); else the step slices them itself."""

    def step(state, layers, cache, tokens, positions):
        logits, aux = nnx.merge(graphdef, state)(tokens, positions, cache=cache, layers=layers if sliced else None)
        return logits, aux.cache

    return jax.jit(step, donate_argnums=2)


def bare_decode_seconds(
    graphdef, cfg, state, batch: int, prompt: int, new: int, repeats: int, steps: int = 32
) -> float:
    """Seconds per decode step of the model alone (`_one_decode_step`) at `batch` rows and a cache of
    `prompt` + `new` slots (attention reads every slot, so its cost is that of any step of a rollout
    with those lengths): `steps` steps in a row (at most `new`), as the steps after a `prompt`-token
    prefill, the cache handed from one to the next, the layers sliced once outside; best of
    `repeats` after a warm-up."""
    steps = min(steps, new)
    fn = _one_decode_step(graphdef)
    layers = jax.jit(lambda s: nnx.merge(graphdef, s).decode_layers())(state)
    tokens = jnp.full((batch, 1), 4, jnp.int32)
    positions = [jnp.full((batch, 1), prompt + i, jnp.int32) for i in range(steps)]
    # The cache as a step returns it (its placement too: one compile), as after a prefill of `prompt` tokens.
    _, box = fn(state, layers, model_lib.init_cache(cfg, batch, prompt + new), tokens, positions[0])
    start = jax.jit(lambda c: dataclasses.replace(c, index=jnp.full_like(c.index, prompt)), donate_argnums=0)
    box = [start(box)]

    def run():
        cache, logits = box[0], None
        for pos in positions:
            logits, cache = fn(state, layers, cache, tokens, pos)
        box[0] = start(cache)
        return logits

    return best_time(run, repeats) / steps


def decode_step_bytes(
    dispatch: str,
    batch: int = 64,
    prompt: int = 512,
    new: int = 1024,
    sliced: bool = True,
    layers: int = REAL_LAYERS,
) -> dict:
    """One decode step of the real-dims model (batch 64, a cache of 512 + 1,024 slots) compiled for
    this host, nothing run: XLA's bytes accessed against the weight bytes. The layers come sliced, as
    the sampler's loop gets them (`Transformer.decode_layers`). XLA counts a loop's body once, so a
    dispatch that loops over expert blocks (`sparse`) is under-counted; `dense` reads every expert.
    `sliced=False`: the step slices each layer out of the stacks itself (what XLA:GPU did every step)."""
    cfg = build(real_dims_config(dispatch, layers)).model
    graphdef, state = model_lib.abstract_model(cfg)
    decode_layers = jax.eval_shape(lambda s: nnx.merge(graphdef, s).decode_layers(), state)
    cache = jax.eval_shape(lambda: model_lib.init_cache(cfg, batch, prompt + new))
    tok = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
    compiled = _one_decode_step(graphdef, sliced).lower(state, decode_layers, cache, tok, tok).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    weights = _weight_bytes(cfg, state)
    accessed = float(cost.get("bytes accessed", float("nan")))
    return dict(
        dispatch=dispatch,
        layers=layers,
        batch=batch,
        bytes_accessed=accessed,
        weight_bytes=weights,
        ratio=accessed / weights,
    )

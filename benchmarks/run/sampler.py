"""The sampler's generated tokens/s: against the naive decoder (no KV cache), as decode MFU, and
against batch size and threads."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.run.shapes import iteration_config
from benchmarks.run.timing import best_time
from gspo_jax import compiles
from gspo_jax import model as model_lib
from gspo_jax.built import build
from gspo_jax.flops import matmul_params
from gspo_jax.rollout import RolloutConfig
from gspo_jax.sampler import Sampler, SamplerOptions, left_pad, sample_logits


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


def sampler_throughput(tiny: bool, repeats: int, peak_flops: float) -> dict:
    c = iteration_config("tiny" if tiny else "iteration")
    cfg, options = build(c).model, compiles.step_options(c.cpu_fast_compile)  # compiled as the trainer does
    graphdef, state = nnx.split(model_lib.Transformer(cfg, rngs=nnx.Rngs(0)))
    P, C = (8, 8) if tiny else (16, 64)
    rng = np.random.default_rng(0)
    t, k, p = jnp.float32(1.0), jnp.int32(0), jnp.float32(1.0)

    def run(batch: int, threads: int = 1) -> float:
        prompts, mask = left_pad([rng.integers(4, cfg.vocab_size, P) for _ in range(batch)], P)
        sampler = Sampler(graphdef, cfg, batch, P, C, options=SamplerOptions(threads=threads, compiler_options=options))
        key = jax.random.key(0)  # no EOS: every row generates C tokens
        return best_time(lambda: sampler(state, prompts, mask, key, temperature=t, top_k=k, top_p=p).tokens, repeats)

    flops_per_token = 2 * matmul_params(cfg)
    batches = (8, 16) if tiny else (8, 16, 32, 64, 128, 256)
    scaling = []
    for b in batches:
        seconds = run(b)
        tps = b * C / seconds
        scaling.append(dict(batch=b, seconds=seconds, tokens_per_s=tps, decode_mfu=tps * flops_per_token / peak_flops))
    # As the trainer samples on one device: the batch in `rollout.sampler_threads` slices at once.
    threads = RolloutConfig(num_groups=1, group_size=2).threads(devices=1)
    threaded = [dict(batch=b, tokens_per_s=b * C / run(b, threads)) for b in batches[-3:-1]]
    B = 16 if tiny else 64
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

"""Generated tokens/s of the KV-cache `while_loop` sampler vs a naive decoder, in one process.

The naive decoder re-runs the full forward over the fixed [B, P+N] buffer at every step (compiled
once, same model, same sampling code), which is what a sampler without a KV cache does.

    python benchmarks/sampler.py --batch 8 --prompt 64 --new 128
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gspo_jax import model as model_lib
from gspo_jax.sampler import Sampler, left_pad, sample_logits


def naive_decoder(graphdef, prompt_len: int, max_new: int, max_top_k: int):
    @functools.partial(jax.jit, donate_argnums=(1, 2))
    def step(state, seq_BL, valid_BL, key, i, temperature, top_k, top_p):
        logits_BLV, _ = model_lib.apply(graphdef, state, seq_BL, model_lib.positions_from_mask(valid_BL))
        last_BV = jax.lax.dynamic_index_in_dim(logits_BLV, prompt_len + i - 1, axis=1, keepdims=False)
        tok_B, _ = sample_logits(last_BV, key, temperature, top_k, top_p, max_top_k)
        seq_BL = jax.lax.dynamic_update_slice_in_dim(seq_BL, tok_B[:, None], prompt_len + i, axis=1)
        valid_BL = jax.lax.dynamic_update_slice_in_dim(
            valid_BL, jnp.ones_like(tok_B, bool)[:, None], prompt_len + i, axis=1
        )
        return seq_BL, valid_BL

    def generate(state, prompts, mask, key, temperature, top_k, top_p):
        B = prompts.shape[0]
        seq = jnp.concatenate([jnp.asarray(prompts), jnp.zeros((B, max_new), jnp.int32)], 1)
        valid = jnp.concatenate([jnp.asarray(mask), jnp.zeros((B, max_new), bool)], 1)
        for i in range(max_new):
            key, sub = jax.random.split(key)
            seq, valid = step(state, seq, valid, sub, jnp.int32(i), temperature, top_k, top_p)
        return seq

    return generate


def timed(fn, repeats):
    fn()  # compile and warm up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help=f"a model preset: {tuple(model_lib.PRESETS)}")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    cfg = model_lib.get_config(args.model)
    graphdef, state = nnx.split(model_lib.Transformer(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    prompts, mask = left_pad(
        [rng.integers(4, cfg.vocab_size, rng.integers(args.prompt // 2, args.prompt + 1)) for _ in range(args.batch)],
        args.prompt,
    )
    t, k, p = jnp.float32(1.0), jnp.int32(20), jnp.float32(0.95)
    sampler = Sampler(graphdef, cfg, args.batch, args.prompt, args.new, max_top_k=64)
    naive = naive_decoder(graphdef, args.prompt, args.new, 64)
    key = jax.random.key(0)
    # No EOS: both generate exactly `new` tokens per row.
    t_fast = timed(lambda: sampler(state, prompts, mask, key, temperature=t, top_k=k, top_p=p).tokens, args.repeats)
    t_naive = timed(lambda: naive(state, prompts, mask, key, t, k, p), args.repeats)
    n_tok = args.batch * args.new
    print(
        f"device: {jax.devices()[0].platform}  model: {args.model}  batch {args.batch}, "
        f"prompt {args.prompt}, new {args.new}"
    )
    print("| decoder | seconds | generated tokens/s |\n| --- | --- | --- |")
    print(f"| KV cache + while_loop | {t_fast:.3f} | {n_tok / t_fast:,.0f} |")
    print(f"| naive full forward per step | {t_naive:.3f} | {n_tok / t_naive:,.0f} |")
    print(f"speed-up: {t_naive / t_fast:.1f}x")


if __name__ == "__main__":
    main()

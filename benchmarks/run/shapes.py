"""The benchmark shapes: the trainer's config at each (`shape_config`, `iteration_config`), its
compiled programs (`pieces`) and a well-formed random minibatch (`random_batch`)."""

from __future__ import annotations

import jax.numpy as jnp
import ml_collections
import numpy as np

from gspo_jax import model as model_lib
from gspo_jax import programs as programs_lib
from gspo_jax.built import build
from gspo_jax.config import base_config
from gspo_jax.sharding import mesh_from_config
from gspo_jax.train import TrainBatch

SHAPES = ("tiny", "default", "bench", "iteration")


def shape_config(shape: str, algorithm: str = "gspo") -> ml_collections.ConfigDict:
    """The trainer's config of `algorithm` at a benchmark shape (one of `SHAPES`), without a warm start:
    `tiny` (the smoke test) the tiny preset with one stack of two MoE layers of four experts (every
    path of a run, with about a quarter less to compile than the preset's dense + MoE stacks of eight
    experts); `default` as configured; `bench` wide enough for matmuls to dominate (width 512, 8
    layers, 16 experts top-2); `iteration` a random MoE of width 256, 4 layers, all MoE with 4
    experts top-2 (GQA 4/2, expert width 256), 16 prompts × 8 samples, prompts of 16 tokens and up
    to 64 new tokens."""
    if shape not in SHAPES:
        raise ValueError(f"shape {shape!r} is not one of {SHAPES}")
    c = base_config(algorithm, "tiny" if shape == "tiny" else "default")
    if shape == "tiny":
        c.model.update(num_layers=2, dense_layers=(), num_experts=4)
    if shape == "bench":
        c.model.update(embed_dim=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64, mlp_dim=1024)
        c.model.update(num_experts=16, top_k=2, moe_mlp_dim=512)
        # A large model on CPU: XLA's default code generation (the fast-compile loops are ~3x slower
        # over its 117 MiB expert stacks: the step 750 -> 905 ms, docs/BENCHMARKS.md).
        c.cpu_fast_compile = False
    if shape == "iteration":
        c.model.update(embed_dim=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, dense_layers=())
        c.model.update(num_experts=4, top_k=2, moe_mlp_dim=256)
        c.rollout.update(num_groups=16, group_size=8)
        c.prompt_len, c.max_new_tokens = 16, 64
    c.warm_start.steps = 0
    return c


def iteration_config(shape: str) -> ml_collections.ConfigDict:
    """`shape_config(shape)` run as the iteration sections run it: one optimizer step per iteration,
    six iterations, no KL, evaluation and saves out of the way."""
    c = shape_config(shape)
    c.train.update(minibatches=1, epochs=1, num_iterations=6, eval_every=1000, eval_batches=1, checkpoint_every=1000)
    return c


def pieces(c: ml_collections.ConfigDict):
    """(built config, graphdef, params, compiled programs) of config `c`, as the trainer makes them."""
    built = build(c)
    mesh = mesh_from_config(**built.mesh.axes())
    graphdef, params = programs_lib.init_policy(built, mesh)
    return built, graphdef, params, programs_lib.compile_programs(built, graphdef, params, mesh)


def random_batch(programs, params, B: int, P: int, C: int, seed: int = 0) -> TrainBatch:
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
    return TrainBatch(
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

"""Sampler–trainer mismatch: how far the engine that sampled a rollout (π_sampler) is from the trainer's
recomputation at the same parameters (π_old), in log-probs and in routing.

Per completion token δ = old_logp − sampler_logp and w = exp(δ) ("Sampler–trainer mismatch" in
docs/ALGORITHMS.md). Here both are the same JAX model, so the mismatch is what precision, kernels and
batch layout leave; an inference engine in bf16 would show more (the R3 paper: ~10% of routers).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gspo_jax.losses import clamp_log_ratio, kl_k3
from gspo_jax.routing import routing_drift

Array = jax.Array


def mismatch_metrics(
    sampler_logp_BT: Array,
    trainer_logp_BT: Array,
    mask_BT: Array,
    sampler_topk_BLTK: Array,
    trainer_topk_BLTK: Array,
    clamp: float = 20.0,
) -> dict[str, Array]:
    """float32 scalars over completion tokens (all 0 without any):

    kl_k3            mean of exp(δ) − δ − 1: KL(π_sampler ‖ π_old) estimated on the sampler's own tokens
    logp_abs_mean    mean |δ|;  logp_abs_max  max |δ|
    ratio_above_2    fraction of tokens with w > 2;  ratio_below_half  with w < 1/2
    router_flip_rate fraction of (token, MoE layer) whose top-k set differs between the two routings
    token_any_flip   fraction of tokens whose set differs in at least one layer
    """
    m = mask_BT.astype(bool)
    n = jnp.maximum(jnp.sum(m), 1).astype(jnp.float32)
    raw = jnp.where(m, trainer_logp_BT.astype(jnp.float32) - sampler_logp_BT, 0.0)
    delta = clamp_log_ratio(raw, clamp)
    frac = lambda b: jnp.sum(b & m) / n
    drift = routing_drift(sampler_topk_BLTK, trainer_topk_BLTK, m)
    return dict(
        kl_k3=jnp.sum(jnp.where(m, kl_k3(delta), 0.0)) / n,
        logp_abs_mean=jnp.sum(jnp.abs(delta)) / n,
        logp_abs_max=jnp.max(jnp.abs(raw)),  # not clamped: how large it really got
        ratio_above_2=frac(delta > jnp.log(2.0)),
        ratio_below_half=frac(delta < -jnp.log(2.0)),
        router_flip_rate=drift["router_flip_rate"],
        token_any_flip=drift["token_any_flip"],
    )

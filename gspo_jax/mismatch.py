"""Sampler–trainer mismatch: how far the engine that sampled a rollout (π_sampler) is from the trainer's
recomputation at the same parameters (π_old), in log-probs and in routing; the corrections that
reweight (TIS) or mask (MIS) the loss by π_old / π_sampler; and the masks that zero a token's or a
completion's loss inside the normalised sum: IcePop, the geometric-mean sequence mask and DeepSeek-V3.2's
off-policy sequence mask.

Per completion token δ = old_logp − sampler_logp and w = exp(δ) ("Sampler–trainer mismatch" in
docs/ALGORITHMS.md). Here both are the same JAX model, so the mismatch is what precision, kernels and
batch layout leave; an inference engine in bf16 would show more (the R3 paper: ~10% of routers).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from gspo_jax.losses import CORRECTIONS, IS_LEVELS, LossConfig, sequence_valid
from gspo_jax.metrics import Mean, Metric
from gspo_jax.ratios import clamp_log_ratio, kl_k3
from gspo_jax.routing import routing_drift
from gspo_jax.validation import check_choice

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


# ----------------------------------------------------------------------------------------------
# Corrections: importance weights π_old / π_sampler on the loss (they compose with every objective).
# The choices, `losses.CORRECTIONS` and `losses.IS_LEVELS`, live beside the `LossConfig` that names them.


class Correction(NamedTuple):
    """What a correction does to a batch's loss: a stop-gradient weight per token ([B, T]) or per
    sequence ([B]), the tokens that stay in the loss and its denominator, and the tokens ([B, T]) or
    sequences ([B]) whose loss counts inside an unchanged denominator (`keep`, the masks)."""

    weight: Array | None  # None: no weighting (MIS, none)
    mask_BT: Array  # bool [B, T]
    metrics: dict[str, Metric]
    keep: Array | None = None  # bool [B, T] or [B]; None: every one


def correction(
    kind: str, level: str, cap: float, old_logp_BT: Array, sampler_logp_BT: Array, mask_BT: Array, clamp: float = 20.0
) -> Correction:
    """TIS: weight sg(min(w, C)), w = π_old / π_sampler per token, or per sequence Π_t w_t (summed in
    log space, clamped). MIS: drop tokens (sequences) whose w lies outside [1/C, C]. With equal log-probs
    both are the identity. Metrics: `is_weight_mean` (mean w over tokens or sequences) and `is_cut_frac`
    (the fraction truncated, TIS, or masked, MIS)."""
    check_choice("correction", "kind", kind, CORRECTIONS)
    check_choice("correction", "level", level, IS_LEVELS)
    m = jnp.asarray(mask_BT) > 0
    if kind == "none":
        return Correction(None, m, {})
    delta_BT = jnp.where(m, clamp_log_ratio(old_logp_BT.astype(jnp.float32) - sampler_logp_BT, clamp), 0.0)
    if level == "token":
        log_w, valid = delta_BT, m
    else:
        log_w, valid = clamp_log_ratio(jnp.sum(delta_BT, axis=-1), clamp), sequence_valid(m)
    log_cap = jnp.log(jnp.float32(cap))
    if kind == "tis":
        cut = valid & (log_w > log_cap)
        weight, keep_BT = jax.lax.stop_gradient(jnp.exp(jnp.minimum(log_w, log_cap))), m
    else:  # mis
        cut = valid & (jnp.abs(log_w) > log_cap)
        weight, keep_BT = None, m & ~(cut if level == "token" else cut[:, None])
    count = jnp.sum(valid).astype(jnp.float32)
    metrics = {
        "is_weight_mean": Mean(jnp.sum(jnp.where(valid, jnp.exp(log_w), 0.0)), count, 1.0),
        "is_cut_frac": Mean(jnp.sum(cut).astype(jnp.float32), count),
    }
    return Correction(weight, keep_BT, metrics)


def _log_w(old_logp_BT: Array, sampler_logp_BT: Array, m_BT: Array, clamp: float) -> Array:
    """log w = clamp(π_old − π_sampler log-probs), exactly 0 off the mask, float32 [B, T]."""
    return jnp.where(m_BT, clamp_log_ratio(old_logp_BT.astype(jnp.float32) - sampler_logp_BT, clamp), 0.0)


def icepop_mask(
    low: float, high: float, old_logp_BT: Array, sampler_logp_BT: Array, mask_BT: Array, clamp: float = 20.0
) -> tuple[Array, dict[str, Metric]]:
    """IcePop (Ring-1T, arXiv 2510.18855): keep a token iff w = π_old / π_sampler lies in [low, high];
    bool [B, T]. Metric `icepop_masked_frac`: the share of mask tokens outside."""
    m = jnp.asarray(mask_BT) > 0
    log_w = _log_w(old_logp_BT, sampler_logp_BT, m, clamp)
    out = m & ((log_w < jnp.log(jnp.float32(low))) | (log_w > jnp.log(jnp.float32(high))))
    frac = Mean(jnp.sum(out).astype(jnp.float32), jnp.sum(m).astype(jnp.float32))
    return ~out, {"icepop_masked_frac": frac}


def geometric_mask(
    delta: float, old_logp_BT: Array, sampler_logp_BT: Array, mask_BT: Array, clamp: float = 20.0
) -> tuple[Array, dict[str, Metric]]:
    """Keep a completion iff the geometric mean of its w, exp(Σ_t m log w_t / n), lies in [1 − δ, 1 + δ]
    (SkyRL's geometric sequence mask; verl's Geo-RS); bool [B]. Metric `geo_masked_frac`: the share of
    valid completions outside."""
    m = jnp.asarray(mask_BT) > 0
    valid = sequence_valid(m)
    log_g = jnp.sum(_log_w(old_logp_BT, sampler_logp_BT, m, clamp), axis=-1) / jnp.maximum(jnp.sum(m, axis=-1), 1)
    out = valid & ((log_g < jnp.log1p(-jnp.float32(delta))) | (log_g > jnp.log1p(jnp.float32(delta))))
    frac = Mean(jnp.sum(out).astype(jnp.float32), jnp.sum(valid).astype(jnp.float32))
    return ~out, {"geo_masked_frac": frac}


def off_policy_mask(
    delta: float, logp_BT: Array, sampler_logp_BT: Array, advantages: Array, mask_BT: Array
) -> tuple[Array, dict[str, Metric]]:
    """Off-policy sequence masking (DeepSeek-V3.2, arXiv 2512.02556; TRL's `off_policy_mask_threshold`):
    drop a completion with A < 0 whose mean over its tokens of log π_sampler − log π_θ exceeds δ. Keep
    is bool [B] for advantages [B], [B, T] for per-token ones (each token by its own A, as the paper's
    M_{i,t}). Metrics: `opsm_masked_frac` (share of valid completions, or of mask tokens, dropped) and
    `opsm_kl_mean` (the mean log-ratio over valid completions). No gradient flows through the mask."""
    m = jnp.asarray(mask_BT) > 0
    valid = sequence_valid(m)
    diff_BT = jnp.where(m, sampler_logp_BT.astype(jnp.float32) - jax.lax.stop_gradient(logp_BT), 0.0)
    kl_B = jnp.sum(diff_BT, axis=-1) / jnp.maximum(jnp.sum(m, axis=-1), 1)
    adv = jnp.asarray(advantages)
    far = valid & (kl_B > delta)
    out = (adv < 0) & (far if adv.ndim == 1 else far[:, None] & m)
    units = valid if adv.ndim == 1 else m
    metrics = {
        "opsm_masked_frac": Mean(jnp.sum(out).astype(jnp.float32), jnp.sum(units).astype(jnp.float32)),
        "opsm_kl_mean": Mean(jnp.sum(jnp.where(valid, kl_B, 0.0)), jnp.sum(valid).astype(jnp.float32)),
    }
    return ~out, metrics


def and_keep(a: Array | None, b: Array | None) -> Array | None:
    """Both keep masks at once ([B] with [B, T] gives [B, T]); None is keep-all."""
    if a is None or b is None:
        return b if a is None else a
    if a.ndim != b.ndim:
        a, b = (x[:, None] if x.ndim == 1 else x for x in (a, b))
    return a & b


def corrections(cfg: LossConfig, old_logp_BT: Array, sampler_logp_BT: Array, mask_BT: Array) -> Correction:
    """The correction and the masks `cfg` asks for that π_old and π_sampler decide (so known before the
    update; off-policy masking depends on π_θ: `off_policy_mask`): TIS / MIS (`correction`), then
    IcePop and the geometric mask as `keep` ([B, T] with IcePop, [B] with the geometric mask alone)."""
    clamp = cfg.log_ratio_clamp
    c = correction(cfg.is_correction, cfg.is_level, cfg.is_cap, old_logp_BT, sampler_logp_BT, mask_BT, clamp)
    keep, metrics = None, dict(c.metrics)
    if cfg.icepop:
        k, more = icepop_mask(cfg.icepop_low, cfg.icepop_high, old_logp_BT, sampler_logp_BT, mask_BT, clamp)
        keep = and_keep(keep, k)
        metrics.update(more)
    if cfg.geo_mask_delta is not None:
        k, more = geometric_mask(cfg.geo_mask_delta, old_logp_BT, sampler_logp_BT, mask_BT, clamp)
        keep = and_keep(keep, k)
        metrics.update(more)
    return c._replace(metrics=metrics, keep=keep)


def sampler_mismatch(batch, trainer_logp_BT: Array, trainer_topk_BLTK: Array) -> dict[str, float]:
    """`mismatch_metrics` of a rollout's (`rollout.RolloutBatch`) sampler log-probs and routing against
    the trainer's, as `mismatch_*` (the largest |δ| keeps its older name, `old_logp_max_diff`); reduced
    on the mesh, so only scalars reach the host."""
    out = _mismatch(batch.sampler_logp, trainer_logp_BT, batch.completion_mask, batch.topk, trainer_topk_BLTK)
    return {("old_logp_max_diff" if k == "logp_abs_max" else f"mismatch_{k}"): float(v) for k, v in out.items()}


_mismatch = jax.jit(mismatch_metrics)

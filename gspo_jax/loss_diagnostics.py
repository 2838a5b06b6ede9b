"""What a policy loss reports besides its value: clip fractions, ratio ranges, approximate KL, the
gradient weight and the split by flipped routing, as typed metrics that merge (`gspo_jax.metrics`).

Everything under "Diagnostics" in docs/ALGORITHMS.md; `gspo_jax.losses.policy_loss` returns them with
its loss. All of it is computed without gradient. Shape letters: see `gspo_jax/__init__.py`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from gspo_jax.metrics import Max, Mean, Metric, Min, Quantile, Sum, histogram
from gspo_jax.ratios import kl_k3, masked_sum

Array = jax.Array


class PolicyTerms(NamedTuple):
    """The policy part of a loss before its denominator, and what its diagnostics read."""

    numerator: Array  # the aggregation's numerator: the policy losses summed
    log_s_B: Array  # each sequence's log-ratio, for the seq_ratio_* diagnostics
    low_BT: Array  # bool: tokens clipped at the low side (a sequence's: all its tokens)
    high_BT: Array  # bool: ... at the high side
    dual_BT: Array  # bool: ... capped by the dual clip
    seq_clipped_B: Array  # bool: sequences with anything clipped
    weight_BT: Array  # each token's gradient weight relative to A·∇logp


class DiagnosticInputs(NamedTuple):
    """What the diagnostics read: a loss's policy terms and the batch they were computed on."""

    delta_BT: Array  # clamp(log π_θ / π_old) per token (without RSPO's router-shift weight)
    adv: Array  # [B] or [B, T]
    mask_BT: Array  # bool: completion tokens
    seq_ok_B: Array  # bool: sequences with at least one completion token
    terms: PolicyTerms  # the ratios' clip decisions and gradient weights


def _masked_min_max_mean(x: Array, mask: Array) -> tuple[Min, Max, Mean]:
    """Min, max and mean over masked entries, as metrics that merge; 1.0 for all three when empty."""
    count = jnp.sum(mask)
    lo = jnp.min(jnp.where(mask, x, jnp.inf))
    hi = jnp.max(jnp.where(mask, x, -jnp.inf))
    return Min(lo, count, 1.0), Max(hi, count, 1.0), Mean(masked_sum(x, mask), count, 1.0)


def diagnostics(x: DiagnosticInputs) -> dict[str, Metric]:
    """Everything under "Diagnostics" in docs/ALGORITHMS.md, as float32 metrics (no gradient)."""
    sg = jax.lax.stop_gradient
    p, adv, mask_BT, seq_ok_B = x.terms, x.adv, x.mask_BT, x.seq_ok_B
    delta_BT, log_s_B, weight_BT = sg(x.delta_BT), sg(p.log_s_B), sg(p.weight_BT)
    low_BT, high_BT, dual_BT = p.low_BT, p.high_BT, p.dual_BT
    n_tok = jnp.sum(mask_BT).astype(jnp.float32)
    n_seq = jnp.sum(seq_ok_B).astype(jnp.float32)
    frac = lambda b: Mean(jnp.sum(b).astype(jnp.float32), n_tok)
    r_min, r_max, r_mean = _masked_min_max_mean(jnp.exp(delta_BT), mask_BT)
    s_min, s_max, s_mean = _masked_min_max_mean(jnp.exp(log_s_B), seq_ok_B)
    zero_adv_B = (adv == 0) if adv.ndim == 1 else jnp.all((adv == 0) | ~mask_BT, axis=-1)
    return {
        "clip_frac": frac(low_BT | high_BT | dual_BT),
        "clip_frac_low": frac(low_BT),
        "clip_frac_high": frac(high_BT),
        "dual_clip_frac": frac(dual_BT),
        "seq_clip_frac": Mean(jnp.sum(p.seq_clipped_B & seq_ok_B).astype(jnp.float32), n_seq),
        "ratio_mean": r_mean,
        "ratio_min": r_min,
        "ratio_max": r_max,
        "seq_ratio_mean": s_mean,
        "seq_ratio_min": s_min,
        "seq_ratio_max": s_max,
        "approx_kl": Mean(masked_sum(kl_k3(delta_BT), mask_BT), n_tok),
        "grad_weight_mean": Mean(masked_sum(weight_BT, mask_BT), n_tok),
        "zero_adv_frac": Mean(jnp.sum(zero_adv_B & seq_ok_B).astype(jnp.float32), n_seq),
        "num_tokens": Sum(n_tok),
        "num_seqs": Sum(n_seq),
    }


# A ratio's tail: outside [1/TAIL, TAIL] (|log r| > log TAIL), and the TAIL_Q quantile of |log r|.
TAIL, TAIL_Q = 2.0, 0.99


def split_diagnostics(delta_BT: Array, clipped_BT: Array, mask_BT: Array, flipped_BT: Array) -> dict[str, Metric]:
    """Clip fraction, mean |log r| and the ratio's tail (the fraction outside [0.5, 2] and the 99th
    percentile of |log r|, over the iteration's tokens) over the tokens in `flipped_BT` and over the
    rest, the flipped share of tokens, and the same tail for each sequence's length-normalised
    log-ratio (mean_t log r, whatever the objective): does clipping land on the tokens whose routing
    moved, and do their ratios reach extremes? A side with no token reports NaN (undefined, not 0)."""
    sg = jax.lax.stop_gradient
    delta_BT, mask_BT = sg(delta_BT), mask_BT.astype(bool)
    abs_BT, far = jnp.abs(delta_BT), math.log(TAIL)
    out: dict[str, Metric] = {}
    for name, side_BT in (("flipped", flipped_BT & mask_BT), ("unflipped", ~flipped_BT & mask_BT)):
        n = jnp.sum(side_BT).astype(jnp.float32)
        out[f"clip_frac_{name}"] = Mean(jnp.sum(clipped_BT & side_BT).astype(jnp.float32), n, math.nan)
        out[f"abs_log_ratio_{name}"] = Mean(masked_sum(abs_BT, side_BT), n, math.nan)
        out[f"ratio_tail_frac_{name}"] = Mean(jnp.sum((abs_BT > far) & side_BT).astype(jnp.float32), n, math.nan)
        out[f"abs_log_ratio_p99_{name}"] = Quantile(histogram(abs_BT, side_BT), TAIL_Q)
    out["flipped_frac"] = Mean(jnp.sum(flipped_BT & mask_BT).astype(jnp.float32), jnp.sum(mask_BT).astype(jnp.float32))
    n_B = jnp.sum(mask_BT, axis=-1)
    seq_B = n_B > 0
    abs_log_s_B = jnp.abs(masked_sum(delta_BT, mask_BT, axis=-1) / jnp.maximum(n_B, 1))
    out["seq_ratio_tail_frac"] = Mean(
        jnp.sum((abs_log_s_B > far) & seq_B).astype(jnp.float32), jnp.sum(seq_B), math.nan
    )
    out["seq_abs_log_ratio_p99"] = Quantile(histogram(abs_log_s_B, seq_B), TAIL_Q)
    return out

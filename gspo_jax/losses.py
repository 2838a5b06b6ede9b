"""Critic-free policy losses (GRPO, DAPO, GSPO, GSPO-token, Dr.GRPO, GMPO, CISPO, SAPO, VESPO).

Every loss is a pure function of per-token log-probabilities: it never sees the model. A loss is
assembled from orthogonal pieces chosen by a frozen `LossConfig` (the ratios and gates are in
`gspo_jax.ratios`, the diagnostics in `gspo_jax.loss_diagnostics`):

  ratio        how π_θ/π_old is formed: per token, per sequence (GSPO), per sequence with
               per-token gradients (GSPO-token), as a geometric mean of log-clipped tokens (GMPO),
               or as the plain product of the token ratios, without GSPO's 1/|o| (VESPO's W), per
               sequence or with per-token gradients
  gate         what turns (ratio, advantage) into a loss: the PPO clip, CISPO's clipped
               stop-gradient weight, SAPO's soft sigmoid gate, or VESPO's gamma kernel
  aggregation  how per-token (or per-sequence) losses become one number

and, from outside, weights and masks on it (`LossWeights`): the sampler–trainer correction
(`is_weight`), the mismatch masks (`keep`, zeroed inside the sum) and RSPO's router-shift weight on the
ratio (`router_shift`).

Shape letters: see `gspo_jax/__init__.py`. `mask_BT` is 1 on completion tokens, 0 on prompt and
padding. All math is float32 whatever the input dtype. Formulas: docs/ALGORITHMS.md. Which loss each
algorithm uses is declared in `gspo_jax/algorithms.py`.

Global-batch aggregation: a loss is `numerator / denominator`. `loss_denominator(cfg, mask)` on the
*whole* batch, passed as `denominator=` to `policy_loss` on each minibatch or device shard, makes the
sum of the pieces equal the full-batch loss (and gradient). The metrics say the same in their types
(`gspo_jax.metrics`): the loss terms are `Sum`s (pieces over one global denominator add), the
diagnostics `Mean`s of a sum and a count, so merging the pieces' metrics gives the full batch's.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

from gspo_jax import router_shift as router_shift_lib
from gspo_jax.loss_diagnostics import DiagnosticInputs, PolicyTerms, diagnostics, split_diagnostics
from gspo_jax.metrics import Mean, Metric, Sum
from gspo_jax.ratios import (
    GATE_FNS,
    KL_FNS,
    VESPO_LOG_W_MIN,
    clamp_log_ratio,
    geometric_log_ratio,
    masked_log_ratio,
    masked_sum,
    sequence_log_ratio,
    sequence_sum_log_ratio,
    sequence_sum_token_log_ratio,
    sequence_token_log_ratio,
)
from gspo_jax.validation import check, check_choice, check_number, fail

Array = jax.Array

RATIOS = ("token", "sequence", "sequence_token", "geometric", "sequence_sum", "sequence_sum_token")
GATES = ("clip", "cispo", "sapo", "vespo")
AGGREGATIONS = ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3")
# The sampler–trainer correction (`gspo_jax.mismatch.correction`): none, truncated or masked importance
# sampling, per token or per sequence.
CORRECTIONS = ("none", "tis", "mis")
IS_LEVELS = ("token", "sequence")

SEQUENCE_LEVEL_RATIOS = ("sequence", "geometric", "sequence_sum")  # one ratio and one loss per sequence
GATES_FOR_RATIO = {
    "token": ("clip", "cispo", "sapo"),
    "sequence_token": ("clip", "sapo"),
    "sequence": ("clip", "sapo"),
    "geometric": ("clip",),  # GMPO clips in log space, token by token, inside the ratio
    "sequence_sum": ("clip", "sapo"),
    "sequence_sum_token": ("clip", "sapo", "vespo"),  # VESPO's kernel acts on the unnormalised W
}


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Which policy loss to compute; validated at construction, hashable (a static jit argument).

    eps_low / eps_high bound a ratio to [1 - eps_low, 1 + eps_high]; for `geometric` they bound each
    token's log-ratio to [-eps_low, eps_high] instead (GMPO clips in log space). vespo_k_* / vespo_lambda_*
    shape VESPO's kernel φ(W) = W^k·e^{λ(1-W)} for A >= 0 (pos) and A < 0 (neg).
    """

    ratio: str = "token"
    gate: str = "clip"
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip_c: float | None = None  # for A < 0 cap the loss at -c·A (c > 1); clip gate only
    aggregation: str = "seq_mean_token_mean"
    sum_norm_len: float | None = None  # the constant T_max of seq_mean_token_sum_norm
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    vespo_k_pos: float = 2.0  # VESPO's power k (the paper's c1) and decay λ (c2), by sign(A); TRL's defaults
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    log_ratio_clamp: float = 20.0  # |log-ratio| bound applied before every exp
    # Sampler–trainer correction (`gspo_jax.mismatch.correction`): none | tis | mis, per token or per
    # sequence, with cap C (TIS truncates w at C; MIS keeps w in [1/C, C]).
    is_correction: str = "none"
    is_level: str = "token"
    is_cap: float = 2.0
    # Mismatch masks (`gspo_jax.mismatch`): a masked token's or completion's policy loss is zeroed inside
    # the normalised sum (the denominator stays). IcePop: a token whose w = π_old / π_sampler leaves
    # [icepop_low, icepop_high]. Geometric: a completion whose exp(mean_t log w) leaves [1 - δ, 1 + δ].
    # Off-policy sequence masking (DeepSeek-V3.2): a completion with A < 0 whose mean_t of
    # log π_sampler - log π_θ exceeds δ.
    icepop: bool = False
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    geo_mask_delta: float | None = None
    off_policy_mask_delta: float | None = None
    # RSPO (`gspo_jax.router_shift`): every token's ratio × sg[max(γ, router_shift_floor)] before clipping.
    router_shift: bool = False
    router_shift_floor: float = 0.8
    # The router probabilities γ compares (`router_shift.PROBS`): "softmax", the full softmax at π_old's
    # experts (the paper's equation); "topk", renormalised over π_old's K experts (its gates).
    router_shift_probs: str = "softmax"

    def __post_init__(self):
        own = "LossConfig"
        check_choice(own, "ratio", self.ratio, RATIOS)
        check_choice(own, "gate", self.gate, GATES)
        check_choice(own, "aggregation", self.aggregation, AGGREGATIONS)
        check_choice(own, "kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        check_number(own, "eps_low", self.eps_low, low=0.0)
        check_number(own, "eps_high", self.eps_high, low=0.0)
        check_number(own, "dual_clip_c", self.dual_clip_c, low=1.0, strict=True, allow_none=True)
        check_number(own, "sum_norm_len", self.sum_norm_len, low=0.0, strict=True, allow_none=True)
        check_number(own, "kl_coef", self.kl_coef, low=0.0)
        check_number(own, "sapo_tau_pos", self.sapo_tau_pos, low=0.0, strict=True)
        check_number(own, "sapo_tau_neg", self.sapo_tau_neg, low=0.0, strict=True)
        for sign in ("pos", "neg"):  # λ > 0 keeps φ bounded (its largest value is at W = k/λ)
            check_number(own, f"vespo_k_{sign}", getattr(self, f"vespo_k_{sign}"), low=0.0)
            check_number(own, f"vespo_lambda_{sign}", getattr(self, f"vespo_lambda_{sign}"), low=0.0, strict=True)
        check_number(own, "log_ratio_clamp", self.log_ratio_clamp, low=0.0, strict=True)
        check_choice(own, "is_correction", self.is_correction, CORRECTIONS)
        check_choice(own, "is_level", self.is_level, IS_LEVELS)
        check_number(own, "is_cap", self.is_cap, low=1.0, strict=True)
        if self.is_correction != "none" and self.ratio in SEQUENCE_LEVEL_RATIOS and self.is_level != "sequence":
            fail(own, "is_level", self.is_level, f"'sequence' with ratio={self.ratio!r} (one loss per sequence)")
        check(isinstance(self.icepop, bool), own, "icepop", self.icepop, "True or False")
        check_number(own, "icepop_low", self.icepop_low, low=0.0, strict=True)
        high_ok = isinstance(self.icepop_high, numbers.Real) and math.isfinite(self.icepop_high)
        high_ok = high_ok and not isinstance(self.icepop_high, bool) and self.icepop_high > self.icepop_low
        check(high_ok, own, "icepop_high", self.icepop_high, f"it must be a number > icepop_low={self.icepop_low}")
        if self.icepop and self.ratio in SEQUENCE_LEVEL_RATIOS:
            why = "one loss per sequence: no token to mask; geo_mask_delta masks whole sequences"
            fail(own, "icepop", True, f"it must be False with ratio={self.ratio!r} ({why})")
        g = self.geo_mask_delta
        geo_ok = g is None or (isinstance(g, numbers.Real) and not isinstance(g, bool) and 0.0 < g < 1.0)
        check(geo_ok, own, "geo_mask_delta", g, "it must be a number in (0, 1) (keeps [1 - δ, 1 + δ]) or None")
        check_number(own, "off_policy_mask_delta", self.off_policy_mask_delta, low=0.0, allow_none=True)
        check(isinstance(self.router_shift, bool), own, "router_shift", self.router_shift, "True or False")
        check_number(own, "router_shift_floor", self.router_shift_floor, low=0.0, high=1.0, strict=True)
        check_choice(own, "router_shift_probs", self.router_shift_probs, router_shift_lib.PROBS)
        if self.ratio != "geometric":  # ratios are > 0: a lower bound below 0 clips nothing, silently
            check(self.eps_low <= 1.0, own, "eps_low", self.eps_low, "in [0, 1] (1 means no lower bound)")
        if self.gate not in GATES_FOR_RATIO[self.ratio]:
            fail(own, "gate", self.gate, f"with ratio={self.ratio!r} choose one of {GATES_FOR_RATIO[self.ratio]}")
        if self.dual_clip_c is not None and self.gate != "clip":
            fail(own, "dual_clip_c", self.dual_clip_c, f"it must be None with gate={self.gate!r} (clip gate only)")
        sequence_level = self.ratio in SEQUENCE_LEVEL_RATIOS
        if sequence_level != (self.aggregation == "sequence"):
            allowed = ("sequence",) if sequence_level else AGGREGATIONS[:3]
            fail(own, "aggregation", self.aggregation, f"with ratio={self.ratio!r} choose one of {allowed}")
        if self.aggregation == "seq_mean_token_sum_norm" and self.sum_norm_len is None:
            fail(own, "sum_norm_len", None, "seq_mean_token_sum_norm needs a number > 0 (the max completion length)")

    @property
    def sequence_level(self) -> bool:
        return self.ratio in SEQUENCE_LEVEL_RATIOS


# ----------------------------------------------------------------------------------------------
# Aggregation: numerator and denominator, so that global-batch denominators can be passed in.


def sequence_valid(mask_BT: Array) -> Array:
    """A sequence counts iff it has at least one completion token (empty ones contribute nothing)."""
    return jnp.sum(mask_BT, axis=-1) > 0


def loss_denominator(cfg: LossConfig, mask_BT: Array) -> Array:
    """The aggregation's denominator for this mask: token count for token_mean, else sequence count.

    Compute it once on the global batch and pass it to `policy_loss` for every minibatch/shard.
    """
    mask_BT = jnp.asarray(mask_BT) > 0
    if cfg.aggregation == "token_mean":
        return jnp.sum(mask_BT).astype(jnp.float32)
    return jnp.sum(sequence_valid(mask_BT)).astype(jnp.float32)


def token_loss_numerator(aggregation: str, loss_BT: Array, mask_BT: Array, sum_norm_len) -> Array:
    """Numerator of a token-level aggregation ('sequence' means the per-sequence token mean)."""
    per_seq_sum_B = masked_sum(loss_BT, mask_BT, axis=-1)
    if aggregation == "token_mean":
        return jnp.sum(per_seq_sum_B)
    if aggregation == "seq_mean_token_sum_norm":
        return jnp.sum(per_seq_sum_B) / sum_norm_len
    n_B = jnp.maximum(jnp.sum(mask_BT, axis=-1), 1.0)
    return jnp.sum(per_seq_sum_B / n_B)


# ----------------------------------------------------------------------------------------------
# The loss.


def _prepare(logp, old_logp, advantages, mask, ref_logp, cfg: LossConfig):
    """Argument checks (at trace time, before any math) and float32 casts."""
    logp, old_logp, mask = jnp.asarray(logp), jnp.asarray(old_logp), jnp.asarray(mask)
    chex.assert_rank(logp, 2, custom_message="policy_loss: logp must be [B, T]")
    chex.assert_equal_shape([logp, old_logp, mask], custom_message="policy_loss: logp, old_logp, mask")
    advantages = jnp.asarray(advantages)
    B = logp.shape[0]
    if advantages.shape not in ((B,), logp.shape):
        raise ValueError(
            f"policy_loss: advantages must have shape [B]={(B,)} or [B, T]={logp.shape}; got {advantages.shape}"
        )
    if cfg.sequence_level and advantages.ndim != 1:
        token_kind = "sequence_sum_token" if cfg.ratio == "sequence_sum" else "sequence_token"
        raise ValueError(
            f"policy_loss: ratio={cfg.ratio!r} takes one advantage per sequence, shape [B]; got "
            f"{advantages.shape} (use ratio={token_kind!r} for per-token advantages)"
        )
    if cfg.kl_coef > 0:
        if ref_logp is None:
            raise ValueError(f"policy_loss: kl_coef={cfg.kl_coef} > 0 needs ref_logp of shape {logp.shape}")
        chex.assert_shape(ref_logp, logp.shape, custom_message="policy_loss: ref_logp")
    f32 = lambda x: None if x is None else jnp.asarray(x).astype(jnp.float32)
    return f32(logp), f32(old_logp), f32(advantages), mask > 0, f32(ref_logp)


class LossWeights(NamedTuple):
    """Weights and masks on a loss from outside it, each optional (None: none); no gradient flows into them.

    is_weight: a sampler–trainer importance weight (`mismatch.correction`) multiplying each token's
      ([B, T]) or sequence's ([B]) policy loss; sequence-level ratios take [B] only. The VESPO gate
      instead folds it into W in log space (W·Π_t w_t), as TRL and the paper do.
    keep: bool, the tokens ([B, T]) or sequences ([B]) whose policy loss counts (the mismatch masks:
      IcePop, geometric, off-policy); the rest are zeroed inside the sum, the denominator unchanged.
      Sequence-level ratios take [B] only.
    router_shift: RSPO's weight γ̃ ([B, T]; `router_shift.shift_weight`) multiplying each token's ratio
      before the ratio is clipped or aggregated: Δ ← Δ + log γ̃. The diagnostics `ratio_*`, `approx_kl`
      and the flipped split stay those of π_θ / π_old.
    """

    is_weight: Array | None = None
    keep: Array | None = None
    router_shift: Array | None = None


def policy_loss(
    cfg: LossConfig,
    logp: Array,
    old_logp: Array,
    advantages: Array,
    mask: Array,
    ref_logp: Array | None = None,
    *,
    denominator: Array | float | None = None,
    weights: LossWeights | None = None,
    flipped: Array | None = None,
) -> tuple[Array, dict[str, Metric]]:
    """The configured policy loss and its diagnostics; pure and jittable (cfg is static).

    Args:
      logp, old_logp, mask: [B, T] log-probs of the sampled tokens under π_θ and π_old; mask is 1
        on completion tokens. Any dtype; the math is float32.
      advantages: [B] (one per completion) or [B, T] (token-level ratios only).
      ref_logp: [B, T] under π_ref, required when cfg.kl_coef > 0.
      denominator: the aggregation's denominator; default `loss_denominator(cfg, mask)`. Pass the
        global batch's value when this call sees only a minibatch or a shard.
      weights: the sampler–trainer correction, the mismatch masks and RSPO's router-shift weight
        (`LossWeights`); None: none of them.
      flipped: bool [B, T], tokens whose expert routing changed between π_old and π_θ; adds
        `loss_diagnostics.split_diagnostics` (clip fraction and |log r| of flipped vs unflipped tokens).
    Returns:
      (loss, metrics): loss = (Σ policy terms + kl_coef·Σ KL terms) / denominator. `metrics` are
      typed (`gspo_jax.metrics`): the loss terms are `Sum`s (pieces over a global denominator add),
      the diagnostics `Mean`s of (sum, count) or `Min` / `Max`; `metrics.compute` gives values.
    """
    weights = LossWeights() if weights is None else weights
    logp_BT, old_BT, adv, mask_BT, ref_BT = _prepare(logp, old_logp, advantages, mask, ref_logp, cfg)
    if denominator is None:
        denominator = loss_denominator(cfg, mask_BT)
    denom = jnp.maximum(jnp.asarray(denominator, jnp.float32), 1.0)
    raw_delta_BT = masked_log_ratio(logp_BT, old_BT, mask_BT)  # π_θ / π_old, for the diagnostics
    delta_BT = _router_shifted(raw_delta_BT, weights.router_shift, mask_BT)
    seq_ok_B = sequence_valid(mask_BT)
    if cfg.sequence_level:
        p = _sequence_policy(cfg, delta_BT, mask_BT, adv, seq_ok_B, weights)
    else:
        p = _token_policy(cfg, delta_BT, logp_BT, mask_BT, adv, weights)
    kl_num, metrics = _kl_term(cfg, logp_BT, ref_BT, mask_BT)

    policy = p.numerator / denom
    kl_term = cfg.kl_coef * kl_num / denom
    loss = policy + kl_term
    ratio_delta_BT = clamp_log_ratio(raw_delta_BT, cfg.log_ratio_clamp)
    metrics.update(diagnostics(DiagnosticInputs(ratio_delta_BT, adv, mask_BT, seq_ok_B, p)))
    metrics.update(loss=Sum(loss), policy_loss=Sum(policy), kl_loss=Sum(kl_term), denominator=Mean(denom, 1))
    if flipped is not None:
        metrics.update(split_diagnostics(ratio_delta_BT, p.low_BT | p.high_BT | p.dual_BT, mask_BT, flipped))
    return loss, metrics


def _router_shifted(delta_BT: Array, router_shift: Array | None, mask_BT: Array) -> Array:
    """RSPO: the ratio × γ̃ (Δ + log γ̃ on completion tokens), before any clip or aggregation."""
    if router_shift is None:
        return delta_BT
    log_gamma_BT = jnp.log(_stop_weight(router_shift, mask_BT.shape, "router_shift"))
    return delta_BT + jnp.where(mask_BT, log_gamma_BT, 0.0)


def _kl_term(cfg: LossConfig, logp_BT: Array, ref_BT: Array | None, mask_BT: Array) -> tuple[Array, dict[str, Metric]]:
    """The KL penalty's numerator, aggregated as the policy's (a sequence-level loss's: per sequence,
    the token mean), and its metric `kl_ref`; 0 and no metric when cfg.kl_coef is 0."""
    if not cfg.kl_coef > 0:
        return jnp.zeros((), jnp.float32), {}
    d_BT = jnp.where(mask_BT, clamp_log_ratio(ref_BT - logp_BT, cfg.log_ratio_clamp), 0.0)
    kl_BT = KL_FNS[cfg.kl_estimator](d_BT)
    kl_agg = "seq_mean_token_mean" if cfg.aggregation == "sequence" else cfg.aggregation
    kl_num = token_loss_numerator(kl_agg, kl_BT, mask_BT, cfg.sum_norm_len)
    return kl_num, {"kl_ref": Mean(masked_sum(kl_BT, mask_BT), jnp.sum(mask_BT))}


def _sequence_policy(
    cfg: LossConfig, delta_BT: Array, mask_BT: Array, adv: Array, seq_ok_B: Array, weights: LossWeights
) -> PolicyTerms:
    """Sequence-level ratios (sequence, sequence_sum, geometric): one ratio and one loss per sequence,
    summed over the sequences that have a completion token; `is_weight` and `keep` are per sequence."""
    clamp, is_weight, keep = cfg.log_ratio_clamp, weights.is_weight, weights.keep
    if cfg.ratio == "geometric":
        lr = geometric_log_ratio(delta_BT, mask_BT, adv, cfg.eps_low, cfg.eps_high, clamp)
        x_B = jnp.exp(lr.log_ratio)
        loss_B, dual_B = -x_B * adv, jnp.zeros(adv.shape, bool)
        if cfg.dual_clip_c is not None:
            dual_B = (adv < 0) & (x_B > cfg.dual_clip_c)
            loss_B = jnp.where(dual_B, -cfg.dual_clip_c * adv, loss_B)
        low_BT, high_BT = lr.low_BT, lr.high_BT
        seq_clipped_B = jnp.any(low_BT | high_BT, axis=-1) | dual_B
        weight_B = jnp.where(dual_B, 0.0, jax.lax.stop_gradient(x_B))
        log_s_B = lr.log_ratio
    else:  # sequence, sequence_sum
        seq_ratio = sequence_sum_log_ratio if cfg.ratio == "sequence_sum" else sequence_log_ratio
        log_s_B = seq_ratio(delta_BT, mask_BT, clamp)
        g = GATE_FNS[cfg.gate](cfg, log_s_B, adv)
        loss_B, dual_B, weight_B = g.loss, g.dual, g.weight
        low_BT, high_BT = g.low[:, None] & mask_BT, g.high[:, None] & mask_BT
        seq_clipped_B = g.low | g.high | g.dual
    if is_weight is not None:
        loss_B = loss_B * _is_weight(is_weight, (adv.shape[0],))
    if keep is not None:
        loss_B = jnp.where(_keep(keep, (adv.shape[0],)), loss_B, 0.0)
    policy_num = jnp.sum(jnp.where(seq_ok_B, loss_B, 0.0))
    dual_BT = dual_B[:, None] & mask_BT
    weight_BT = jnp.broadcast_to(weight_B[:, None], mask_BT.shape)
    return PolicyTerms(policy_num, log_s_B, low_BT, high_BT, dual_BT, seq_clipped_B, weight_BT)


def _token_policy(
    cfg: LossConfig, delta_BT: Array, logp_BT: Array, mask_BT: Array, adv: Array, weights: LossWeights
) -> PolicyTerms:
    """Token-level ratios (token, sequence_token, sequence_sum_token): a loss per token, aggregated as
    `cfg.aggregation` says; `is_weight` and `keep` per token, or per sequence broadcast over its tokens."""
    clamp, is_weight, keep = cfg.log_ratio_clamp, weights.is_weight, weights.keep
    adv_BT = jnp.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, mask_BT.shape)
    if cfg.ratio == "sequence_sum_token":
        log_x_BT = sequence_sum_token_log_ratio(delta_BT, logp_BT, mask_BT, clamp)
        log_s_B = sequence_sum_log_ratio(delta_BT, mask_BT, clamp)
    else:
        if cfg.ratio == "sequence_token":
            log_x_BT = sequence_token_log_ratio(delta_BT, logp_BT, mask_BT, clamp)
        else:
            log_x_BT = clamp_log_ratio(delta_BT, clamp)
        log_s_B = sequence_log_ratio(delta_BT, mask_BT, clamp)
    if cfg.gate == "vespo" and is_weight is not None:  # W = π_θ/π_sampler: the correction joins W
        log_x_BT = log_x_BT + _log_is_weight_sum(is_weight, mask_BT, clamp)[:, None]
        is_weight = None
    g = GATE_FNS[cfg.gate](cfg, log_x_BT, adv_BT, jnp.where(mask_BT, logp_BT, 0.0))
    low_BT, high_BT, dual_BT = g.low & mask_BT, g.high & mask_BT, g.dual & mask_BT
    seq_clipped_B = jnp.any(low_BT | high_BT | dual_BT, axis=-1)
    loss_BT = g.loss
    if is_weight is not None:
        w = jnp.asarray(is_weight)
        loss_BT = loss_BT * _is_weight(w[:, None] if w.ndim == 1 else w, mask_BT.shape)
    if keep is not None:
        k = jnp.asarray(keep)
        loss_BT = jnp.where(_keep(k[:, None] if k.ndim == 1 else k, mask_BT.shape), loss_BT, 0.0)
    policy_num = token_loss_numerator(cfg.aggregation, loss_BT, mask_BT, cfg.sum_norm_len)
    return PolicyTerms(policy_num, log_s_B, low_BT, high_BT, dual_BT, seq_clipped_B, g.weight)


def _fits(x: Array, shape: tuple[int, ...], name: str) -> Array:
    x = jnp.asarray(x)
    if x.ndim != len(shape) or any(a not in (1, b) for a, b in zip(x.shape, shape)):
        raise ValueError(f"policy_loss: {name} of shape {x.shape} does not fit {shape}")
    return x


def _is_weight(w: Array, shape: tuple[int, ...]) -> Array:
    return _stop_weight(w, shape, "is_weight")


def _stop_weight(w: Array, shape: tuple[int, ...], name: str) -> Array:
    return jax.lax.stop_gradient(_fits(w, shape, name).astype(jnp.float32))


def _keep(k: Array, shape: tuple[int, ...]) -> Array:
    return _fits(k, shape, "keep").astype(bool)


def _log_is_weight_sum(is_weight: Array, mask_BT: Array, clamp: float) -> Array:
    """log of a sequence's correction: Σ_t m·log w_t for token weights [B, T], log w for sequence weights
    [B]; each log clamped to [log 1e-8, clamp] as TRL's `vespo` loss does (a weight of 0 sends φ to 0): [B]."""
    w = jnp.asarray(is_weight)
    if w.ndim == 1:
        return jnp.clip(jnp.log(_is_weight(w, mask_BT.shape[:1])), VESPO_LOG_W_MIN, clamp)
    log_w_BT = jnp.clip(jnp.log(_is_weight(w, mask_BT.shape)), VESPO_LOG_W_MIN, clamp)
    return masked_sum(log_w_BT, mask_BT, axis=-1)

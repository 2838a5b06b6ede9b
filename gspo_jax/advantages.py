"""Group-relative advantages and DAPO's reward-side tricks (dynamic-sampling filter, overlong shaping).

Rewards come as a flat [B] vector of B = M·G completions (M prompts, G samples each), the G
completions of a prompt contiguous. The std used for scaling is the *sample* std (ddof = 1, as torch.std in the TRL and
verl GRPO implementations); a group of size 1 has no spread and gets advantage 0.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

from gspo_jax.validation import check_choice, check_int, check_number

Array = jax.Array

SCALES = ("group", "batch", "none")  # which std divides (Dr.GRPO: none); `algorithms` picks per algorithm


def _check_groups(rewards: Array, group_size: int) -> int:
    check_int("advantages", "group_size", group_size, low=1)
    if rewards.ndim != 1 or rewards.shape[0] % group_size:
        raise ValueError(
            f"rewards must be a flat [B] vector with B a multiple of group_size={group_size}; got shape {rewards.shape}"
        )
    return rewards.shape[0] // group_size


def _sample_std(x: Array, axis, keepdims=False) -> Array:
    n = x.shape[axis] if isinstance(axis, int) else x.size
    if n < 2:
        return jnp.zeros(jnp.mean(x, axis=axis, keepdims=keepdims).shape, x.dtype)
    return jnp.std(x, axis=axis, ddof=1, keepdims=keepdims)


def _safe_div(num: Array, den: Array) -> Array:
    """num / den, and 0 where den == 0 (num is 0 there: the group or batch has no spread)."""
    ok = den > 0
    return jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0)


def group_advantages(
    rewards: Array,
    group_size: int,
    scale: str = "group",
    eps: float = 1e-6,
    valid: Array | None = None,
) -> Array:
    """A_i = (R_i - mean_group R) / (std + eps), float32 [B].

    scale: 'group' divides by the group's std (GRPO), 'batch' by the std of all rewards in the batch
    (of the valid groups), 'none' does not divide (Dr.GRPO). A group whose rewards are all equal gets
    exactly 0 — decided by comparing rewards, not by a float mean — so it can never produce NaN.
    valid: optional [B] bool; completions of invalid (fill) groups get advantage 0 and are left out
    of the batch std.
    """
    check_choice("group_advantages", "scale", scale, SCALES)
    rewards = jnp.asarray(rewards, jnp.float32)
    num_groups = _check_groups(rewards, group_size)
    r_MG = rewards.reshape(num_groups, group_size)
    constant_M1 = jnp.max(r_MG, axis=1, keepdims=True) == jnp.min(r_MG, axis=1, keepdims=True)
    centered_MG = jnp.where(constant_M1, 0.0, r_MG - jnp.mean(r_MG, axis=1, keepdims=True))
    valid_MG = jnp.ones_like(r_MG, bool) if valid is None else jnp.asarray(valid, bool).reshape(r_MG.shape)
    if scale == "group":
        centered_MG = _safe_div(centered_MG, _sample_std(r_MG, axis=1, keepdims=True) + eps)
    elif scale == "batch":
        n = jnp.sum(valid_MG)
        mean = jnp.sum(jnp.where(valid_MG, r_MG, 0.0)) / jnp.maximum(n, 1)
        var = jnp.sum(jnp.where(valid_MG, jnp.square(r_MG - mean), 0.0)) / jnp.maximum(n - 1, 1)
        centered_MG = _safe_div(centered_MG, jnp.sqrt(var) + eps)
    return jnp.where(valid_MG, centered_MG, 0.0).reshape(-1)


def informative_groups(rewards: Array, group_size: int) -> Array:
    """[num_groups] bool: True where the group's rewards are not all equal (DAPO dynamic sampling)."""
    rewards = jnp.asarray(rewards)
    num_groups = _check_groups(rewards, group_size)
    r_MG = rewards.reshape(num_groups, group_size)
    return jnp.max(r_MG, axis=1) != jnp.min(r_MG, axis=1)


def overlong_penalty(lengths: Array, max_len: int, cache_len: int) -> Array:
    """DAPO's soft overlong punishment, float32 [B], added to the reward.

    0 for L <= max_len - cache_len, (max_len - cache_len - L) / cache_len inside the buffer (linear,
    reaching -1 at max_len), -1 beyond max_len.
    """
    if not (isinstance(cache_len, int) and isinstance(max_len, int) and 0 < cache_len <= max_len):
        raise ValueError(
            f"overlong_penalty: need ints with 0 < cache_len <= max_len; got max_len={max_len!r}, "
            f"cache_len={cache_len!r}"
        )
    length = jnp.asarray(lengths, jnp.float32)
    soft = (max_len - cache_len - length) / cache_len
    return jnp.where(length <= max_len - cache_len, 0.0, jnp.where(length <= max_len, soft, -1.0))


# ----------------------------------------------------------------------------------------------
# PPO: token-level rewards and advantages from a critic (GAE), beside the group-relative ones above.
# Per-token arrays are [B, T] aligned to token positions: values_BT[b, t] = V(s_t), the state just before
# token t, aligned like logp_BT[b, t]. Only masked tokens count, and nothing assumes the mask is contiguous:
# unmasked positions are skipped, so padding or prompt columns anywhere change no masked token's result.


def _check_python_number(owner: str, field: str, value, low: float | None = None, high: float | None = None) -> None:
    """Validates Python (and NumPy) numbers eagerly; JAX arrays, traced or not, are taken as given."""
    if isinstance(value, numbers.Real) or not hasattr(value, "dtype"):
        check_number(owner, field, value, low=low, high=high)


def token_rewards(rewards_B: Array, mask_BT: Array, kl_BT: Array | None = None, kl_coef: float = 0.0) -> Array:
    """Per-token rewards r_BT, float32: the sequence reward on each row's last masked token, minus
    kl_coef·kl_BT at every masked token (classic RLHF PPO folds its KL penalty into the reward, with
    kl_BT the caller's per-token estimate, e.g. old_logp − ref_logp). 0 at unmasked positions; a row
    without masked tokens gets nothing.
    """
    _check_python_number("token_rewards", "kl_coef", kl_coef, low=0.0)
    m = jnp.asarray(mask_BT) > 0
    T = m.shape[-1]
    last_B = T - 1 - jnp.argmax(m[:, ::-1], axis=-1)  # index of the last masked token (T-1 if none)
    at_last_BT = (jnp.arange(T)[None, :] == last_B[:, None]) & m  # all False in an empty row
    r_BT = jnp.where(at_last_BT, jnp.asarray(rewards_B, jnp.float32)[:, None], 0.0)
    if kl_BT is not None and not (isinstance(kl_coef, numbers.Real) and kl_coef == 0):
        penalty_BT = jnp.asarray(kl_coef, jnp.float32) * jnp.asarray(kl_BT, jnp.float32)
        r_BT = r_BT - jnp.where(m, penalty_BT, 0.0)
    return r_BT


def gae(rewards_BT: Array, values_BT: Array, mask_BT: Array, gamma: float, lam: float) -> tuple[Array, Array]:
    """Generalised Advantage Estimation over each row's masked tokens: (advantages_BT, returns_BT), float32.

    For a masked token t whose next masked token is t': δ_t = r_t + γ·V_t' − V_t and A_t = δ_t + γλ·A_t';
    after the last masked token the state is terminal (V = A = 0). returns = A + V. A reverse scan over T
    carries (next V, next A) straight through unmasked positions, which are skipped entirely; both outputs
    are exactly 0 there, and whatever the inputs hold there (even NaN) never reaches a masked token.
    λ = 1 gives discounted reward-to-go − V (Monte Carlo), λ = 0 the one-step TD error.
    gamma, lam: Python floats in [0, 1] (checked here) or traced scalars (not checked).
    """
    _check_python_number("gae", "gamma", gamma, low=0.0, high=1.0)
    _check_python_number("gae", "lam", lam, low=0.0, high=1.0)
    m_TB = (jnp.asarray(mask_BT) > 0).T
    r_TB = jnp.where(m_TB, jnp.asarray(rewards_BT, jnp.float32).T, 0.0)
    v_TB = jnp.where(m_TB, jnp.asarray(values_BT, jnp.float32).T, 0.0)
    gamma = jnp.asarray(gamma, jnp.float32)
    gamma_lam = gamma * jnp.asarray(lam, jnp.float32)

    def step(carry, x):
        next_v_B, next_a_B = carry
        r_B, v_B, m_B = x
        a_B = r_B + gamma * next_v_B - v_B + gamma_lam * next_a_B
        a_B = jnp.where(m_B, a_B, 0.0)
        return (jnp.where(m_B, v_B, next_v_B), jnp.where(m_B, a_B, next_a_B)), a_B

    zeros_B = jnp.zeros(m_TB.shape[1], jnp.float32)
    _, a_TB = jax.lax.scan(step, (zeros_B, zeros_B), (r_TB, v_TB, m_TB), reverse=True)
    return a_TB.T, jnp.where(m_TB, a_TB + v_TB, 0.0).T


def _masked_moments(x_BT: Array, m_BT: Array) -> tuple[Array, Array, Array]:
    """(count, mean, sum of squared deviations) of x over the masked tokens; mean 0 when there are none."""
    n = jnp.sum(m_BT).astype(jnp.float32)
    x_BT = jnp.where(m_BT, x_BT, 0.0)
    mean = jnp.sum(x_BT) / jnp.maximum(n, 1.0)
    ss = jnp.sum(jnp.where(m_BT, jnp.square(x_BT - mean), 0.0))
    return n, mean, ss


def _masked_constant(x_BT: Array, m_BT: Array) -> Array:
    """True when every masked value is the same (or there is at most one), compared exactly, not via a mean."""
    hi = jnp.max(jnp.where(m_BT, x_BT, -jnp.inf))
    lo = jnp.min(jnp.where(m_BT, x_BT, jnp.inf))
    return (hi == lo) | (jnp.sum(m_BT) < 2)


def whiten(x_BT: Array, mask_BT: Array, eps: float = 1e-8) -> Array:
    """(x − mean)·rsqrt(var + eps) over all masked tokens of the batch, float32; 0 at unmasked positions.

    Mean and *sample* variance (ddof = 1) are over masked tokens only. PPO whitens advantages this way so
    the loss scale does not depend on the reward scale. Fewer than two masked tokens or all-equal values
    (compared exactly) give exactly 0, never NaN, even with eps = 0.
    """
    _check_python_number("whiten", "eps", eps, low=0.0)
    m = jnp.asarray(mask_BT) > 0
    x_BT = jnp.where(m, jnp.asarray(x_BT, jnp.float32), 0.0)
    n, mean, ss = _masked_moments(x_BT, m)
    var = ss / jnp.maximum(n - 1.0, 1.0)
    den = var + jnp.asarray(eps, jnp.float32)
    ok = ~_masked_constant(x_BT, m) & (den > 0)
    scale = jax.lax.rsqrt(jnp.where(ok, den, 1.0))
    return jnp.where(m & ok, (x_BT - mean) * scale, 0.0)


def explained_variance(values_BT: Array, returns_BT: Array, mask_BT: Array) -> Array:
    """1 − Var(returns − values) / Var(returns) over the masked tokens, float32 scalar (population variances).

    How much of the return the critic predicts: 1 perfect, 0 no better than the mean return, < 0 worse.
    Undefined, so NaN (like the loss's undefined clip fractions; not 0, which would read as "no better than
    the mean"), when the masked returns are all equal (compared exactly), or there are fewer than two.
    """
    m = jnp.asarray(mask_BT) > 0
    y_BT = jnp.where(m, jnp.asarray(returns_BT, jnp.float32), 0.0)
    v_BT = jnp.where(m, jnp.asarray(values_BT, jnp.float32), 0.0)
    _, _, ss_y = _masked_moments(y_BT, m)
    _, _, ss_res = _masked_moments(y_BT - v_BT, m)  # the 1/n of both population variances cancels
    defined = ~_masked_constant(y_BT, m) & (ss_y > 0)
    return jnp.where(defined, 1.0 - ss_res / jnp.where(defined, ss_y, 1.0), jnp.nan)

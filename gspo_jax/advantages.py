"""Group-relative advantages and DAPO's reward-side tricks (dynamic-sampling filter, overlong shaping).

Rewards come as a flat [B] vector of B = M·G completions (M prompts, G samples each), the G
completions of a prompt contiguous. The std used for scaling is the *sample* std (ddof = 1, as torch.std in the TRL and
verl GRPO implementations); a group of size 1 has no spread and gets advantage 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gspo_jax.validation import check_choice, check_int

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

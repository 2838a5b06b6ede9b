"""Fused (flash) attention for a whole chunk without a cache — the train step, scoring, a prefill — on
a GPU: cuDNN's kernel through `jax.nn.dot_product_attention`, never the [B, H, T, S] scores.

The model's mask (`layers.attention_mask`) lets a query see the real keys (position >= 0) at or
before it. With positions that increase with the slot over a row's real tokens (what
`model.positions_from_mask` gives), that is causal attention among the real tokens alone, wherever
they sit (left-padded prompts, completions padded after EOS). So each row's real tokens are moved to
the front in order (a stable sort of the slots; real first), attended with cuDNN's causal padding
mask over the first n_b, and moved back; rows with no real key give zeros, as the einsum path does.
Issue 40: the einsum path's scores and their gradients were ~80 of the 299 ms of the real-dims train
step on an H100. Shape letters: `gspo_jax/__init__.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def implementation(platform: str, dtype, head_dim: int = 128) -> str | None:
    """The fused kernel for a chunk's attention: "cudnn" on a GPU in bf16/f16 with a head width cuDNN's
    flash kernels take (a multiple of 8, at most 128: the widths measured), else None (the einsum
    path; cuDNN's flash attention takes no float32)."""
    sixteen_bit = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if platform in ("gpu", "cuda") and sixteen_bit and head_dim % 8 == 0 and head_dim <= 128:
        return "cudnn"
    return None


@functools.partial(jax.custom_vjp, nondiff_argnums=())
def _permute(x_BT, order_BT, inverse_BT):
    """x[b, order[b, t]] along axis 1; the gradient is the inverse gather (no scatter-add)."""
    return _gather(x_BT, order_BT)


def _gather(x_BT, idx_BT):
    return jnp.take_along_axis(x_BT, idx_BT.reshape(idx_BT.shape + (1,) * (x_BT.ndim - 2)), axis=1)


def _permute_fwd(x_BT, order_BT, inverse_BT):
    return _gather(x_BT, order_BT), (order_BT, inverse_BT)


def _permute_bwd(res, g_BT):
    order_BT, inverse_BT = res
    return _gather(g_BT, inverse_BT), None, None


_permute.defvjp(_permute_fwd, _permute_bwd)


def attend(q_BTHW, k_BTJW, v_BTJW, positions_BT, *, implementation: str = "cudnn"):
    """Attention of a chunk within itself under the model's mask: [B, T, H, W] in q's dtype.
    `implementation`: "cudnn", or "xla" (JAX's reference of the same call: the CPU tests)."""
    B, T = positions_BT.shape
    real_BT = positions_BT >= 0
    order_BT = jnp.argsort(~real_BT, axis=1, stable=True).astype(jnp.int32)  # real tokens first, in order
    inverse_BT = jnp.argsort(order_BT, axis=1).astype(jnp.int32)
    n_B = jnp.sum(real_BT, axis=1).astype(jnp.int32)
    q, k, v = (_permute(x, order_BT, inverse_BT) for x in (q_BTHW, k_BTJW, v_BTJW))
    out = jax.nn.dot_product_attention(
        q,
        k,
        v,
        scale=q_BTHW.shape[-1] ** -0.5,
        is_causal=True,
        query_seq_lengths=n_B,
        key_value_seq_lengths=n_B,
        implementation=implementation,
    )
    out_BTHW = _permute(out, inverse_BT, order_BT)
    return jnp.where(real_BT[:, :, None, None], out_BTHW, jnp.zeros((), out_BTHW.dtype))

"""The decoder's layers (Flax NNX), HF Qwen3 / Mixtral shaped: RMSNorm, RoPE (HF rotate_half),
grouped-query self-attention with optional per-head q/k RMSNorm over a chunk or a KV cache, and the
SwiGLU feed-forward. `gspo_jax/model.py` puts them together into decoder blocks, stacks of layers and
the transformer; the MoE feed-forward is `gspo_jax/moe.py`. Shape letters: `gspo_jax/__init__.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental.layout import Layout, with_layout_constraint

from gspo_jax import flash, sharding
from gspo_jax.lora import OFF, Adapter, LoraConfig
from gspo_jax.model_config import ModelConfig

# Large finite negative for masked attention scores: a fully masked row stays finite.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def fan_in(in_axis, out_axis):
    """A truncated-normal fan-in initializer over the given input and output axes."""
    return nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis)


@jax.custom_vjp
def row_major_cotangent(x: jax.Array) -> jax.Array:
    """The identity, whose cotangent XLA:CPU must lay out row-major. Put on a projection's output: XLA
    otherwise fuses the elementwise backward of what follows (a norm, SwiGLU) with the transpose the
    weight gradient's matmul wants, a strided loop over every operand (6 ms on a [1152, 512] array);
    kept apart, that backward runs in order and the transpose copies one array. Other backends: the
    identity, cotangent included."""
    return x


def _row_major_fwd(x):
    return x, None


def _row_major_bwd(_, ct):
    row_major = Layout(tuple(range(ct.ndim)))
    return (jax.lax.platform_dependent(ct, cpu=lambda c: with_layout_constraint(c, row_major), default=lambda c: c),)


row_major_cotangent.defvjp(_row_major_fwd, _row_major_bwd)


class RMSNorm(nnx.Module):
    """x / rms(x) * scale, normalised in float32 (HF Qwen3/Mixtral RMSNorm)."""

    def __init__(self, dim: int, eps: float, *, param_dtype, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = sharding.param(rngs, nnx.initializers.ones, (dim,), ("norm",), param_dtype)

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return y.astype(x.dtype) * self.scale[...].astype(x.dtype)


def rope_table(positions_BT: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [B, T, 1, W] of the rotary angles, HF rotate_half layout; negative (padding)
    positions rotate as position 0. Computed once per forward and shared by every layer's q and k."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles_BTw = jnp.maximum(positions_BT, 0).astype(jnp.float32)[..., None] * inv_freq
    angles_BTW = jnp.concatenate([angles_BTw, angles_BTw], axis=-1)[:, :, None, :]
    return jnp.cos(angles_BTW), jnp.sin(angles_BTW)


def rotate(x_BTHW: jax.Array, cos_sin: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Applies a `rope_table` to queries or keys."""
    W = x_BTHW.shape[-1]
    cos, sin = (c.astype(x_BTHW.dtype) for c in cos_sin)
    x1, x2 = x_BTHW[..., : W // 2], x_BTHW[..., W // 2 :]
    return x_BTHW * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def apply_rope(x_BTHW: jax.Array, positions_BT: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding at `positions_BT` (see `rope_table`)."""
    return rotate(x_BTHW, rope_table(positions_BT, x_BTHW.shape[-1], theta))


def attention_mask(q_pos_BT, k_pos_BS, q_slot_T, k_slot_S) -> jax.Array:
    """[B,T,S] bool: key allowed iff key_pos >= 0, key_pos <= query_pos and key slot <= query slot."""
    return (
        (k_pos_BS >= 0)[:, None, :]
        & (k_pos_BS[:, None, :] <= q_pos_BT[:, :, None])
        & (k_slot_S[None, None, :] <= q_slot_T[None, :, None])
    )


def write_kv(cache_BJSW: jax.Array, x_BTJW: jax.Array, index: jax.Array) -> jax.Array:
    """A chunk's keys (or values) written into a layer's cache at slots index..index+T-1."""
    x_BJTW = x_BTJW.transpose(0, 2, 1, 3).astype(cache_BJSW.dtype)
    return jax.lax.dynamic_update_slice_in_dim(cache_BJSW, x_BJTW, index, axis=2)


class Attention(nnx.Module):
    """Grouped-query self-attention with optional per-head q/k RMSNorm (before RoPE, as Qwen3)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        D, H, J, W, pd = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.jnp_param_dtype
        self.cfg = cfg
        self.q_proj = sharding.param(rngs, fan_in(0, (1, 2)), (D, H, W), ("embed", "heads", "head_dim"), pd)
        self.k_proj = sharding.param(rngs, fan_in(0, (1, 2)), (D, J, W), ("embed", "kv_heads", "head_dim"), pd)
        self.v_proj = sharding.param(rngs, fan_in(0, (1, 2)), (D, J, W), ("embed", "kv_heads", "head_dim"), pd)
        self.o_proj = sharding.param(rngs, fan_in((0, 1), 2), (H, W, D), ("heads", "head_dim", "embed"), pd)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(W, cfg.rms_eps, param_dtype=pd, rngs=rngs)
            self.k_norm = RMSNorm(W, cfg.rms_eps, param_dtype=pd, rngs=rngs)
        if cfg.lora.adapts("attention"):  # in [D] -> out [H, W] (q) / [J, W] (k, v); o: in [H, W] -> out [D]
            embed = ((D,), ("embed",))
            self.q_proj_lora = Adapter(cfg.lora, *embed, (H, W), ("heads", "head_dim"), rngs=rngs)
            self.k_proj_lora = Adapter(cfg.lora, *embed, (J, W), ("kv_heads", "head_dim"), rngs=rngs)
            self.v_proj_lora = Adapter(cfg.lora, *embed, (J, W), ("kv_heads", "head_dim"), rngs=rngs)
            self.o_proj_lora = Adapter(cfg.lora, (H, W), ("heads", "head_dim"), *embed, rngs=rngs)

    def _out(self, out_BTHW):
        """The output projection (with its adapter's term where LoRA adapts attention)."""
        y_BTD = jnp.einsum("bthw,hwd->btd", out_BTHW, self.o_proj[...].astype(out_BTHW.dtype))
        return y_BTD + self.o_proj_lora(out_BTHW) if self.cfg.lora.adapts("attention") else y_BTD

    def __call__(self, x_BTD, positions_BT, rope, kv=None, return_kv=False):
        """`rope`: the forward's `rope_table`. kv=None: attend within the chunk (and with `return_kv`
        return its keys/values (k_BTJW, v_BTJW)). kv=(k_BJSW, v_BJSW, key_pos_BS, index), this layer's
        cache: write this chunk's keys/values at slots index.., attend over all S slots, return the
        new (k_BJSW, v_BJSW)."""
        cfg, dtype = self.cfg, x_BTD.dtype
        B, T, _ = x_BTD.shape
        q_BTHW = jnp.einsum("btd,dhw->bthw", x_BTD, self.q_proj[...].astype(dtype))
        k_BTJW = jnp.einsum("btd,djw->btjw", x_BTD, self.k_proj[...].astype(dtype))
        v_BTJW = jnp.einsum("btd,djw->btjw", x_BTD, self.v_proj[...].astype(dtype))
        if cfg.lora.adapts("attention"):
            q_BTHW, k_BTJW = q_BTHW + self.q_proj_lora(x_BTD), k_BTJW + self.k_proj_lora(x_BTD)
            v_BTJW = v_BTJW + self.v_proj_lora(x_BTD)
        q_BTHW, k_BTJW = row_major_cotangent(q_BTHW), row_major_cotangent(k_BTJW)
        if cfg.qk_norm:
            q_BTHW, k_BTJW = self.q_norm(q_BTHW), self.k_norm(k_BTJW)
        q_BTHW, k_BTJW = rotate(q_BTHW, rope), rotate(k_BTJW, rope)
        q_slot_T = jnp.arange(T, dtype=jnp.int32)
        Q = cfg.num_heads // cfg.num_kv_heads
        q_BTJQW = q_BTHW.reshape(B, T, cfg.num_kv_heads, Q, cfg.head_dim)
        fused = flash.implementation(sharding.platform(), dtype, cfg.head_dim) if kv is None else None
        if fused is not None:  # a chunk within itself on a GPU: cuDNN's flash attention
            out_BTHW = flash.attend(q_BTHW, k_BTJW, v_BTJW, positions_BT, implementation=fused)
            new_kv = (k_BTJW, v_BTJW) if return_kv else None
            return self._out(out_BTHW), new_kv
        if kv is None:
            keys, vals, key_pos_BS, k_slot_S = k_BTJW, v_BTJW, positions_BT, q_slot_T
            new_kv = (k_BTJW, v_BTJW) if return_kv else None
            kv_axes = "bsjw"  # the axes of `keys` and `vals`
        else:
            k_BJSW, v_BJSW, key_pos_BS, index = kv
            k_BJSW, v_BJSW = write_kv(k_BJSW, k_BTJW, index), write_kv(v_BJSW, v_BTJW, index)
            keys, vals = k_BJSW.astype(dtype), v_BJSW.astype(dtype)
            k_slot_S = jnp.arange(k_BJSW.shape[2], dtype=jnp.int32)
            q_slot_T = q_slot_T + index
            new_kv = (k_BJSW, v_BJSW)
            kv_axes = "bjsw"
        scores_BJQTS = jnp.einsum(f"btjqw,{kv_axes}->bjqts", q_BTJQW, keys, preferred_element_type=jnp.float32) * (
            cfg.head_dim**-0.5
        )
        mask_BTS = attention_mask(positions_BT, key_pos_BS, q_slot_T, k_slot_S)
        scores_BJQTS = jnp.where(mask_BTS[:, None, None], scores_BJQTS, MASK_VALUE)
        probs_BJQTS = jax.nn.softmax(scores_BJQTS, axis=-1)
        # A query with no allowed key (padding) reads nothing, rather than an average of arbitrary
        # slots: its output then cannot depend on stale cache contents.
        probs_BJQTS = (probs_BJQTS * jnp.any(mask_BTS, axis=-1)[:, None, None, :, None]).astype(dtype)
        if kv is None:
            out_BTJQW = jnp.einsum("bjqts,bsjw->btjqw", probs_BJQTS, vals)
        else:  # a plain batched [Q·T, S] x [S, W] matmul per (sequence, head), then the small output moved
            out_BTJQW = jnp.einsum("bjqts,bjsw->bjqtw", probs_BJQTS, vals).transpose(0, 3, 1, 2, 4)
        out_BTHW = out_BTJQW.reshape(B, T, cfg.num_heads, cfg.head_dim)
        return self._out(out_BTHW), new_kv


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)); with `lora` adapting "mlp", each projection
    gets its low-rank pair (`lora.Adapter`)."""

    def __init__(self, embed_dim: int, mlp_dim: int, *, param_dtype, rngs: nnx.Rngs, lora: LoraConfig = OFF):
        self.gate_proj = sharding.param(rngs, fan_in(0, 1), (embed_dim, mlp_dim), ("embed", "mlp"), param_dtype)
        self.up_proj = sharding.param(rngs, fan_in(0, 1), (embed_dim, mlp_dim), ("embed", "mlp"), param_dtype)
        self.down_proj = sharding.param(rngs, fan_in(0, 1), (mlp_dim, embed_dim), ("mlp", "embed"), param_dtype)
        if lora.adapts("mlp"):
            D, F = ((embed_dim,), ("embed",)), ((mlp_dim,), ("mlp",))
            self.gate_proj_lora = Adapter(lora, *D, *F, rngs=rngs)
            self.up_proj_lora = Adapter(lora, *D, *F, rngs=rngs)
            self.down_proj_lora = Adapter(lora, *F, *D, rngs=rngs)

    @property
    def adapted(self) -> bool:
        """Whether the projections have adapters (a property: no attribute joins the graph at rank 0)."""
        return hasattr(self, "gate_proj_lora")

    def __call__(self, x_BTD):
        dtype = x_BTD.dtype
        g_BTF = x_BTD @ self.gate_proj[...].astype(dtype)
        u_BTF = x_BTD @ self.up_proj[...].astype(dtype)
        if self.adapted:
            g_BTF, u_BTF = g_BTF + self.gate_proj_lora(x_BTD), u_BTF + self.up_proj_lora(x_BTD)
        g_BTF, u_BTF = row_major_cotangent(g_BTF), row_major_cotangent(u_BTF)
        h_BTF = jax.nn.silu(g_BTF) * u_BTF
        y_BTD = h_BTF @ self.down_proj[...].astype(dtype)
        return y_BTD + self.down_proj_lora(h_BTF) if self.adapted else y_BTD

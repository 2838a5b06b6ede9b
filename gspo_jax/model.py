"""Decoder-only transformer policy (Flax NNX), dense or sparse-MoE feed-forward per layer.

Qwen3-MoE / Mixtral shaped (`model_config.ModelConfig`): RMSNorm, RoPE (HF rotate_half), grouped-query
attention with optional per-head q/k RMSNorm, SwiGLU FFN or `moe.MoE`, KV cache. Each run of consecutive
layers of one kind is a `Stack`: parameters stacked on a leading "layers" axis and run by `lax.scan`,
so trace and compile time do not grow with depth (`hf.stacked_to_layers` gives the per-layer view HF
checkpoints use). Used functionally: `graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))`
once, then the pure `apply(graphdef, state, ...)`, `logprobs` or `score` under `jax.jit`.

Positions are int32 [B, T]; a negative position marks a padding token: nothing attends
to it and its own output is finite but meaningless. Router choices come back batch-first,
`topk_BLTK` (L = MoE layers), and are replayed in the same layout. Shape letters:
`gspo_jax/__init__.py`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental.layout import Layout, with_layout_constraint

from gspo_jax import compiles, flash, moe, router_shift, sharding
from gspo_jax.logprobs import sequence_logprobs_from_hidden
from gspo_jax.model_config import DTYPES, REMAT_POLICIES, ModelConfig

# The residual stream's logical axes: sequences split over every data axis (`sharding.DATA_AXES`),
# features whole, between layers and at the LM head.
ACTIVATION = ("batch", None, None)
# Large finite negative for masked attention scores: a fully masked row stays finite.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


# ---------------------------------------------------------------------------- pytrees


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v", "positions", "index"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Preallocated keys/values for every layer; slot positions -1 mark empty slots."""

    # One array per layer, heads before slots: a decode step's attention reads each (sequence, head)'s
    # keys in place, with no copy of a layer out of a stacked cache.
    k: tuple[jax.Array, ...]  # num_layers × [B, J, S, W]
    v: tuple[jax.Array, ...]  # num_layers × [B, J, S, W]
    positions: jax.Array  # int32 [B, S]
    index: jax.Array  # int32 scalar: next slot to write


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    """An empty cache of `max_len` slots (compute dtype unless `dtype` is given)."""
    dtype = cfg.jnp_dtype if dtype is None else DTYPES.get(dtype, dtype)
    shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    return KVCache(
        k=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
        v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
        positions=jnp.full((batch, max_len), -1, jnp.int32),
        index=jnp.zeros((), jnp.int32),
    )


class ModelAux(NamedTuple):
    """Side outputs of a forward pass (a pytree).

    lb_loss / z_loss are raw (unweighted) means over MoE layers; aux_loss is
    lb_loss_coef * lb_loss + z_loss_coef * z_loss, the term to add to a training loss.
    """

    topk: jax.Array  # int32 [B, L, T, K] experts used (the forced ones under replay)
    gates: jax.Array  # float32 [B, L, T, K] their combine weights (the forced ones under weight replay)
    router_logits: jax.Array | None  # float32 [B, L, T, E] when asked for
    lb_loss: jax.Array
    z_loss: jax.Array
    aux_loss: jax.Array
    cache: KVCache | None


def positions_from_mask(mask_BT: jax.Array) -> jax.Array:
    """Positions 0,1,.. over real tokens, -1 on padding (e.g. left-padded prompts)."""
    mask_BT = mask_BT.astype(bool)
    return jnp.where(mask_BT, jnp.cumsum(mask_BT, axis=-1) - 1, -1).astype(jnp.int32)


# ---------------------------------------------------------------------------- layers


def _fan_in(in_axis, out_axis):
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
        self.q_proj = sharding.param(rngs, _fan_in(0, (1, 2)), (D, H, W), ("embed", "heads", "head_dim"), pd)
        self.k_proj = sharding.param(rngs, _fan_in(0, (1, 2)), (D, J, W), ("embed", "kv_heads", "head_dim"), pd)
        self.v_proj = sharding.param(rngs, _fan_in(0, (1, 2)), (D, J, W), ("embed", "kv_heads", "head_dim"), pd)
        self.o_proj = sharding.param(rngs, _fan_in((0, 1), 2), (H, W, D), ("heads", "head_dim", "embed"), pd)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(W, cfg.rms_eps, param_dtype=pd, rngs=rngs)
            self.k_norm = RMSNorm(W, cfg.rms_eps, param_dtype=pd, rngs=rngs)

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
            return jnp.einsum("bthw,hwd->btd", out_BTHW, self.o_proj[...].astype(dtype)), new_kv
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
        return jnp.einsum("bthw,hwd->btd", out_BTHW, self.o_proj[...].astype(dtype)), new_kv


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, embed_dim: int, mlp_dim: int, *, param_dtype, rngs: nnx.Rngs):
        self.gate_proj = sharding.param(rngs, _fan_in(0, 1), (embed_dim, mlp_dim), ("embed", "mlp"), param_dtype)
        self.up_proj = sharding.param(rngs, _fan_in(0, 1), (embed_dim, mlp_dim), ("embed", "mlp"), param_dtype)
        self.down_proj = sharding.param(rngs, _fan_in(0, 1), (mlp_dim, embed_dim), ("mlp", "embed"), param_dtype)

    def __call__(self, x_BTD):
        dtype = x_BTD.dtype
        g_BTF = row_major_cotangent(x_BTD @ self.gate_proj[...].astype(dtype))
        u_BTF = row_major_cotangent(x_BTD @ self.up_proj[...].astype(dtype))
        h_BTF = jax.nn.silu(g_BTF) * u_BTF
        return h_BTF @ self.down_proj[...].astype(dtype)


class Block(nnx.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then + ffn(norm(x)) with a dense or MoE ffn."""

    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        pd = cfg.jnp_param_dtype
        self.is_moe = cfg.is_moe_layer(layer)
        self.input_layernorm = RMSNorm(cfg.embed_dim, cfg.rms_eps, param_dtype=pd, rngs=rngs)
        self.self_attn = Attention(cfg, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.embed_dim, cfg.rms_eps, param_dtype=pd, rngs=rngs)
        if self.is_moe:
            self.mlp = moe.MoE(
                cfg.embed_dim,
                cfg.num_experts,
                cfg.top_k,
                cfg.moe_mlp_dim,
                renormalize=cfg.renormalize_topk,
                dispatch=cfg.dispatch,
                param_dtype=pd,
                dtype=cfg.jnp_dtype,
                rngs=rngs,
            )
        else:
            self.mlp = MLP(cfg.embed_dim, cfg.mlp_dim, param_dtype=pd, rngs=rngs)

    def __call__(self, x_BTD, positions_BT, rope, kv=None, forced_BTK=None, return_kv=False):
        """Returns (x, new_kv, router stats or None); see `Attention` for `kv` and `return_kv`, and
        `Transformer.hidden` for `forced_BTK` (a routing to replay: ids, or ids and gates)."""
        x_BTD = sharding.constrain(x_BTD, ACTIVATION)
        h_BTD, new_kv = self.self_attn(self.input_layernorm(x_BTD), positions_BT, rope, kv, return_kv)
        x_BTD = x_BTD + h_BTD
        h_BTD = self.post_attention_layernorm(x_BTD)
        if self.is_moe:
            topk_BTK, gates_BTK = forced_BTK if isinstance(forced_BTK, tuple) else (forced_BTK, None)
            h_BTD, stats = self.mlp(h_BTD, positions_BT >= 0, topk_BTK, gates_BTK)
        else:
            h_BTD, stats = self.mlp(h_BTD), None
        return sharding.constrain(x_BTD + h_BTD.astype(x_BTD.dtype), ACTIVATION), new_kv, stats


class Stack(nnx.Module):
    """`n` consecutive Blocks of one kind, each parameter stacked on a leading "layers" axis.

    Without a KV cache the layers run as one `lax.scan` (or the same scan unrolled, `scan_layers`),
    with the configured remat policy, and with `return_kv` return each layer's keys and values too (a
    prefill into an empty cache: one layer to compile, not n). With a cache (decoding) they run as
    a loop over static slices of the stack, so each layer's cache is updated in place."""

    def __init__(self, cfg: ModelConfig, first: int, n: int, *, rngs: nnx.Rngs):
        self.cfg, self.n, self.is_moe = cfg, n, cfg.is_moe_layer(first)

        # Built once, vmapped: one initializer call per parameter of the stack (compile time on CPU
        # grows with the number of random draws, not their size).
        @nnx.split_rngs(splits=n)
        @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=n, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def build(rngs):
            return Block(cfg, first, rngs=rngs)

        self.layer = build(rngs)

    def layer_params(self) -> list:
        """Each layer's parameters, sliced from the stack: a sampler takes them once, before its decode
        loop (`Transformer.decode_layers`), so no decode step copies a layer out of the stack."""
        params = nnx.split(self.layer)[1]
        return [jax.tree.map(lambda a, j=j: a[j], params) for j in range(self.n)]

    def __call__(
        self, x_BTD, positions_BT, rope, kvs=None, forced_nBTK=None, router_logits=False, return_kv=False, layers=None
    ):
        """Returns (x, new per-layer kvs or None, router stats stacked over the n layers or None).
        `layers`: `layer_params()` taken earlier (decoding with a cache only)."""
        graphdef, params = nnx.split(self.layer)

        def one(x_BTD, p, kv, forced_BTK):
            x_BTD, new_kv, s = nnx.merge(graphdef, p)(x_BTD, positions_BT, rope, kv, forced_BTK, return_kv)
            if s is not None:
                s = s._replace(logits_BTE=s.logits_BTE if router_logits else None)
            return x_BTD, new_kv, s

        stack = lambda *xs: jax.tree.map(lambda *a: jnp.stack(a), *xs)
        if kvs is not None:
            outs = []
            for j in range(self.n):
                forced = jax.tree.map(lambda a, j=j: a[j], forced_nBTK)
                # Behind a barrier XLA:CPU hoists a slice out of a decode loop (alone it is "not worth
                # hoisting" and is copied every step); XLA:GPU copied it every step even so (issue 40:
                # 1.6 of 3.4 ms per step at the real dims), hence `layers`.
                p_j = (
                    layers[j]
                    if layers is not None
                    else jax.tree.map(lambda a, j=j: jax.lax.optimization_barrier(a[j]), params)
                )
                x_BTD, new_kv, s = one(x_BTD, p_j, kvs[j], forced)
                outs.append((new_kv, s))
            return x_BTD, [kv for kv, _ in outs], stack(*[s for _, s in outs]) if self.is_moe else None

        def body(x_BTD, xs):
            x_BTD, kv, s = one(x_BTD, *xs)
            return x_BTD, (kv, s)

        policy = REMAT_POLICIES[self.cfg.remat]
        if self.cfg.remat != "none":
            body = jax.checkpoint(body, policy=policy, prevent_cse=False)
        unroll = 1 if self.cfg.scan_layers else self.n
        x_BTD, (kv_n, stats) = jax.lax.scan(body, x_BTD, (params, None, forced_nBTK), unroll=unroll)
        kvs = [jax.tree.map(lambda a, j=j: a[j], kv_n) for j in range(self.n)] if return_kv else None
        return x_BTD, kvs, stats


class Transformer(nnx.Module):
    """Token embedding, the layers as `Stack`s (`ModelConfig.layer_runs`), final RMSNorm, (tied or
    untied) LM head."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        pd = cfg.jnp_param_dtype
        self.cfg = cfg
        # Unit-scale embeddings; tied ones are scaled down so initial logits stay O(1).
        embed_std = cfg.embed_dim**-0.5 if cfg.tie_embeddings else 1.0
        self.embed_tokens = sharding.param(
            rngs, nnx.initializers.normal(embed_std), (cfg.vocab_size, cfg.embed_dim), ("vocab", "embed"), pd
        )
        self.stacks = nnx.List([Stack(cfg, first, n, rngs=rngs) for first, n in cfg.layer_runs])
        self.norm = RMSNorm(cfg.embed_dim, cfg.rms_eps, param_dtype=pd, rngs=rngs)
        if not cfg.tie_embeddings:
            self.lm_head = sharding.param(rngs, _fan_in(0, 1), (cfg.embed_dim, cfg.vocab_size), ("embed", "vocab"), pd)

    def __call__(
        self,
        tokens_BT: jax.Array,
        positions_BT: jax.Array,
        cache: KVCache | None = None,
        forced_topk: jax.Array | None = None,
        return_router_logits: bool = False,
        layers: list | None = None,
    ) -> tuple[jax.Array, ModelAux]:
        """float32 logits [B, T, V] and `ModelAux`; see `apply`. `layers`: `decode_layers()`."""
        x_BTD, aux = self.hidden(tokens_BT, positions_BT, cache, forced_topk, return_router_logits, layers=layers)
        return self.logits(x_BTD), aux

    def decode_layers(self) -> list:
        """Every stack's layers sliced out once (`Stack.layer_params`), for the decode steps of a loop."""
        return [stack.layer_params() for stack in self.stacks]

    def head(self) -> jax.Array:
        """The LM head [D, V] in the compute dtype (the embedding, transposed, when tied)."""
        head_DV = self.embed_tokens[...].T if self.cfg.tie_embeddings else self.lm_head[...]
        return head_DV.astype(self.cfg.jnp_dtype)

    def logits(self, x_BTD: jax.Array) -> jax.Array:
        """float32 logits of final hidden states (`hidden`'s output)."""
        return jnp.einsum("btd,dv->btv", x_BTD, self.head(), preferred_element_type=jnp.float32)

    def hidden(
        self,
        tokens_BT: jax.Array,
        positions_BT: jax.Array,
        cache: KVCache | None = None,
        forced_topk: jax.Array | None = None,
        return_router_logits: bool = False,
        empty_cache: bool = False,
        layers: list | None = None,
    ) -> tuple[jax.Array, ModelAux]:
        """The final (normed) hidden states [B, T, D] before the LM head, and `ModelAux`. `empty_cache`:
        the cache holds nothing to attend to (a sampler's prefill: every slot's position is -1), so
        the chunk attends within itself and the layers run as the cache-free scan, each layer's
        keys/values written into its cache afterwards: the same result, one layer compiled per stack."""
        cfg, dtype = self.cfg, self.cfg.jnp_dtype
        chex.assert_rank(tokens_BT, 2, custom_message="tokens must be [B, T]")
        B, T = tokens_BT.shape
        chex.assert_shape(positions_BT, (B, T), custom_message="positions must be [B, T] like tokens")
        L, K = cfg.num_moe_layers, max(cfg.top_k, 1)
        for forced_BLTK in jax.tree.leaves(forced_topk):  # ids, or (ids, gates)
            chex.assert_shape(forced_BLTK, (B, L, T, K), custom_message="forced_topk must be [B, L, T, K]")
        positions_BT = positions_BT.astype(jnp.int32)
        x_BTD = sharding.constrain(jnp.take(self.embed_tokens[...], tokens_BT, axis=0).astype(dtype), ACTIVATION)
        if cache is not None:
            index = cache.index.astype(jnp.int32)
            key_pos_BS = jax.lax.dynamic_update_slice(cache.positions, positions_BT, (jnp.zeros((), jnp.int32), index))
            new_k, new_v = [], []
        rope = rope_table(positions_BT, cfg.head_dim, cfg.rope_theta)
        stats, moe_seen = [], 0  # stats: per MoE stack, RouterOutput stacked [n, ...]
        for i_stack, (stack, (first, n)) in enumerate(zip(self.stacks, cfg.layer_runs)):
            kvs = None
            if cache is not None and not empty_cache:
                kvs = [(cache.k[i], cache.v[i], key_pos_BS, index) for i in range(first, first + n)]
            forced = None
            if forced_topk is not None and stack.is_moe:
                layers_of = lambda a, i=moe_seen, n=n: a[:, i : i + n].transpose(1, 0, 2, 3)
                forced = jax.tree.map(layers_of, forced_topk)
            fill = cache is not None and empty_cache
            stack_layers = None if layers is None or kvs is None else layers[i_stack]
            x_BTD, kvs, s = stack(
                x_BTD, positions_BT, rope, kvs, forced, return_router_logits, return_kv=fill, layers=stack_layers
            )
            if fill:  # this chunk's keys/values [B, T, J, W] into each layer's cache at `index`
                kvs = [
                    (write_kv(cache.k[i], k, index), write_kv(cache.v[i], v, index))
                    for i, (k, v) in enumerate(kvs, first)
                ]
            if cache is not None:
                new_k += [k for k, _ in kvs]
                new_v += [v for _, v in kvs]
            if s is not None:
                stats.append(s)
                moe_seen += n
        x_BTD = sharding.constrain(self.norm(x_BTD), ACTIVATION)

        if stats:
            topk_BLTK = jnp.concatenate([s.topk_BTK for s in stats], axis=0).transpose(1, 0, 2, 3)
            gates_BLTK = jnp.concatenate([s.gates_BTK for s in stats], axis=0).transpose(1, 0, 2, 3)
            router_logits = None
            if return_router_logits:
                router_logits = jnp.concatenate([s.logits_BTE for s in stats], axis=0).transpose(1, 0, 2, 3)
            lb_loss = jnp.mean(jnp.concatenate([s.lb_loss for s in stats]))
            z_loss = jnp.mean(jnp.concatenate([s.z_loss for s in stats]))
        else:
            topk_BLTK = jnp.zeros((B, 0, T, K), jnp.int32)
            gates_BLTK = jnp.zeros((B, 0, T, K), jnp.float32)
            router_logits = jnp.zeros((B, 0, T, cfg.num_experts), jnp.float32) if return_router_logits else None
            lb_loss = z_loss = jnp.zeros((), jnp.float32)
        new_cache = None
        if cache is not None:
            new_cache = KVCache(k=tuple(new_k), v=tuple(new_v), positions=key_pos_BS, index=index + T)
        aux = ModelAux(
            topk=topk_BLTK,
            gates=gates_BLTK,
            router_logits=router_logits,
            lb_loss=lb_loss,
            z_loss=z_loss,
            aux_loss=cfg.lb_loss_coef * lb_loss + cfg.z_loss_coef * z_loss,
            cache=new_cache,
        )
        return x_BTD, aux


def apply(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache | None = None,
    forced_topk: jax.Array | None = None,
    return_router_logits: bool = False,
) -> tuple[jax.Array, ModelAux]:
    """Pure forward pass: merges (graphdef, state) and runs the model.

    tokens, positions: int32 [B, T] (negative position = padding). With `cache`, the T
    tokens are written at slots cache.index.. and attend over the whole cache; the
    updated cache is in aux.cache (the caller must keep index + T <= max_len; past it
    the write start is clamped). `forced_topk` [B, L, T, K] replays a routing's expert ids; a pair
    (ids, gates), both [B, L, T, K], replays their combine weights too (`moe.route`).
    Jit with `graphdef` and `return_router_logits` static, e.g.
    `jax.jit(functools.partial(apply, graphdef), static_argnames="return_router_logits")`.
    """
    model = nnx.merge(graphdef, state)
    return model(tokens, positions, cache=cache, forced_topk=forced_topk, return_router_logits=return_router_logits)


def score(
    graphdef: nnx.GraphDef,
    temperature: float,
    state: nnx.State,
    tokens_BT: jax.Array,
    positions_BT: jax.Array,
    forced_topk_BLTK: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """log-probs of the given tokens at `temperature` (aligned to positions, float32 [B, T]) and the
    router top-k [B, L, T, K]: how the policy scores a rollout (π_old's recompute, π_ref, drift), in
    `ModelConfig.batch_chunks` chunks of the batch. Jit with `graphdef` and `temperature` static."""
    return _score(graphdef, temperature, state, tokens_BT, positions_BT, forced_topk_BLTK, router=False)


def score_with_router(
    graphdef: nnx.GraphDef,
    temperature: float,
    state: nnx.State,
    tokens_BT: jax.Array,
    positions_BT: jax.Array,
    forced_topk_BLTK: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`score`, and the router's log-probabilities at the experts the forward used, float32 [B, L, T, K]
    (`router_shift.expert_logprobs`): π_old's, for RSPO's router-shift ratio. The same forward."""
    return _score(graphdef, temperature, state, tokens_BT, positions_BT, forced_topk_BLTK, router=True)


def _score(graphdef, temperature, state, tokens_BT, positions_BT, forced_topk_BLTK, router: bool):
    def one(tokens_BT, positions_BT, forced_topk_BLTK):
        logp_BT, aux = logprobs(graphdef, state, tokens_BT, positions_BT, forced_topk_BLTK, temperature, router)
        if not router:
            return logp_BT, aux.topk
        return logp_BT, aux.topk, router_shift.expert_logprobs(aux.router_logits, aux.topk)

    chunks = nnx.merge(graphdef, state).cfg.batch_chunks
    return in_batch_chunks(one, chunks, tokens_BT, positions_BT, forced_topk_BLTK)


def in_batch_chunks(fn, chunks: int, *args):
    """`fn(*args)` over `chunks` pieces of the leading (batch) axis, one after another (`lax.map`), the
    results put back in order. Piece i holds rows i, i + chunks, ...: strided, so each piece is spread
    over the devices the batch is sharded on, not held by a few of them. `None` args pass through."""
    if chunks == 1:
        return fn(*args)
    pieces = jax.tree.map(lambda x: split_batch(x, chunks), args)
    return jax.tree.map(merge_batch, jax.lax.map(lambda a: fn(*a), pieces))


def split_batch(x: jax.Array, chunks: int) -> jax.Array:
    """[B, ...] -> [chunks, B / chunks, ...], piece i holding rows i, i + chunks, ... (each device of a
    batch split over the mesh keeps its own rows: no piece lives on a few devices)."""
    return x.reshape(x.shape[0] // chunks, chunks, *x.shape[1:]).swapaxes(0, 1)


def merge_batch(y: jax.Array) -> jax.Array:
    """Inverse of `split_batch`."""
    return y.swapaxes(0, 1).reshape(-1, *y.shape[2:])


def logprobs(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    tokens_BT: jax.Array,
    positions_BT: jax.Array,
    forced_topk_BLTK: jax.Array | None = None,
    temperature: float | jax.Array = 1.0,
    return_router_logits: bool = False,
) -> tuple[jax.Array, ModelAux]:
    """`sequence_logprobs` of the model's own forward over `tokens_BT` (float32 [B, T], position 0 gets
    0) and `ModelAux`, with the LM head run in chunks of `ModelConfig.logprob_chunk` positions."""
    model = nnx.merge(graphdef, state)
    x_BTD, aux = model.hidden(
        tokens_BT, positions_BT, forced_topk=forced_topk_BLTK, return_router_logits=return_router_logits
    )
    logp_BT = sequence_logprobs_from_hidden(x_BTD, model.head(), tokens_BT, temperature, model.cfg.logprob_chunk)
    return logp_BT, aux


def abstract_model(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, abstract state of ShapeDtypeStructs) without allocating parameters."""
    return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))


def _random_state(cfg: ModelConfig, seed: jax.Array) -> nnx.State:
    return nnx.split(Transformer(cfg, rngs=nnx.Rngs(jax.random.key(seed))))[1]


def init(cfg: ModelConfig, seed: int, shardings=None) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, state) of a random `Transformer(cfg)` from `seed`, built by one jitted program (an
    eager build compiles each initializer per shape, seconds on CPU) and placed by `shardings` if
    given (a tree like `param_shardings`' result). One compile per config, whatever the seed."""
    graphdef, _ = abstract_model(cfg)
    build = jax.jit(
        _random_state, static_argnums=0, out_shardings=shardings, compiler_options=compiles.run_once_options()
    )
    return graphdef, build(cfg, np.int32(seed))


def count_params(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active per token): active counts top_k / num_experts of the expert weights."""
    _, state = abstract_model(cfg)
    total = expert = 0
    for v in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        n = int(v.get_value().size)
        total += n
        axes = tuple(v.get_metadata().get("out_sharding") or ())
        if axes[-3:-2] == ("expert",):  # [(layers,) expert, in, out]; the router is [(layers,) embed, expert]
            expert += n
    active = total - expert + (expert * cfg.top_k) // max(cfg.num_experts, 1)
    return total, active

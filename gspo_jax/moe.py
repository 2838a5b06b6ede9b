"""Dropless sparse Mixture-of-Experts feed-forward: float32 router, top-k with optional
renormalisation, routing replay, two dispatch paths, load-balancing and z losses.
Shape letters: `gspo_jax/__init__.py` (E experts, K chosen per token, F expert width).

Dropless means every token reaches its k experts whatever the rest of the batch is,
so a token's output never depends on other tokens: log-probs are exact and routing
replay is well defined.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from gspo_jax import sharding
from gspo_jax.validation import check, check_choice

DISPATCHES = ("dense", "ragged")


class RouterOutput(NamedTuple):
    """What one MoE layer reports about its routing."""

    topk_BTK: jax.Array  # int32 expert indices used (forced ones under replay)
    logits_BTE: jax.Array  # float32 router logits
    lb_loss: jax.Array  # raw load-balancing loss (see `load_balancing_loss`)
    z_loss: jax.Array  # raw router z-loss


def route(
    logits_BTE: jax.Array,
    top_k: int,
    renormalize: bool,
    forced_topk_BTK: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Top-k routing from float32 logits: returns (topk_BTK int32, gates_BTK, probs_BTE).

    Gates are read from the full softmax at the chosen (or forced) indices and, when
    `renormalize`, divided by their sum, so the router gets gradient under replay too.
    `lax.top_k` breaks ties towards the lower expert index.
    """
    probs_BTE = jax.nn.softmax(logits_BTE.astype(jnp.float32), axis=-1)
    if forced_topk_BTK is None:
        _, topk_BTK = jax.lax.top_k(probs_BTE, top_k)
    else:
        topk_BTK = forced_topk_BTK
    topk_BTK = topk_BTK.astype(jnp.int32)
    gates_BTK = jnp.take_along_axis(probs_BTE, topk_BTK, axis=-1)
    if renormalize:
        gates_BTK = gates_BTK / jnp.sum(gates_BTK, axis=-1, keepdims=True)
    return topk_BTK, gates_BTK, probs_BTE


def _masked_mean(x_BT, valid_BT):
    w_BT = valid_BT.astype(jnp.float32)
    return jnp.sum(x_BT * w_BT) / jnp.maximum(jnp.sum(w_BT), 1.0)


def load_balancing_loss(probs_BTE: jax.Array, topk_BTK: jax.Array, valid_BT: jax.Array) -> jax.Array:
    """E * sum_e f_e * P_e over valid tokens (Switch / Qwen-MoE convention).

    f_e = (slots routed to e) / (valid tokens), so sum_e f_e = k and a uniform router
    gives exactly k; P_e = mean router probability of e. f_e carries no gradient.
    """
    num_experts = probs_BTE.shape[-1]
    w_BT = valid_BT.astype(jnp.float32)
    n_tokens = jnp.maximum(jnp.sum(w_BT), 1.0)
    counts_E = jnp.einsum("btke,bt->e", jax.nn.one_hot(topk_BTK, num_experts, dtype=jnp.float32), w_BT)
    f_E = jax.lax.stop_gradient(counts_E / n_tokens)
    p_E = jnp.einsum("bte,bt->e", probs_BTE, w_BT) / n_tokens
    return num_experts * jnp.sum(f_E * p_E)


def router_z_loss(logits_BTE: jax.Array, valid_BT: jax.Array) -> jax.Array:
    """Mean over valid tokens of logsumexp(router logits)^2 (ST-MoE)."""
    lse_BT = jax.nn.logsumexp(logits_BTE.astype(jnp.float32), axis=-1)
    return _masked_mean(lse_BT**2, valid_BT)


def dense_experts(x_BTD, topk_BTK, gates_BTK, w_gate_EDF, w_up_EDF, w_down_EFD):
    """Every expert on every token, mixed by a [B,T,E] combine tensor (zero off the top-k).

    E times the FLOPs of sparse dispatch, but plain einsums: the fast path on CPU at small E.
    """
    dtype = x_BTD.dtype
    combine_BTE = jnp.einsum(
        "btk,btke->bte", gates_BTK, jax.nn.one_hot(topk_BTK, w_gate_EDF.shape[0], dtype=jnp.float32)
    )
    gate_BTEF = jnp.einsum("btd,edf->btef", x_BTD, w_gate_EDF.astype(dtype))
    up_BTEF = jnp.einsum("btd,edf->btef", x_BTD, w_up_EDF.astype(dtype))
    h_BTEF = jax.nn.silu(gate_BTEF) * up_BTEF
    y_BTED = jnp.einsum("btef,efd->bted", h_BTEF, w_down_EFD.astype(dtype))
    y_BTD = jnp.einsum("bted,bte->btd", y_BTED, combine_BTE, preferred_element_type=jnp.float32)
    return y_BTD.astype(dtype)


def ragged_experts(x_BTD, topk_BTK, gates_BTK, w_gate_EDF, w_up_EDF, w_down_EFD):
    """Sparse dispatch: sort the A = B·T·K (token, expert) assignments by expert, run grouped
    matmuls with `lax.ragged_dot`, unsort, weight by the gates and sum over K.

    All shapes are static (A assignments), so it jit-compiles once; the TPU path.
    """
    B, T, D = x_BTD.shape
    K = topk_BTK.shape[-1]
    E = w_gate_EDF.shape[0]
    dtype = x_BTD.dtype
    x_ND = x_BTD.reshape(B * T, D)
    expert_A = topk_BTK.reshape(-1)
    order_A = jnp.argsort(expert_A, stable=True)
    x_AD = x_ND[order_A // K]
    group_sizes_E = jnp.bincount(expert_A, length=E).astype(jnp.int32)
    gate_AF = jax.lax.ragged_dot(x_AD, w_gate_EDF.astype(dtype), group_sizes_E)
    up_AF = jax.lax.ragged_dot(x_AD, w_up_EDF.astype(dtype), group_sizes_E)
    h_AF = jax.nn.silu(gate_AF) * up_AF
    y_sorted_AD = jax.lax.ragged_dot(h_AF, w_down_EFD.astype(dtype), group_sizes_E)
    inverse_A = jnp.zeros_like(order_A).at[order_A].set(jnp.arange(order_A.shape[0], dtype=order_A.dtype))
    y_NKD = y_sorted_AD[inverse_A].reshape(B * T, K, D)
    y_ND = jnp.einsum("nkd,nk->nd", y_NKD, gates_BTK.reshape(B * T, K), preferred_element_type=jnp.float32)
    return y_ND.reshape(B, T, D).astype(dtype)


class MoE(nnx.Module):
    """Sparse SwiGLU experts behind a float32 top-k router.

    Parameters (HF-mappable): router [embed, expert]; gate_proj/up_proj
    [expert, embed, mlp]; down_proj [expert, mlp, embed].
    """

    def __init__(
        self,
        embed_dim: int,
        num_experts: int,
        top_k: int,
        mlp_dim: int,
        *,
        renormalize: bool,
        dispatch: str = "dense",
        param_dtype=jnp.float32,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        check_choice("MoE", "dispatch", dispatch, DISPATCHES)
        check(1 <= top_k <= num_experts, "MoE", "top_k", top_k, f"in [1, num_experts={num_experts}]")
        self.num_experts, self.top_k = num_experts, top_k
        self.renormalize, self.dispatch, self.dtype = renormalize, dispatch, dtype

        def fan_in(axis):
            return nnx.initializers.variance_scaling(
                1.0, "fan_in", "truncated_normal", in_axis=axis, out_axis=-1, batch_axis=(0,)
            )

        self.router = sharding.param(
            rngs, nnx.initializers.lecun_normal(), (embed_dim, num_experts), ("embed", "expert"), param_dtype
        )
        self.gate_proj = sharding.param(
            rngs, fan_in(-2), (num_experts, embed_dim, mlp_dim), ("expert", "embed", "mlp"), param_dtype
        )
        self.up_proj = sharding.param(
            rngs, fan_in(-2), (num_experts, embed_dim, mlp_dim), ("expert", "embed", "mlp"), param_dtype
        )
        self.down_proj = sharding.param(
            rngs, fan_in(-2), (num_experts, mlp_dim, embed_dim), ("expert", "mlp", "embed"), param_dtype
        )

    def __call__(
        self, x_BTD: jax.Array, valid_BT: jax.Array, forced_topk_BTK: jax.Array | None = None
    ) -> tuple[jax.Array, RouterOutput]:
        """Mixes each token's top-k experts; `valid_BT` masks padding out of the aux losses."""
        logits_BTE = jnp.einsum("btd,de->bte", x_BTD.astype(jnp.float32), self.router[...].astype(jnp.float32))
        topk_BTK, gates_BTK, probs_BTE = route(logits_BTE, self.top_k, self.renormalize, forced_topk_BTK)
        experts = dense_experts if self.dispatch == "dense" else ragged_experts
        y_BTD = experts(
            x_BTD.astype(self.dtype),
            topk_BTK,
            gates_BTK,
            self.gate_proj[...],
            self.up_proj[...],
            self.down_proj[...],
        )
        stats = RouterOutput(
            topk_BTK=topk_BTK,
            logits_BTE=logits_BTE,
            lb_loss=load_balancing_loss(probs_BTE, topk_BTK, valid_BT),
            z_loss=router_z_loss(logits_BTE, valid_BT),
        )
        return y_BTD, stats

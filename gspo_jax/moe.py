"""Dropless sparse Mixture-of-Experts feed-forward: the float32 router, top-k with optional
renormalisation, routing replay, load-balancing and z losses, and the `MoE` layer, which runs the
experts by a dispatch path (`gspo_jax/dispatch.py`: four of them, and the `auto` rule that picks one
per backend) on the mesh the program is traced under (`gspo_jax/expert_parallel.py`: expert
parallelism, or the grouped kernels' per-device shard_map). Shape letters: `gspo_jax/__init__.py`
(E experts, K chosen per token, F expert width).

Dropless means every token reaches its k experts whatever the rest of the batch is,
so a token's output never depends on other tokens: log-probs are exact and routing
replay is well defined.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from gspo_jax import expert_parallel, sharding
from gspo_jax.dispatch import DISPATCHES, ExpertAdapters, experts_fn, resolve_dispatch
from gspo_jax.lora import OFF, Adapter, LoraConfig
from gspo_jax.validation import check, check_choice


class RouterOutput(NamedTuple):
    """What one MoE layer reports about its routing."""

    topk_BTK: jax.Array  # int32 expert indices used (forced ones under replay)
    gates_BTK: jax.Array  # float32 combine weights used (forced ones under weight replay)
    logits_BTE: jax.Array  # float32 router logits
    lb_loss: jax.Array  # raw load-balancing loss (see `load_balancing_loss`)
    z_loss: jax.Array  # raw router z-loss


def route(
    logits_BTE: jax.Array,
    top_k: int,
    renormalize: bool,
    forced_topk_BTK: jax.Array | None = None,
    forced_gates_BTK: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Top-k routing from float32 logits: returns (topk_BTK int32, gates_BTK, probs_BTE).

    Gates are read from the full softmax at the chosen (or forced) indices and, when
    `renormalize`, divided by their sum, so the router gets gradient under replay too.
    `forced_gates_BTK` (weight replay) replaces their values exactly while the gradient still
    flows through the live gates at the forced indices (a straight-through estimator: forced +
    live − sg(live)). `lax.top_k` breaks ties towards the lower expert index.
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
    if forced_gates_BTK is not None:  # live − sg(live) is exactly 0: the value is the forced one
        gates_BTK = forced_gates_BTK.astype(jnp.float32) + (gates_BTK - jax.lax.stop_gradient(gates_BTK))
    return topk_BTK, gates_BTK, probs_BTE


# Padding tokens skip the experts (`expert_rows`); False runs them as any token (the baseline that
# `benchmarks/deep_iteration.py` times against).
SKIP_PADDING = True


def expert_rows(topk_BTK: jax.Array, valid_BT: jax.Array, num_experts: int) -> jax.Array:
    """The experts a dispatch runs for each token: its routing, but index E ("no expert", output 0) for
    padding tokens, whose outputs nothing reads (log-probs, losses and routing statistics are all
    masked to valid tokens), so in a batch of left-padded prompts and padded completions the experts
    do only the valid tokens' work. The routing itself (recorded, replayed, measured) is unchanged."""
    if not SKIP_PADDING:
        return topk_BTK
    return jnp.where(valid_BT[..., None], topk_BTK, num_experts).astype(topk_BTK.dtype)


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


class MoE(nnx.Module):
    """Sparse SwiGLU experts behind a float32 top-k router.

    Parameters (HF-mappable): router [embed, expert]; gate_proj/up_proj
    [expert, embed, mlp]; down_proj [expert, mlp, embed]. With `lora` adapting "router" the router gets
    a low-rank pair, and adapting "experts" each expert's projections get theirs (`lora.Adapter`), run
    by the dispatch path on the routed rows only (`dispatch.ExpertAdapters`).
    """

    def __init__(
        self,
        embed_dim: int,
        num_experts: int,
        top_k: int,
        mlp_dim: int,
        *,
        renormalize: bool,
        dispatch: str = "auto",
        param_dtype=jnp.float32,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
        lora: LoraConfig = OFF,
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
        D, F, E = ((embed_dim,), ("embed",)), ((mlp_dim,), ("mlp",)), num_experts
        if lora.adapts("router"):
            self.router_lora = Adapter(lora, *D, (E,), ("expert",), rngs=rngs)
        if lora.adapts("experts"):
            self.gate_proj_lora = Adapter(lora, *D, *F, experts=E, rngs=rngs)
            self.up_proj_lora = Adapter(lora, *D, *F, experts=E, rngs=rngs)
            self.down_proj_lora = Adapter(lora, *F, *D, experts=E, rngs=rngs)

    def expert_adapters(self) -> ExpertAdapters | None:
        """The experts' adapters as the dispatch paths take them (α/r folded into B); None without."""
        if not hasattr(self, "gate_proj_lora"):
            return None
        g, u, d = self.gate_proj_lora, self.up_proj_lora, self.down_proj_lora
        return ExpertAdapters(g.a[...], g.scaled_b(), u.a[...], u.scaled_b(), d.a[...], d.scaled_b())

    def __call__(
        self,
        x_BTD: jax.Array,
        valid_BT: jax.Array,
        forced_topk_BTK: jax.Array | None = None,
        forced_gates_BTK: jax.Array | None = None,
    ) -> tuple[jax.Array, RouterOutput]:
        """Mixes each token's top-k experts; `valid_BT` masks padding out of the aux losses. Replay:
        `forced_topk_BTK` fixes the experts, `forced_gates_BTK` their combine weights too (`route`)."""
        # float32 at full precision on every backend: TPUs (bf16 passes) and GPUs (TF32) default lower.
        logits_BTE = jnp.einsum(
            "btd,de->bte",
            x_BTD.astype(jnp.float32),
            self.router[...].astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
        )
        if hasattr(self, "router_lora"):
            logits_BTE = logits_BTE + self.router_lora(x_BTD, jnp.float32, jax.lax.Precision.HIGHEST)
        topk_BTK, gates_BTK, probs_BTE = route(
            logits_BTE, self.top_k, self.renormalize, forced_topk_BTK, forced_gates_BTK
        )
        dims, platform = self.gate_proj.shape[1:], sharding.platform()  # dims: (D, F)
        dispatch = resolve_dispatch(self.dispatch, platform, self.dtype, dims)
        experts = experts_fn(dispatch, platform, self.dtype, dims)
        experts = expert_parallel.parallel_experts(experts, dispatch, jax.sharding.get_abstract_mesh())
        adapters = self.expert_adapters()
        y_BTD = experts(
            x_BTD.astype(self.dtype),
            expert_rows(topk_BTK, valid_BT, self.num_experts),
            gates_BTK,
            self.gate_proj[...],
            self.up_proj[...],
            self.down_proj[...],
            **({} if adapters is None else {"adapters": adapters}),  # rank 0: the call it always was
        )
        stats = RouterOutput(
            topk_BTK=topk_BTK,
            gates_BTK=gates_BTK,
            logits_BTE=logits_BTE,
            lb_loss=load_balancing_loss(probs_BTE, topk_BTK, valid_BT),
            z_loss=router_z_loss(logits_BTE, valid_BT),
        )
        return y_BTD, stats

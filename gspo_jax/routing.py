"""Expert-activation drift between two routings of the same tokens, the routing share of log-ratios,
and `measure_drift`: both, for an updated policy on the batch its π_old sampled.

Routings are router top-k indices `topk_BLTK` [B, L, T, K] (batch-first, as the model records them;
L = MoE layers); `valid_BT` selects the tokens that count. Definitions: "MoE routing, drift and
replay" in docs/ALGORITHMS.md.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gspo_jax import model as model_lib

Array = jax.Array


def overlap(old_BLTK: Array, new_BLTK: Array) -> Array:
    """|S_old ∩ S_new| per (token, layer): int32 [B, L, T] (top-k entries are distinct)."""
    same = old_BLTK[..., :, None] == new_BLTK[..., None, :]
    return jnp.sum(same, axis=(-2, -1)).astype(jnp.int32)


def routing_drift(
    old_BLTK: Array,
    new_BLTK: Array,
    valid_BT: Array,
    old_logits_BLTE: Array | None = None,
    new_logits_BLTE: Array | None = None,
) -> dict[str, Array]:
    """Drift metrics (float32 scalars, plus `flip_rate_per_layer` [L]).

    slot_change_rate  1 - Σ|S_old ∩ S_new| / (N·L·k)
    router_flip_rate  fraction of (token, layer) pairs whose expert set changed
    token_any_flip    fraction of tokens whose set changed in at least one layer
    flips_per_token   mean number of layers whose set changed, per token
    jaccard           mean |∩| / |∪| over (token, layer)
    router_kl, router_tv  KL(p_old ‖ p_new) and total variation of the full router softmax, when
                      router logits are given
    """
    _, L, _, k = old_BLTK.shape
    valid_BT = valid_BT.astype(bool)
    valid_B1T = valid_BT[:, None]
    n_tok = jnp.maximum(jnp.sum(valid_BT), 1).astype(jnp.float32)
    if L == 0:
        zero = jnp.zeros((), jnp.float32)
        out = dict(
            slot_change_rate=zero,
            router_flip_rate=zero,
            token_any_flip=zero,
            flips_per_token=zero,
            jaccard=jnp.ones((), jnp.float32),
            flip_rate_per_layer=jnp.zeros((0,), jnp.float32),
        )
        if old_logits_BLTE is not None:
            out.update(router_kl=zero, router_tv=zero)
        return out
    inter_BLT = overlap(old_BLTK, new_BLTK)
    flipped_BLT = (inter_BLT < k) & valid_B1T
    per_layer_L = jnp.sum(flipped_BLT, axis=(0, 2)) / n_tok
    inter = jnp.where(valid_B1T, inter_BLT, 0).astype(jnp.float32)
    jacc_BLT = inter_BLT / (2 * k - inter_BLT)
    out = dict(
        slot_change_rate=1.0 - jnp.sum(inter) / (n_tok * L * k),
        router_flip_rate=jnp.mean(per_layer_L),
        token_any_flip=jnp.sum(jnp.any(flipped_BLT, axis=1)) / n_tok,
        flips_per_token=jnp.sum(flipped_BLT) / n_tok,
        jaccard=jnp.sum(jnp.where(valid_B1T, jacc_BLT, 0.0)) / (n_tok * L),
        flip_rate_per_layer=per_layer_L.astype(jnp.float32),
    )
    if old_logits_BLTE is not None and new_logits_BLTE is not None:
        lp_old = jax.nn.log_softmax(old_logits_BLTE.astype(jnp.float32), axis=-1)
        lp_new = jax.nn.log_softmax(new_logits_BLTE.astype(jnp.float32), axis=-1)
        kl_BLT = jnp.sum(jnp.exp(lp_old) * (lp_old - lp_new), axis=-1)
        tv_BLT = 0.5 * jnp.sum(jnp.abs(jnp.exp(lp_old) - jnp.exp(lp_new)), axis=-1)
        mean = lambda x: jnp.sum(jnp.where(valid_B1T, x, 0.0)) / (n_tok * L)
        out.update(router_kl=mean(kl_BLT), router_tv=mean(tv_BLT))
    return out


def flipped_tokens(old_BLTK: Array, new_BLTK: Array) -> Array:
    """bool [B, T]: tokens whose expert set changed in at least one MoE layer."""
    k = old_BLTK.shape[-1]
    return jnp.any(overlap(old_BLTK, new_BLTK) < k, axis=1)


# Edges of the router-margin buckets (probability units): [0, .01), [.01, .03), ..., [.3, 1].
MARGIN_EDGES = (0.01, 0.03, 0.1, 0.3)


def router_margin(probs_BLTE: Array, k: int) -> Array:
    """p_(k) − p_(k+1) per (token, layer): how far the k-th chosen expert is from the first one left
    out, the distance a top-k set has to cross to change. float32 [B, L, T]."""
    top_BLTk = jax.lax.top_k(probs_BLTE, k + 1)[0]
    return top_BLTk[..., k - 1] - top_BLTk[..., k]


def expert_load(topk_BLTK: Array, valid_BT: Array, num_experts: int) -> Array:
    """Each expert's share of a layer's routed (token, slot) assignments: float32 [L, E], rows sum to 1
    (uniform: 1/E)."""
    counts_LE = expert_counts(topk_BLTK, valid_BT, num_experts).astype(jnp.float32)
    return counts_LE / jnp.maximum(jnp.sum(counts_LE, axis=-1, keepdims=True), 1.0)


def expert_counts(topk_BLTK: Array, valid_BT: Array, num_experts: int) -> Array:
    """How many valid (token, slot) assignments each expert of each layer got: int32 [L, E]."""
    onehot_BLTKE = jax.nn.one_hot(topk_BLTK, num_experts, dtype=jnp.int32)
    return jnp.sum(onehot_BLTKE * valid_BT[:, None, :, None, None].astype(jnp.int32), axis=(0, 2, 3))


def routing_diagnostics(old_BLTK: Array, new_BLTK: Array, new_logits_BLTE: Array, valid_BT: Array) -> dict[str, Array]:
    """What the router of π_θ (`new_*`) looks like and how its choices moved from π_old's (`old_BLTK`).

    router_margin       mean p_(k) − p_(k+1) under π_θ
    router_entropy      mean entropy of π_θ's router softmax, nats (uniform: log E)
    margin_bucket_frac  [M] share of (token, layer) pairs per margin bucket (`MARGIN_EDGES`)
    flip_rate_by_margin [M] fraction of those pairs whose expert set differs from π_old's
    load_old, load_new  [L, E] `expert_load` under π_old's and π_θ's routing
    load_max_per_layer  [L] E · max_e load_new: 1 when balanced, E when one expert takes all
    load_moved_per_layer [L] total variation between load_old and load_new
    """
    _, L, _, k = old_BLTK.shape
    E = new_logits_BLTE.shape[-1]
    valid_BT = valid_BT.astype(bool)
    valid_BLT = jnp.broadcast_to(valid_BT[:, None], old_BLTK.shape[:3])
    n = jnp.maximum(jnp.sum(valid_BLT), 1).astype(jnp.float32)
    mean = lambda x_BLT: jnp.sum(jnp.where(valid_BLT, x_BLT, 0.0)) / n
    logp_BLTE = jax.nn.log_softmax(new_logits_BLTE.astype(jnp.float32), axis=-1)
    probs_BLTE = jnp.exp(logp_BLTE)
    entropy_BLT = -jnp.sum(probs_BLTE * logp_BLTE, axis=-1)
    # With k = E every expert is chosen: the set cannot change, the margin is taken as 1.
    margin_BLT = router_margin(probs_BLTE, k) if k < E else jnp.ones(old_BLTK.shape[:3], jnp.float32)
    bucket_BLT = jnp.searchsorted(jnp.asarray(MARGIN_EDGES, jnp.float32), margin_BLT, side="right")
    in_bucket_MBLT = (bucket_BLT == jnp.arange(len(MARGIN_EDGES) + 1)[:, None, None, None]) & valid_BLT
    flipped_BLT = overlap(old_BLTK, new_BLTK) < k
    hits_M = jnp.sum(in_bucket_MBLT, axis=(1, 2, 3)).astype(jnp.float32)
    flips_M = jnp.sum(in_bucket_MBLT & flipped_BLT, axis=(1, 2, 3)).astype(jnp.float32)
    load_old_LE = expert_load(old_BLTK, valid_BT, E)
    load_new_LE = expert_load(new_BLTK, valid_BT, E)
    # Both routings assign the same number of slots: the load's TV from integer counts (exactly 0
    # when nothing moved).
    moved_LE = jnp.abs(expert_counts(new_BLTK, valid_BT, E) - expert_counts(old_BLTK, valid_BT, E))
    slots = jnp.maximum(jnp.sum(valid_BT), 1).astype(jnp.float32) * k
    return dict(
        router_margin=mean(margin_BLT),
        router_entropy=mean(entropy_BLT),
        margin_bucket_frac=hits_M / n,
        flip_rate_by_margin=flips_M / jnp.maximum(hits_M, 1.0),
        load_old=load_old_LE,
        load_new=load_new_LE,
        load_max_per_layer=E * jnp.max(load_new_LE, axis=-1),
        load_moved_per_layer=0.5 * jnp.sum(moved_LE, axis=-1).astype(jnp.float32) / slots,
    )


def log_ratio_decomposition(
    logp_own_BT: Array, logp_replayed_BT: Array, old_logp_BT: Array, mask_BT: Array
) -> dict[str, Array]:
    """Splits each token's log-ratio into routing drift and everything else.

    log r = [logp_θ(own routing) − logp_θ(π_old's routing replayed)] + [logp_θ(replayed) − old_logp].
    Reports the mean absolute size of each part and the routing part's share of the log-ratio's
    mean square (how much of the importance-ratio noise routing drift alone explains).
    """
    m = mask_BT.astype(bool)
    n = jnp.maximum(jnp.sum(m), 1).astype(jnp.float32)
    routing = jnp.where(m, logp_own_BT - logp_replayed_BT, 0.0)
    rest = jnp.where(m, logp_replayed_BT - old_logp_BT, 0.0)
    total = routing + rest
    ms_total = jnp.sum(jnp.square(total)) / n
    return dict(
        logratio_routing_abs=jnp.sum(jnp.abs(routing)) / n,
        logratio_rest_abs=jnp.sum(jnp.abs(rest)) / n,
        logratio_routing_share=jnp.where(ms_total > 0, jnp.sum(jnp.square(routing)) / n / ms_total, 0.0),
    )


class RolloutTokens(Protocol):
    """What `measure_drift` reads from a batch (`train.TrainBatch` has it)."""

    tokens: Array  # int32 [B, T]
    positions: Array  # int32 [B, T]
    completion_mask: Array  # bool [B, T]
    old_logp: Array  # float32 [B, T]: π_old's log-probs
    topk: Array  # int32 [B, L, T, K]: π_old's routing


def measure_drift(
    graphdef: nnx.GraphDef, temperature: float, diagnostics: bool, params, batch: RolloutTokens
) -> dict[str, Array]:
    """How an update moved routing and log-probs on the rollout's own tokens: the routing drift of
    π_θ (`params`) against π_old's routing in `batch`, and the log-ratio split into routing and the
    rest (π_θ scored once with its own routing, once with π_old's replayed); with `diagnostics`, also
    `routing_diagnostics` from the first forward's router logits (no extra forward). Pure; jit it
    with `graphdef`, `temperature` and `diagnostics` static."""

    def own(tokens_BT, positions_BT):
        logp_BT, aux = model_lib.logprobs(
            graphdef, params, tokens_BT, positions_BT, None, temperature, return_router_logits=diagnostics
        )
        return logp_BT, aux.topk, aux.router_logits

    chunks = nnx.merge(graphdef, params).cfg.batch_chunks
    logp_own_BT, topk_new_BLTK, logits_BLTE = model_lib.in_batch_chunks(own, chunks, batch.tokens, batch.positions)
    logp_replayed_BT, _ = model_lib.score(graphdef, temperature, params, batch.tokens, batch.positions, batch.topk)
    out = routing_drift(batch.topk, topk_new_BLTK, batch.completion_mask)
    out.update(log_ratio_decomposition(logp_own_BT, logp_replayed_BT, batch.old_logp, batch.completion_mask))
    if diagnostics and batch.topk.shape[1] > 0:
        out.update(routing_diagnostics(batch.topk, topk_new_BLTK, logits_BLTE, batch.completion_mask))
    return out


def drift_to_log(drift: dict[str, Array]) -> dict[str, float]:
    """`measure_drift`'s result as `drift_*` scalars: per-layer values `x_per_layer` as
    `drift_x_layer{i}` (`drift_flip_rate_layer{i}`), per-bucket ones as `drift_x_bucket{i}`; the [L, E]
    expert loads stay out (`expert_loads`)."""
    out = {}
    for k, v in jax.device_get(drift).items():
        v = np.asarray(v)
        if k in ("load_old", "load_new"):
            continue
        if k.endswith("_per_layer"):
            out.update({f"drift_{k[: -len('_per_layer')]}_layer{i}": float(x) for i, x in enumerate(v)})
        elif v.ndim == 1:  # by margin bucket
            out.update({f"drift_{k}_bucket{i}": float(x) for i, x in enumerate(v)})
        else:
            out[f"drift_{k}"] = float(v)
    return out


def expert_loads(drift: dict[str, Array]) -> dict[str, list] | None:
    """π_old's and π_θ's per-expert load of each MoE layer ([L][E] lists), when the drift measured them."""
    if "load_new" not in drift:
        return None
    return {k: np.asarray(drift[k]).tolist() for k in ("load_old", "load_new")}

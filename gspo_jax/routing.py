"""Expert-activation drift between two routings of the same tokens, and the routing share of log-ratios.

Routings are router top-k indices `topk_LBTK` [L_moe, B, T, k] (as the model records them); `valid_BT`
selects the tokens that count. Definitions: "MoE routing, drift and replay" in ALGORITHMS.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def overlap(old_LBTK: Array, new_LBTK: Array) -> Array:
    """|S_old ∩ S_new| per (layer, token): int32 [L, B, T] (top-k entries are distinct)."""
    same = old_LBTK[..., :, None] == new_LBTK[..., None, :]
    return jnp.sum(same, axis=(-2, -1)).astype(jnp.int32)


def routing_drift(
    old_LBTK: Array,
    new_LBTK: Array,
    valid_BT: Array,
    old_logits_LBTE: Array | None = None,
    new_logits_LBTE: Array | None = None,
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
    L, _, _, k = old_LBTK.shape
    valid_BT = valid_BT.astype(bool)
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
        if old_logits_LBTE is not None:
            out.update(router_kl=zero, router_tv=zero)
        return out
    inter_LBT = overlap(old_LBTK, new_LBTK)
    flipped_LBT = (inter_LBT < k) & valid_BT[None]
    per_layer_L = jnp.sum(flipped_LBT, axis=(1, 2)) / n_tok
    inter = jnp.where(valid_BT[None], inter_LBT, 0).astype(jnp.float32)
    jacc_LBT = inter_LBT / (2 * k - inter_LBT)
    out = dict(
        slot_change_rate=1.0 - jnp.sum(inter) / (n_tok * L * k),
        router_flip_rate=jnp.mean(per_layer_L),
        token_any_flip=jnp.sum(jnp.any(flipped_LBT, axis=0)) / n_tok,
        flips_per_token=jnp.sum(flipped_LBT) / n_tok,
        jaccard=jnp.sum(jnp.where(valid_BT[None], jacc_LBT, 0.0)) / (n_tok * L),
        flip_rate_per_layer=per_layer_L.astype(jnp.float32),
    )
    if old_logits_LBTE is not None and new_logits_LBTE is not None:
        lp_old = jax.nn.log_softmax(old_logits_LBTE.astype(jnp.float32), axis=-1)
        lp_new = jax.nn.log_softmax(new_logits_LBTE.astype(jnp.float32), axis=-1)
        kl_LBT = jnp.sum(jnp.exp(lp_old) * (lp_old - lp_new), axis=-1)
        tv_LBT = 0.5 * jnp.sum(jnp.abs(jnp.exp(lp_old) - jnp.exp(lp_new)), axis=-1)
        mean = lambda x: jnp.sum(jnp.where(valid_BT[None], x, 0.0)) / (n_tok * L)  # noqa: E731
        out.update(router_kl=mean(kl_LBT), router_tv=mean(tv_LBT))
    return out


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

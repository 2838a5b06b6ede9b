"""Log-probabilities of tokens under the policy's LM head: from logits, or from the final hidden states
with the head run in chunks of positions (`sequence_logprobs_from_hidden`, what `model.logprobs` and
`model.score` use). float32 whatever the input dtype. Shape letters: `gspo_jax/__init__.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def token_logprobs(logits_BTV: Array, tokens_BT: Array, temperature: float | Array = 1.0) -> Array:
    """log π(token) under softmax(logits / temperature), computed in float32: [B, T]."""
    logits_BTV = logits_BTV.astype(jnp.float32) / jnp.asarray(temperature, jnp.float32)
    lse_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    picked_BT = jnp.take_along_axis(logits_BTV, tokens_BT[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked_BT - lse_BT


def sequence_logprobs(logits_BTV: Array, tokens_BT: Array, temperature: float | Array = 1.0) -> Array:
    """log π(tokens[:, t] | tokens[:, :t]) aligned to positions, float32 [B, T]; position 0 gets 0.

    `logits_BTV` is the full forward over `tokens_BT` (logits at t predict token t + 1).
    """
    logp_BT = token_logprobs(logits_BTV[:, :-1], tokens_BT[:, 1:], temperature)
    return jnp.pad(logp_BT, ((0, 0), (1, 0)))


@jax.custom_vjp
def head_logits(h_BCD: Array, head_DV: Array) -> Array:
    """float32 logits h @ head, whose backward keeps the inputs' dtype: the float32 cotangent is cast to
    `h`'s dtype before both backward matmuls (float32 accumulation, as the forward). Autodiff would
    promote a bfloat16 head to float32 there: two float32 matmuls as wide as the vocabulary, a quarter
    of the real-dims train step on an H100 (issue 40's profile). For float32 inputs it is autodiff."""
    return jnp.einsum("bcd,dv->bcv", h_BCD, head_DV, preferred_element_type=jnp.float32)


def _head_logits_fwd(h_BCD, head_DV):
    return head_logits(h_BCD, head_DV), (h_BCD, head_DV)


def _head_logits_bwd(res, g_BCV):
    h_BCD, head_DV = res
    g_BCV = g_BCV.astype(jnp.promote_types(h_BCD.dtype, head_DV.dtype))
    dh = jnp.einsum("bcv,dv->bcd", g_BCV, head_DV.astype(g_BCV.dtype), preferred_element_type=jnp.float32)
    dhead = jnp.einsum("bcd,bcv->dv", h_BCD.astype(g_BCV.dtype), g_BCV, preferred_element_type=jnp.float32)
    return dh.astype(h_BCD.dtype), dhead.astype(head_DV.dtype)


head_logits.defvjp(_head_logits_fwd, _head_logits_bwd)


def sequence_logprobs_from_hidden(
    h_BTD: Array, head_DV: Array, tokens_BT: Array, temperature: float | Array = 1.0, chunk: int = 0
) -> Array:
    """`sequence_logprobs(h_BTD @ head_DV, tokens_BT, temperature)` from the final hidden states.

    With `chunk` > 0 the LM head and log-softmax run over `chunk` positions at a time, each chunk under
    `jax.checkpoint`: neither the forward nor the backward holds more than [B, chunk, V] float32 logits
    (a 151,936-token vocabulary makes the whole [B, T, V] the largest tensor of a step). chunk=0: at once.
    """
    B, T, _ = h_BTD.shape
    targets_BT = jnp.pad(tokens_BT[:, 1:], ((0, 0), (0, 1)))  # position t predicts token t + 1; the last none

    def logp(h_BCD, targets_BC):
        return token_logprobs(head_logits(h_BCD, head_DV), targets_BC, temperature)

    if not chunk or chunk >= T:
        logp_BT = logp(h_BTD, targets_BT)
    else:
        n = -(-T // chunk)
        pad = n * chunk - T
        h_nBCD = jnp.pad(h_BTD, ((0, 0), (0, pad), (0, 0))).reshape(B, n, chunk, -1).swapaxes(0, 1)
        t_nBC = jnp.pad(targets_BT, ((0, 0), (0, pad))).reshape(B, n, chunk).swapaxes(0, 1)
        logp_nBC = jax.lax.map(jax.checkpoint(lambda a: logp(*a)), (h_nBCD, t_nBC))
        logp_BT = logp_nBC.swapaxes(0, 1).reshape(B, n * chunk)[:, :T]
    return jnp.pad(logp_BT[:, :-1], ((0, 0), (1, 0)))

"""The JAX sampler: one prefill of left-padded prompts, then a `lax.while_loop` decode over a donated KV cache.

It is where π_old is born: besides the tokens it returns the log-prob of every sampled token and the
router top-k of every position the model processed, so the trainer can check its recomputation and
replay the sampler's routing (R3).

Static (one compile each): batch, prompt bucket P, max new tokens N, `max_top_k`. Traced (changing
them never recompiles): temperature, top-k, top-p, the RNG key, the EOS ids, the pad id.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gspo_jax import model as model_lib
from gspo_jax import sharding as sharding_lib

MAX_EOS_IDS = 4  # EOS ids travel as a fixed-size int32 vector padded with -1


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["tokens", "prompt_mask", "completion_mask", "logp", "lengths", "truncated", "topk"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class SampleOutput:
    """Everything aligned to token positions of the [B, P+N] sequence (prompt left-padded to P).

    logp[b, j] is log π(tokens[b, j] | tokens[b, :j]) at the sampling temperature *without* top-k /
    top-p truncation — the quantity the trainer recomputes (`sequence_logprobs`); 0 off completions.
    With temperature 0 (greedy) the log-probs are those at temperature 1.
    """

    tokens: jax.Array  # int32 [B, P+N]
    prompt_mask: jax.Array  # bool [B, P+N]: real prompt tokens
    completion_mask: jax.Array  # bool [B, P+N]: generated tokens up to and including EOS
    logp: jax.Array  # float32 [B, P+N]
    lengths: jax.Array  # int32 [B]: completion tokens, EOS included
    truncated: jax.Array  # bool [B]: no EOS within N tokens
    topk: jax.Array  # int32 [L_moe, B, P+N, k]: router choices where the model ran (0 elsewhere)


def left_pad(token_lists: Sequence[Sequence[int]], length: int, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Left-pads token lists into a [B, length] int32 array and its bool mask."""
    tokens = np.full((len(token_lists), length), pad_id, np.int32)
    mask = np.zeros((len(token_lists), length), bool)
    for i, toks in enumerate(token_lists):
        if not 0 < len(toks) <= length:
            raise ValueError(f"prompt {i} has {len(toks)} tokens; prompts need 1..{length} (the prompt bucket)")
        tokens[i, length - len(toks) :] = toks
        mask[i, length - len(toks) :] = True
    return tokens, mask


def sequence_logprobs(logits_BTV: jax.Array, tokens_BT: jax.Array, temperature=1.0) -> jax.Array:
    """log π(tokens[:, j] | tokens[:, :j]) aligned to positions, float32 [B, T]; position 0 gets 0.

    `logits_BTV` is the full forward over `tokens_BT` (logits at j predict token j + 1).
    """
    from gspo_jax.losses import token_logprobs  # losses never import the model; this is the bridge

    logp = token_logprobs(logits_BTV[:, :-1], tokens_BT[:, 1:], temperature)
    return jnp.pad(logp, ((0, 0), (1, 0)))


def sample_logits(logits_BV, key, temperature, top_k, top_p, max_top_k: int):
    """Draws one token per row: temperature, then top-k, then top-p inside the top-k.

    temperature <= 0 is greedy. top_k <= 0 disables top-k; top_p >= 1 disables top-p. When either is
    on, candidates come from one `lax.top_k(max_top_k)` — never a full-vocabulary sort — so the
    nucleus is searched within the best `max_top_k` tokens.
    """
    logits_BV = logits_BV.astype(jnp.float32)
    greedy = temperature <= 0
    scaled_BV = logits_BV / jnp.where(greedy, 1.0, temperature)

    def full(_):
        return jax.random.categorical(key, scaled_BV, axis=-1).astype(jnp.int32)

    def truncated(_):
        vals_BK, idx_BK = jax.lax.top_k(scaled_BV, max_top_k)
        rank_K = jnp.arange(max_top_k)
        vals_BK = jnp.where((top_k <= 0) | (rank_K < top_k), vals_BK, -jnp.inf)
        probs_BK = jax.nn.softmax(vals_BK, axis=-1)
        mass_before_BK = jnp.cumsum(probs_BK, axis=-1) - probs_BK
        vals_BK = jnp.where(mass_before_BK < top_p, vals_BK, -jnp.inf)  # the best token always stays
        choice_B = jax.random.categorical(key, vals_BK, axis=-1)
        return jnp.take_along_axis(idx_BK, choice_B[:, None], axis=-1)[:, 0].astype(jnp.int32)

    tok_B = jax.lax.cond((top_k <= 0) & (top_p >= 1.0), full, truncated, None)
    tok_B = jnp.where(greedy, jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), tok_B)
    logp_B = jnp.take_along_axis(jax.nn.log_softmax(scaled_BV, axis=-1), tok_B[:, None], axis=-1)[:, 0]
    return tok_B, logp_B


def _generate(
    graphdef,
    max_new_tokens: int,
    max_top_k: int,
    state,
    cache,
    prompt_BP,
    prompt_mask_BP,
    key,
    temperature,
    top_k,
    top_p,
    eos_ids,
    pad_id,
) -> SampleOutput:
    B, P = prompt_BP.shape
    N = max_new_tokens
    model = nnx.merge(graphdef, state)
    # The donated cache of the previous call is reused: emptying its slot positions is enough.
    cache = dataclasses.replace(cache, positions=jnp.full_like(cache.positions, -1), index=jnp.zeros_like(cache.index))
    pos_BP = model_lib.positions_from_mask(prompt_mask_BP)
    logits_BPV, aux = model(prompt_BP, pos_BP, cache=cache)
    n_prompt_B = jnp.sum(prompt_mask_BP, axis=-1).astype(jnp.int32)
    L, _, _, K = aux.topk.shape

    carry = dict(
        i=jnp.zeros((), jnp.int32),
        cache=aux.cache,
        logits=logits_BPV[:, -1].astype(jnp.float32),
        key=key,
        done=jnp.zeros((B,), bool),
        tokens=jnp.full((B, N), pad_id, jnp.int32),
        logp=jnp.zeros((B, N), jnp.float32),
        mask=jnp.zeros((B, N), bool),
        topk=jnp.zeros((L, B, N, K), jnp.int32),
    )

    def cond(c):
        return (c["i"] < N) & ~jnp.all(c["done"])

    def body(c):
        i = c["i"]
        key, sub = jax.random.split(c["key"])
        tok_B, logp_B = sample_logits(c["logits"], sub, temperature, top_k, top_p, max_top_k)
        live_B = ~c["done"]
        tok_B = jnp.where(live_B, tok_B, pad_id)
        is_eos_B = jnp.any(tok_B[:, None] == eos_ids[None, :], axis=-1) & live_B
        logits_B1V, step_aux = model(tok_B[:, None], (n_prompt_B + i)[:, None], cache=c["cache"])
        col = lambda buf, x: jax.lax.dynamic_update_slice_in_dim(buf, x, i, axis=buf.ndim - 1)  # noqa: E731
        return dict(
            i=i + 1,
            cache=step_aux.cache,
            logits=logits_B1V[:, 0].astype(jnp.float32),
            key=key,
            done=c["done"] | is_eos_B,
            tokens=col(c["tokens"], tok_B[:, None]),
            logp=col(c["logp"], jnp.where(live_B, logp_B, 0.0)[:, None]),
            mask=col(c["mask"], live_B[:, None]),
            topk=jax.lax.dynamic_update_slice_in_dim(c["topk"], step_aux.topk, i, axis=2),
        )

    c = jax.lax.while_loop(cond, body, carry)
    zeros_BP = jnp.zeros((B, P))
    out = SampleOutput(
        tokens=jnp.concatenate([prompt_BP.astype(jnp.int32), c["tokens"]], axis=1),
        prompt_mask=jnp.concatenate([prompt_mask_BP.astype(bool), jnp.zeros((B, N), bool)], axis=1),
        completion_mask=jnp.concatenate([zeros_BP.astype(bool), c["mask"]], axis=1),
        logp=jnp.concatenate([zeros_BP.astype(jnp.float32), c["logp"]], axis=1),
        lengths=jnp.sum(c["mask"], axis=1).astype(jnp.int32),
        truncated=~c["done"],
        topk=jnp.concatenate([aux.topk, c["topk"]], axis=2),
    )
    return out, c["cache"]


class Sampler:
    """Compiled generation for one static shape (batch, prompt bucket, max new tokens).

    `sampler(state, prompts, prompt_mask, key, temperature=, top_k=, top_p=, eos_ids=, pad_id=)`
    -> SampleOutput. The KV cache is allocated once, donated to each call and handed back by it. With
    a mesh, the batch is sharded over its data axes and the parameters by the
    logical rules of `gspo_jax.sharding`.
    """

    def __init__(
        self,
        graphdef,
        model_cfg: model_lib.ModelConfig,
        batch_size: int,
        prompt_len: int,
        max_new_tokens: int,
        *,
        max_top_k: int = 64,
        mesh=None,
        state=None,
    ):
        for name, v in (
            ("batch_size", batch_size),
            ("prompt_len", prompt_len),
            ("max_new_tokens", max_new_tokens),
            ("max_top_k", max_top_k),
        ):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"Sampler.{name}={v!r} is not allowed; it must be an int >= 1")
        self.model_cfg, self.batch_size = model_cfg, batch_size
        self.prompt_len, self.max_new_tokens = prompt_len, max_new_tokens
        self.max_top_k = min(max_top_k, model_cfg.vocab_size)
        self.mesh = mesh
        fn = functools.partial(_generate, graphdef, max_new_tokens, self.max_top_k)
        if mesh is None:
            self._fn = jax.jit(fn, donate_argnums=(1,))
            self._cache_sharding = self._in_shardings = None
        else:
            if state is None:
                raise ValueError("Sampler: pass `state` (or its abstract version) together with `mesh`")
            state_sh = sharding_lib.param_shardings(mesh, state)
            b1, b2 = sharding_lib.batch_sharding(mesh, 1), sharding_lib.batch_sharding(mesh, 2)
            rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            self._cache_sharding = sharding_lib.cache_shardings(mesh, self._new_cache())
            topk_sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, *b2.spec))
            out_sh = SampleOutput(
                tokens=b2, prompt_mask=b2, completion_mask=b2, logp=b2, lengths=b1, truncated=b1, topk=topk_sh
            )
            self._in_shardings = (state_sh, self._cache_sharding, b2, b2, rep, rep, rep, rep, rep, rep)
            self._fn = jax.jit(
                fn, donate_argnums=(1,), in_shardings=self._in_shardings, out_shardings=(out_sh, self._cache_sharding)
            )
        self._cache = None  # allocated on first use, then donated and handed back by every call

    def _new_cache(self):
        return model_lib.init_cache(self.model_cfg, self.batch_size, self.prompt_len + self.max_new_tokens)

    def __call__(
        self,
        state,
        prompts,
        prompt_mask,
        key,
        *,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        eos_ids: Sequence[int] = (),
        pad_id: int = 0,
    ) -> SampleOutput:
        expected = (self.batch_size, self.prompt_len)
        if tuple(np.shape(prompts)) != expected or tuple(np.shape(prompt_mask)) != expected:
            raise ValueError(
                f"Sampler: prompts and prompt_mask must have shape {expected}; got "
                f"{np.shape(prompts)} and {np.shape(prompt_mask)}"
            )
        eos = np.full((MAX_EOS_IDS,), -1, np.int32)
        eos_ids = list(eos_ids)
        if len(eos_ids) > MAX_EOS_IDS:
            raise ValueError(f"Sampler: at most {MAX_EOS_IDS} eos_ids; got {len(eos_ids)}")
        eos[: len(eos_ids)] = eos_ids
        if int(self.max_top_k) < int(top_k):
            raise ValueError(f"Sampler: top_k={top_k} exceeds max_top_k={self.max_top_k} (a static bound)")
        if self._cache is None:
            self._cache = self._new_cache()
            if self._cache_sharding is not None:
                self._cache = jax.device_put(self._cache, self._cache_sharding)
        cache, self._cache = self._cache, None  # donated: unusable after the call
        args = (
            state,
            cache,
            jnp.asarray(prompts, jnp.int32),
            jnp.asarray(prompt_mask, bool),
            key,
            jnp.float32(temperature),
            jnp.int32(top_k),
            jnp.float32(top_p),
            jnp.asarray(eos),
            jnp.int32(pad_id),
        )
        if self._in_shardings is not None:
            # Arrays on a mesh carry it in their type: placing every argument the same way on every
            # call (a fresh key, a restored parameter) is what keeps this at one compile.
            args = jax.device_put(args, self._in_shardings)
        out, self._cache = self._fn(*args)
        return out

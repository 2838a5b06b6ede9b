"""Decoder-only transformer policy (Flax NNX), dense or sparse-MoE feed-forward per layer.

Qwen3-MoE / Mixtral shaped (`model_config.ModelConfig`): RMSNorm, RoPE (HF rotate_half), grouped-query
attention with optional per-head q/k RMSNorm, SwiGLU FFN (those: `gspo_jax/layers.py`) or `moe.MoE`, KV
cache. Each run of consecutive layers of one kind is a `Stack`: parameters stacked on a leading "layers"
axis and run by `lax.scan`, so trace and compile time do not grow with depth (`hf.stacked_to_layers`
gives the per-layer view HF checkpoints use). Used functionally: `graphdef, state =
nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))` once, then the pure `apply(graphdef, state, ...)`,
`logprobs` or `score` under `jax.jit`.

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

from gspo_jax import compiles, moe, router_shift, sharding
from gspo_jax.layers import MLP, Attention, RMSNorm, fan_in, rope_table, write_kv
from gspo_jax.logprobs import sequence_logprobs_from_hidden
from gspo_jax.model_config import DTYPES, REMAT_POLICIES, ModelConfig

# The residual stream's logical axes: sequences split over every data axis (`sharding.DATA_AXES`),
# features whole, between layers and at the LM head.
ACTIVATION = ("batch", None, None)


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


# ---------------------------------------------------------------------------- KV cache bookkeeping


def _cache_slots(cache: KVCache, positions_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(key_pos_BS, index): every slot's position once a chunk at `positions_BT` is written at the
    cache's next slot, and that slot."""
    index = cache.index.astype(jnp.int32)
    key_pos_BS = jax.lax.dynamic_update_slice(cache.positions, positions_BT, (jnp.zeros((), jnp.int32), index))
    return key_pos_BS, index


def _layer_caches(cache: KVCache, key_pos_BS: jax.Array, index: jax.Array, first: int, n: int) -> list:
    """The caches layers first..first+n-1 attend over: (k_BJSW, v_BJSW, key_pos_BS, index) each (`Attention`)."""
    return [(cache.k[i], cache.v[i], key_pos_BS, index) for i in range(first, first + n)]


def _filled_caches(cache: KVCache, kvs: list, first: int, index: jax.Array) -> list:
    """A chunk's keys/values [B, T, J, W] of layers first.. (a prefill's `return_kv`) written into each
    layer's cache at `index`: its new (k_BJSW, v_BJSW)."""
    return [(write_kv(cache.k[i], k, index), write_kv(cache.v[i], v, index)) for i, (k, v) in enumerate(kvs, first)]


def _advanced_cache(kvs: list, key_pos_BS: jax.Array, index: jax.Array, T: int) -> KVCache:
    """The cache after a chunk of T tokens: every layer's new (k, v), the slots' positions, the next slot."""
    return KVCache(k=tuple(k for k, _ in kvs), v=tuple(v for _, v in kvs), positions=key_pos_BS, index=index + T)


# ---------------------------------------------------------------------------- blocks, stacks, transformer


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
                lora=cfg.lora,
            )
        else:
            self.mlp = MLP(cfg.embed_dim, cfg.mlp_dim, param_dtype=pd, rngs=rngs, lora=cfg.lora)

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
            self.lm_head = sharding.param(rngs, fan_in(0, 1), (cfg.embed_dim, cfg.vocab_size), ("embed", "vocab"), pd)

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
        self._check_shapes(tokens_BT, positions_BT, forced_topk)
        positions_BT = positions_BT.astype(jnp.int32)
        x_BTD = sharding.constrain(jnp.take(self.embed_tokens[...], tokens_BT, axis=0).astype(dtype), ACTIVATION)
        key_pos_BS, index = (None, None) if cache is None else _cache_slots(cache, positions_BT)
        rope = rope_table(positions_BT, cfg.head_dim, cfg.rope_theta)
        fill = cache is not None and empty_cache
        new_kvs, stats = [], []  # each layer's new (k, v); per MoE stack, its RouterOutput stacked [n, ...]
        for i_stack, (stack, (first, n)) in enumerate(zip(self.stacks, cfg.layer_runs)):
            kvs = None if cache is None or fill else _layer_caches(cache, key_pos_BS, index, first, n)
            forced = self._forced_routing(forced_topk, i_stack)
            stack_layers = None if layers is None or kvs is None else layers[i_stack]
            x_BTD, kvs, s = stack(
                x_BTD, positions_BT, rope, kvs, forced, return_router_logits, return_kv=fill, layers=stack_layers
            )
            if cache is not None:
                new_kvs += _filled_caches(cache, kvs, first, index) if fill else kvs
            if s is not None:
                stats.append(s)
        x_BTD = sharding.constrain(self.norm(x_BTD), ACTIVATION)
        new_cache = None if cache is None else _advanced_cache(new_kvs, key_pos_BS, index, tokens_BT.shape[1])
        return x_BTD, self._aux(stats, tokens_BT.shape, return_router_logits, new_cache)

    def _check_shapes(self, tokens_BT: jax.Array, positions_BT: jax.Array, forced_topk) -> None:
        """A forward's inputs: tokens and positions [B, T], a replayed routing (ids, or (ids, gates)) [B, L, T, K]."""
        chex.assert_rank(tokens_BT, 2, custom_message="tokens must be [B, T]")
        B, T = tokens_BT.shape
        chex.assert_shape(positions_BT, (B, T), custom_message="positions must be [B, T] like tokens")
        L, K = self.cfg.num_moe_layers, max(self.cfg.top_k, 1)
        for forced_BLTK in jax.tree.leaves(forced_topk):  # ids, or (ids, gates)
            chex.assert_shape(forced_BLTK, (B, L, T, K), custom_message="forced_topk must be [B, L, T, K]")

    def _forced_routing(self, forced_topk, i_stack: int):
        """Stack `i_stack`'s layers of a replayed routing [B, L, T, K] (ids, or (ids, gates)), layers first:
        [n, B, T, K] each; None where nothing is replayed or the stack is dense."""
        cfg, (first, n) = self.cfg, self.cfg.layer_runs[i_stack]
        if forced_topk is None or not cfg.is_moe_layer(first):
            return None
        i = sum(m for f, m in cfg.layer_runs[:i_stack] if cfg.is_moe_layer(f))  # MoE layers of earlier stacks
        return jax.tree.map(lambda a: a[:, i : i + n].transpose(1, 0, 2, 3), forced_topk)

    def _aux(self, stats: list, shape_BT: tuple[int, int], return_router_logits: bool, cache) -> ModelAux:
        """`ModelAux` from each MoE stack's router stats (`moe.RouterOutput` stacked [n, ...]): the routing
        batch-first [B, L, T, K], the losses averaged over MoE layers (empty routing, zero losses: none)."""
        cfg, (B, T) = self.cfg, shape_BT
        K = max(cfg.top_k, 1)
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
        return ModelAux(
            topk=topk_BLTK,
            gates=gates_BLTK,
            router_logits=router_logits,
            lb_loss=lb_loss,
            z_loss=z_loss,
            aux_loss=cfg.lb_loss_coef * lb_loss + cfg.z_loss_coef * z_loss,
            cache=cache,
        )


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


LORA_STREAM = 0x10A  # folded into a seed's key for the adapters' stream


def abstract_model(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, abstract state of ShapeDtypeStructs) without allocating parameters."""
    return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))


def _random_state(cfg: ModelConfig, seed: jax.Array) -> nnx.State:
    key = jax.random.key(seed)
    # With LoRA the adapters draw from a stream of their own: the base is the same as without them.
    streams = {"lora": jax.random.fold_in(key, LORA_STREAM)} if cfg.lora.on else {}
    return nnx.split(Transformer(cfg, rngs=nnx.Rngs(key, **streams)))[1]


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

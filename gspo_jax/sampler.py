"""The JAX sampler: one prefill of left-padded prompts, then a `lax.while_loop` decode over a donated KV cache.

It is where π_old is born: besides the tokens it returns the log-prob of every sampled token and the
router top-k of every position the model processed (and, with `record_gates`, their combine weights),
so the trainer can check its recomputation and replay the sampler's routing (R3; R3W with the weights).

Static (one compile each): batch B, prompt bucket P, max new tokens C, `max_top_k` (Z candidates), the
decode chunk and `record_gates` (`DecodeSettings`). Traced (changing them never recompiles): temperature,
top-k, top-p, the RNG key, the EOS ids, the pad id (`SamplingArgs`). A sampler's options besides its
shape: `SamplerOptions`. Shape letters: `gspo_jax/__init__.py`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gspo_jax import model as model_lib
from gspo_jax import multihost
from gspo_jax import sharding as sharding_lib
from gspo_jax.validation import check, check_int

MAX_EOS_IDS = 4  # EOS ids travel as a fixed-size int32 vector padded with -1
# What the sampler returns, by the names of the batch field table (`sharding.BATCH_FIELDS`); the gates
# only with `record_gates`.
SAMPLE_FIELDS = ("tokens", "prompt_mask", "completion_mask", "sampler_logp", "lengths", "truncated", "topk", "gates")


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=list(SAMPLE_FIELDS),
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class SampleOutput:
    """Everything aligned to the T = P + C positions of each sequence (prompt left-padded to P). Each
    field keeps its name in the rollout and the trainer's batch (dtypes and axes:
    `sharding.BATCH_FIELDS`).

    sampler_logp[b, t] is log π(tokens[b, t] | tokens[b, :t]) at the sampling temperature *without*
    top-k / top-p truncation — the quantity the trainer recomputes (`logprobs.sequence_logprobs`); 0 off
    completions. With temperature 0 (greedy) the log-probs are those at temperature 1.
    """

    tokens: jax.Array  # int32 [B, T]
    prompt_mask: jax.Array  # bool [B, T]: real prompt tokens
    completion_mask: jax.Array  # bool [B, T]: generated tokens up to and including EOS
    sampler_logp: jax.Array  # float32 [B, T]
    lengths: jax.Array  # int32 [B]: completion tokens, EOS included
    truncated: jax.Array  # bool [B]: no EOS within C tokens
    topk: jax.Array  # int32 [B, L, T, K]: router choices where the model ran (0 elsewhere)
    gates: jax.Array | None = None  # float32 [B, L, T, K]: their combine weights (`record_gates` only)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["step", "cache", "logits", "key", "done", "tokens", "logp", "mask", "topk", "gates"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """The `while_loop` carry: step `step` has written new-token column `step` of every buffer."""

    step: jax.Array  # int32 scalar
    cache: model_lib.KVCache
    logits: jax.Array  # float32 [B, V]: the next token's logits
    key: jax.Array
    done: jax.Array  # bool [B]: EOS emitted
    tokens: jax.Array  # int32 [B, C]
    logp: jax.Array  # float32 [B, C]
    mask: jax.Array  # bool [B, C]: live (not yet past EOS) when sampled
    topk: jax.Array  # int32 [B, L, C, K]
    gates: jax.Array | None  # float32 [B, L, C, K] (`record_gates` only)


@dataclasses.dataclass(frozen=True)
class SamplerOptions:
    """A `Sampler`'s options besides its shape (batch, prompt bucket, max new tokens); the defaults are
    a plain one-thread sampler."""

    max_top_k: int = 64  # Z: the candidates top-k / top-p choose from (static; capped at the vocabulary)
    threads: int = 1  # the batch as this many equal slices at once, one host thread each (one device only)
    decode_chunk: int | None = None  # decode steps per host round trip; None: `default_decode_chunk`
    record_gates: bool = False  # the routing's combine weights too (weight replay, R3W)
    compiler_options: Mapping[str, Any] | None = None  # to XLA (the trainer's `compiles.step_options`)


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
    """The decode loop's static settings: one static argument of `_generate`, hashed by value, so
    samplers with equal settings (and graphdef) share one compilation."""

    max_new_tokens: int  # C
    max_top_k: int  # Z
    chunk: int  # decode steps per while-loop iteration; divides C
    record_gates: bool
    # The weights are split over an FSDP axis: each decode step gathers every layer's again, as training
    # does, rather than XLA gathering every layer once before the loop and holding them all (it hoists the
    # gathers of loop-invariant weights: one host's HBM cannot hold a 30B model's gathered layers).
    gather_per_step: bool = False


class SamplingArgs(NamedTuple):
    """The traced sampling settings of one call: changing them never recompiles."""

    temperature: jax.Array  # float32 scalar; <= 0 is greedy
    top_k: jax.Array  # int32 scalar; <= 0: off
    top_p: jax.Array  # float32 scalar; >= 1: off
    eos_ids: jax.Array  # int32 [MAX_EOS_IDS], padded with -1
    pad_id: jax.Array  # int32 scalar


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
        vals_BZ, idx_BZ = jax.lax.top_k(scaled_BV, max_top_k)
        rank_Z = jnp.arange(max_top_k)
        vals_BZ = jnp.where((top_k <= 0) | (rank_Z < top_k), vals_BZ, -jnp.inf)
        probs_BZ = jax.nn.softmax(vals_BZ, axis=-1)
        mass_before_BZ = jnp.cumsum(probs_BZ, axis=-1) - probs_BZ
        vals_BZ = jnp.where(mass_before_BZ < top_p, vals_BZ, -jnp.inf)  # the best token always stays
        choice_B = jax.random.categorical(key, vals_BZ, axis=-1)
        return jnp.take_along_axis(idx_BZ, choice_B[:, None], axis=-1)[:, 0].astype(jnp.int32)

    tok_B = jax.lax.cond((top_k <= 0) & (top_p >= 1.0), full, truncated, None)
    tok_B = jnp.where(greedy, jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), tok_B)
    logp_B = jnp.take_along_axis(jax.nn.log_softmax(scaled_BV, axis=-1), tok_B[:, None], axis=-1)[:, 0]
    return tok_B, logp_B


def default_decode_chunk(max_new_tokens: int, platform: str) -> int:
    """Decode steps per host round trip: 1 on a CPU; on an accelerator the largest of 8, 4, 2 that
    divides `max_new_tokens` (else 1). A while loop's predicate goes to the host every iteration and
    the host launches the next iteration's kernels only then, so a small model's decode step was
    launch-bound (issue 40); a fixed-count inner loop needs no predicate."""
    if platform == "cpu":
        return 1
    return next((u for u in (8, 4, 2) if max_new_tokens % u == 0), 1)


def _generate(
    graphdef,
    settings: DecodeSettings,
    state,
    cache,
    prompt_BP,
    prompt_mask_BP,
    key,
    sampling: SamplingArgs,
) -> tuple[SampleOutput, model_lib.KVCache]:
    """One call: the prompts' prefill, then the decode loop; (graphdef, settings) are static, the cache donated."""
    B, C = prompt_BP.shape[0], settings.max_new_tokens
    chunk, record_gates, pad_id = settings.chunk, settings.record_gates, sampling.pad_id
    model = nnx.merge(graphdef, state)
    # The donated cache of the previous call is reused: emptying its slot positions is enough.
    cache = dataclasses.replace(cache, positions=jnp.full_like(cache.positions, -1), index=jnp.zeros_like(cache.index))
    pos_BP = model_lib.positions_from_mask(prompt_mask_BP)
    logits_BV, prompt_routing, cache = _prefill(model, prompt_BP, pos_BP, cache, record_gates)
    n_prompt_B = jnp.sum(prompt_mask_BP, axis=-1).astype(jnp.int32)
    _, L, _, K = prompt_routing[0].shape
    layers = model.decode_layers()  # sliced from the stacks once per call, outside the loop

    def cond(d: DecodeState):
        return (d.step < C) & ~jnp.all(d.done)

    def body(d: DecodeState) -> DecodeState:
        i = d.step
        # Behind a barrier with the step, the layers are the loop's own: their all-gathers stay in it.
        layers_i = jax.lax.optimization_barrier((layers, i))[0] if settings.gather_per_step else layers
        key, sub = jax.random.split(d.key)
        tok_B, logp_B = sample_logits(
            d.logits, sub, sampling.temperature, sampling.top_k, sampling.top_p, settings.max_top_k
        )
        live_B = ~d.done
        tok_B = jnp.where(live_B, tok_B, pad_id)
        is_eos_B = jnp.any(tok_B[:, None] == sampling.eos_ids[None, :], axis=-1) & live_B
        logits_B1V, step_aux = model(tok_B[:, None], (n_prompt_B + i)[:, None], cache=d.cache, layers=layers_i)
        col = lambda buf_BC, x_B: jax.lax.dynamic_update_slice_in_dim(buf_BC, x_B[:, None], i, axis=1)
        # Zeros (an untouched column) for the steps a chunk runs after every row has stopped.
        put = lambda buf_BLCK, x_BL1K: jax.lax.dynamic_update_slice_in_dim(
            buf_BLCK, jnp.where(jnp.any(live_B), x_BL1K, 0).astype(buf_BLCK.dtype), i, axis=2
        )
        return DecodeState(
            step=i + 1,
            cache=step_aux.cache,
            logits=logits_B1V[:, 0].astype(jnp.float32),
            key=key,
            done=d.done | is_eos_B,
            tokens=col(d.tokens, tok_B),
            logp=col(d.logp, jnp.where(live_B, logp_B, 0.0)),
            mask=col(d.mask, live_B),
            topk=put(d.topk, step_aux.topk),
            gates=None if d.gates is None else put(d.gates, step_aux.gates),
        )

    def steps(d: DecodeState) -> DecodeState:
        # `chunk` divides C, so a chunk that starts below C ends at C at the latest; the steps after
        # every row has stopped write only what an unwritten column holds.
        return body(d) if chunk == 1 else jax.lax.fori_loop(0, chunk, lambda _, d: body(d), d)

    start = _start_state(cache, logits_BV, key, (B, L, C, K), pad_id, record_gates)
    d = jax.lax.while_loop(cond, steps, start)
    return _sample_output(prompt_BP, prompt_mask_BP, prompt_routing, d, record_gates), d.cache


def _start_state(cache, logits_BV, key, shape_BLCK, pad_id, record_gates: bool) -> DecodeState:
    """The decode loop's state before its first step: empty [B, C] and [B, L, C, K] buffers."""
    B, L, C, K = shape_BLCK
    return DecodeState(
        step=jnp.zeros((), jnp.int32),
        cache=cache,
        logits=logits_BV,
        key=key,
        done=jnp.zeros((B,), bool),
        tokens=jnp.full((B, C), pad_id, jnp.int32),
        logp=jnp.zeros((B, C), jnp.float32),
        mask=jnp.zeros((B, C), bool),
        topk=jnp.zeros((B, L, C, K), jnp.int32),
        gates=jnp.zeros((B, L, C, K), jnp.float32) if record_gates else None,
    )


def _sample_output(prompt_BP, prompt_mask_BP, prompt_routing, d: DecodeState, record_gates: bool) -> SampleOutput:
    """Prompts and completions side by side ([B, P + C]), with the prompt's routing before the decode's."""
    B, P = prompt_BP.shape
    C = d.tokens.shape[1]
    zeros_BP = jnp.zeros((B, P))
    return SampleOutput(
        tokens=jnp.concatenate([prompt_BP.astype(jnp.int32), d.tokens], axis=1),
        prompt_mask=jnp.concatenate([prompt_mask_BP.astype(bool), jnp.zeros((B, C), bool)], axis=1),
        completion_mask=jnp.concatenate([zeros_BP.astype(bool), d.mask], axis=1),
        sampler_logp=jnp.concatenate([zeros_BP.astype(jnp.float32), d.logp], axis=1),
        lengths=jnp.sum(d.mask, axis=1).astype(jnp.int32),
        truncated=~d.done,
        topk=jnp.concatenate([prompt_routing[0], d.topk], axis=2),
        gates=jnp.concatenate([prompt_routing[1], d.gates], axis=2) if record_gates else None,
    )


def _prefill(model, prompt_BP, pos_BP, cache: model_lib.KVCache, record_gates: bool = False):
    """The prompts through the model into the cache: (the next token's float32 logits [B, V], the
    prompts' routing: (router top-k [B, L, P, K],) and with `record_gates` their gates too, the cache).
    Only the last position's logits are computed, and
    the batch runs in `ModelConfig.batch_chunks` strided pieces one after another (piece i: rows i,
    i + n, ...; each spread over the batch's devices), written into the cache in place. The cache
    must be empty (every slot's position -1): the prompts attend within themselves, the layers run
    as scans (`Transformer.hidden`'s `empty_cache`)."""
    n = model.cfg.batch_chunks
    if n == 1:
        x_BPD, aux = model.hidden(prompt_BP, pos_BP, cache=cache, empty_cache=True)
        return model.logits(x_BPD[:, -1:])[:, 0], _routing(aux, record_gates), aux.cache
    B = prompt_BP.shape[0]
    view = lambda a: a.reshape(B // n, n, *a.shape[1:])  # piece i is view(a)[:, i]; no copy
    piece = lambda a_bn, i: jax.lax.dynamic_index_in_dim(a_bn, i, axis=1, keepdims=False)
    put = lambda a_bn, x, i: jax.lax.dynamic_update_index_in_dim(a_bn, x, i, axis=1)
    prompt, pos = view(prompt_BP), view(pos_BP)
    # The slots' positions are the same for every piece's write (the prompts at the cache index), so
    # they are set once here, outside the loop. Carried through it (each piece's [b, S] rows put back),
    # older TPU compilers (libtpu 0.0.42, jax 0.10) replaced that carry with the prompt's [b, P]
    # positions and failed a RET_CHECK compiling the flagship's sampler (tests/test_aot.py guards it).
    positions = jax.lax.dynamic_update_slice(cache.positions, pos_BP.astype(jnp.int32), (0, cache.index))
    empty = view(cache.positions)

    def body(i, carry):
        k, v, logits, routing = carry
        part = model_lib.KVCache(
            k=tuple(piece(x, i) for x in k),
            v=tuple(piece(x, i) for x in v),
            positions=piece(empty, i),
            index=cache.index,
        )
        x_bPD, aux = model.hidden(piece(prompt, i), piece(pos, i), cache=part, empty_cache=True)
        c = aux.cache
        return (
            tuple(put(x, y, i) for x, y in zip(k, c.k)),
            tuple(put(x, y, i) for x, y in zip(v, c.v)),
            put(logits, model.logits(x_bPD[:, -1:])[:, 0], i),
            tuple(put(x, y, i) for x, y in zip(routing, _routing(aux, record_gates))),
        )

    L, K = model.cfg.num_moe_layers, max(model.cfg.top_k, 1)
    carry = (
        tuple(map(view, cache.k)),
        tuple(map(view, cache.v)),
        jnp.zeros((B // n, n, model.cfg.vocab_size), jnp.float32),
        tuple(jnp.zeros((B // n, n, L, prompt_BP.shape[1], K), t) for t in _routing_dtypes(record_gates)),
    )
    k, v, logits, routing = jax.lax.fori_loop(0, n, body, carry)
    unview = lambda a: a.reshape(B, *a.shape[2:])
    P = prompt_BP.shape[1]
    k, v = tuple(map(unview, k)), tuple(map(unview, v))
    routing = tuple(map(unview, routing))
    return unview(logits), routing, model_lib.KVCache(k=k, v=v, positions=positions, index=cache.index + P)


def _routing(aux: model_lib.ModelAux, record_gates: bool) -> tuple:
    """What the sampler records of a forward's routing: (top-k,), or (top-k, gates) with `record_gates`."""
    return (aux.topk, aux.gates) if record_gates else (aux.topk,)


def _routing_dtypes(record_gates: bool) -> tuple:
    return (jnp.int32, jnp.float32) if record_gates else (jnp.int32,)


class Sampler:
    """Compiled generation for one static shape (batch, prompt bucket, max new tokens).

    `sampler(state, prompts, prompt_mask, key, temperature=, top_k=, top_p=, eos_ids=, pad_id=)`
    -> SampleOutput. The KV cache is allocated once, donated to each call and handed back by it. With
    a mesh, the batch is sharded over its data axes and the parameters by the
    logical rules of `gspo_jax.sharding`. With `options.threads` > 1 (one device only) the batch is
    generated as that many equal slices at once, one host thread each, by one compiled program: XLA:CPU
    runs a decode step's small ops on one core, so slices use the others. Slice i draws from
    `fold_in(key, i)`: the thread count is part of what a key gives. The rest of the options (top-k's
    candidates, the decode chunk, recording the gates, XLA's compiler options): `SamplerOptions`.
    """

    def __init__(
        self,
        graphdef,
        model_cfg: model_lib.ModelConfig,
        batch_size: int,
        prompt_len: int,
        max_new_tokens: int,
        *,
        mesh=None,
        state=None,
        options: SamplerOptions = SamplerOptions(),
    ):
        threads = options.threads
        for name, v in (
            ("batch_size", batch_size),
            ("prompt_len", prompt_len),
            ("max_new_tokens", max_new_tokens),
            ("max_top_k", options.max_top_k),
            ("threads", threads),
        ):
            check_int("Sampler", name, v, low=1)
        if mesh is not None and state is None:
            raise ValueError("Sampler: pass `state` (or its abstract version) together with `mesh`")
        check(batch_size % threads == 0, "Sampler", "threads", threads, f"a divisor of batch_size={batch_size}")
        devices = 1 if mesh is None else mesh.devices.size
        check(threads == 1 or devices == 1, "Sampler", "threads", threads, f"1 on a mesh of {devices} devices")
        self.options = options
        self.threads, self._rows = threads, batch_size // threads
        self._pool = concurrent.futures.ThreadPoolExecutor(threads) if threads > 1 else None
        self.model_cfg, self.batch_size = model_cfg, batch_size
        self.prompt_len, self.max_new_tokens = prompt_len, max_new_tokens
        self.max_top_k = min(options.max_top_k, model_cfg.vocab_size)
        self.mesh = mesh
        platform = jax.default_backend() if mesh is None else mesh.devices.flat[0].platform
        chunk = default_decode_chunk(max_new_tokens, platform) if options.decode_chunk is None else options.decode_chunk
        check_int("Sampler", "decode_chunk", chunk, low=1)
        check(max_new_tokens % chunk == 0, "Sampler", "decode_chunk", chunk, f"a divisor of {max_new_tokens=}")
        self.decode_chunk = chunk
        self.record_gates = bool(options.record_gates)  # the routing's combine weights too (weight replay, R3W)
        # The `SampleOutput` fields a call fills (the others are None).
        self.fields = SAMPLE_FIELDS if self.record_gates else tuple(f for f in SAMPLE_FIELDS if f != "gates")
        # graphdef and the decode loop's settings are the static arguments of one module-level function,
        # so equal samplers share their compilation.
        fsdp = mesh is not None and mesh.shape.get("fsdp", 1) > 1
        settings = DecodeSettings(max_new_tokens, self.max_top_k, chunk, self.record_gates, gather_per_step=fsdp)
        self._static = (graphdef, settings)
        self._compile(state, options.compiler_options)
        self._caches = [None] * threads  # allocated on first use, then donated and handed back by every call

    def _compile(self, state, compiler_options):
        """The jitted `_generate`: without a mesh as is; with one, placed by its shardings."""
        static, donate = (0, 1), (3,)  # (graphdef, settings) and the cache
        if self.mesh is None:
            self._fn = jax.jit(
                _generate, static_argnums=static, donate_argnums=donate, compiler_options=compiler_options
            )
            self._cache_sharding = self._in_shardings = self._out_shardings = None
            return
        mesh = self.mesh
        state_sh = sharding_lib.param_shardings(mesh, state)
        b2 = sharding_lib.batch_sharding(mesh, 2)  # the prompts and their mask
        rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        self._cache_sharding = sharding_lib.cache_shardings(mesh, jax.eval_shape(self._new_cache))
        out_sh = SampleOutput(**sharding_lib.field_shardings(mesh, self.fields))
        self._in_shardings = (state_sh, self._cache_sharding, b2, b2, rep, SamplingArgs(*[rep] * 5))
        self._out_shardings = out_sh
        self._fn = jax.jit(
            sharding_lib.under_mesh(_generate, mesh),
            static_argnums=static,
            donate_argnums=donate,
            in_shardings=self._in_shardings,
            out_shardings=(out_sh, self._cache_sharding),
            compiler_options=compiler_options,
        )

    def batch_sharding(self, ndim: int):
        """How a [B, ...] array of `ndim` dimensions is split over the mesh (None without one)."""
        return None if self.mesh is None else sharding_lib.batch_sharding(self.mesh, ndim)

    def _new_cache(self):
        return model_lib.init_cache(self.model_cfg, self._rows, self.prompt_len + self.max_new_tokens)

    def lower(self, state):
        """The generation program lowered for abstract `state` (ShapeDtypeStructs with shardings), with
        nothing allocated: what `scripts/aot_compile.py` compiles for a TPU slice without one."""
        check(self.mesh is not None, "Sampler", "mesh", None, "a mesh to lower for")
        B, P = self._rows, self.prompt_len  # a slice's (the batch, with one thread)
        i32, f32 = jnp.int32, jnp.float32
        args = (
            state,
            jax.eval_shape(self._new_cache),
            jax.ShapeDtypeStruct((B, P), i32),
            jax.ShapeDtypeStruct((B, P), bool),
            jax.eval_shape(lambda: jax.random.key(0)),
            SamplingArgs(
                *(jax.ShapeDtypeStruct((), t) for t in (f32, i32, f32)),
                jax.ShapeDtypeStruct((MAX_EOS_IDS,), i32),
                jax.ShapeDtypeStruct((), i32),
            ),
        )
        args = sharding_lib.abstract(args, self._in_shardings)
        return self._fn.lower(*self._static, *args)

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
        chex.assert_shape([prompts, prompt_mask], expected, custom_message="Sampler: prompts and prompt_mask [B, P]")
        eos = np.full((MAX_EOS_IDS,), -1, np.int32)
        eos_ids = list(eos_ids)
        check(len(eos_ids) <= MAX_EOS_IDS, "Sampler", "eos_ids", eos_ids, f"at most {MAX_EOS_IDS} ids")
        eos[: len(eos_ids)] = eos_ids
        check(int(top_k) <= self.max_top_k, "Sampler", "top_k", top_k, f"<= max_top_k={self.max_top_k} (static)")
        shared = SamplingArgs(
            jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p), jnp.asarray(eos), jnp.int32(pad_id)
        )
        prompts, prompt_mask = jnp.asarray(prompts, jnp.int32), jnp.asarray(prompt_mask, bool)
        if self.threads == 1:
            return self._slice(0, state, prompts, prompt_mask, key, shared)
        r = self._rows
        run = lambda i: jax.block_until_ready(
            self._slice(i, state, prompts[i * r : (i + 1) * r], prompt_mask[i * r : (i + 1) * r], key, shared)
        )
        first = [run(0)] if self._caches[0] is None else []  # compiles once, before the threads share it
        outs = first + list(self._pool.map(run, range(len(first), self.threads)))
        out = jax.tree.map(lambda *xs: jnp.concatenate(xs), *outs)
        return out if self._out_shardings is None else jax.device_put(out, self._out_shardings)

    def _slice(self, i: int, state, prompts, prompt_mask, key, shared: SamplingArgs) -> SampleOutput:
        """Generates slice i of the batch (all of it with one thread), with its own donated cache."""
        if self._caches[i] is None:
            self._caches[i] = self._new_cache()
            if self._cache_sharding is not None:
                self._caches[i] = jax.device_put(self._caches[i], self._cache_sharding)
        cache, self._caches[i] = self._caches[i], None  # donated: unusable after the call
        if self.threads > 1:
            key = jax.random.fold_in(key, i)
        args = (state, cache, prompts, prompt_mask, key, shared)
        if self._in_shardings is not None:
            # Arrays on a mesh carry it in their type: placing every argument the same way on every
            # call (a fresh key, a restored parameter) is what keeps this at one compile.
            key = multihost.replicated(key, self.mesh)  # a typed key cannot be device_put across processes
            args = jax.device_put((*args[:4], key, *args[5:]), self._in_shardings)
        out, self._caches[i] = self._fn(*self._static, *args)
        return out

"""The sampler against the full forward: greedy decoding, log-probs, router top-k, EOS, truncation,
top-k / top-p support, compile counts and sharding."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from flax import nnx

from gspo_jax import compiles, model_config, sharding
from gspo_jax import model as model_lib
from gspo_jax.logprobs import sequence_logprobs
from gspo_jax.sampler import Sampler, SamplerOptions, left_pad, sample_logits

B, P, N = 4, 8, 10
Z16 = SamplerOptions(max_top_k=16)  # top-k / top-p choose among 16 candidates


@pytest.fixture(scope="module")
def setup():
    cfg = model_config.get("tiny")
    graphdef, state = nnx.split(model_lib.Transformer(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(4, cfg.vocab_size, n)) for n in (3, 8, 5, 1)]
    tokens, mask = left_pad(prompts, P)
    sampler = Sampler(graphdef, cfg, B, P, N, options=Z16)
    forward = jax.jit(functools.partial(model_lib.apply, graphdef))
    return cfg, graphdef, state, tokens, mask, sampler, forward


def full_forward_logp_topk(forward, state, out, temperature):
    valid = out.prompt_mask | out.completion_mask
    logits, aux = forward(state, out.tokens, model_lib.positions_from_mask(valid))
    return sequence_logprobs(logits, out.tokens, temperature), aux.topk, valid


def test_greedy_equals_stepwise_argmax_of_full_forward(setup):
    cfg, _, state, tokens, mask, sampler, forward = setup
    out = sampler(state, tokens, mask, jax.random.key(0), temperature=0.0)
    seq = np.concatenate([tokens, np.zeros((B, N), np.int32)], 1)
    valid = np.concatenate([mask, np.zeros((B, N), bool)], 1)
    for i in range(N):  # one fixed shape: not-yet-generated slots are padding, after every real token
        logits, _ = forward(state, jnp.asarray(seq), model_lib.positions_from_mask(jnp.asarray(valid)))
        seq[:, P + i] = np.argmax(np.asarray(logits[:, P + i - 1]), -1)
        valid[:, P + i] = True
    np.testing.assert_array_equal(out.tokens, seq)
    assert np.all(np.asarray(out.truncated)) and np.all(np.asarray(out.lengths) == N)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 5, 0.9), (1.3, 0, 0.8)])
def test_logprobs_and_routing_equal_the_trainers_recomputation(setup, temperature, top_k, top_p):
    cfg, _, state, tokens, mask, sampler, forward = setup
    out = sampler(state, tokens, mask, jax.random.key(1), temperature=temperature, top_k=top_k, top_p=top_p)
    logp, topk, valid = full_forward_logp_topk(forward, state, out, temperature)
    cm = np.asarray(out.completion_mask)
    np.testing.assert_allclose(np.asarray(out.sampler_logp)[cm], np.asarray(logp)[cm], atol=1e-5)
    assert np.all(np.asarray(out.sampler_logp)[~cm] == 0)
    v = np.asarray(valid)
    a, b = np.asarray(out.topk).transpose(0, 2, 1, 3)[v], np.asarray(topk).transpose(0, 2, 1, 3)[v]  # [n, L, K]
    mismatch = np.mean(np.any(a != b, axis=-1))
    print(f"router top-k mismatch rate (sampler vs full forward): {mismatch:.4f}")
    assert mismatch <= 0.01  # near-ties may flip in float32; exact in practice
    assert a.shape[1] == cfg.num_moe_layers


def test_eos_stops_a_row_and_the_rest_are_truncated(setup):
    cfg, _, state, tokens, mask, sampler, _ = setup
    ref = np.asarray(sampler(state, tokens, mask, jax.random.key(0), temperature=0.0).tokens)[:, P:]
    eos = int(ref[0, 3])  # row 0 emits this at step j = first occurrence <= 3
    out = sampler(state, tokens, mask, jax.random.key(0), temperature=0.0, eos_ids=(eos, 127), pad_id=0)
    gen, cm = np.asarray(out.tokens)[:, P:], np.asarray(out.completion_mask)[:, P:]
    for b in range(B):
        hits = np.flatnonzero(ref[b] == eos)
        if len(hits):
            j = hits[0]
            assert out.lengths[b] == j + 1 and not out.truncated[b]
            np.testing.assert_array_equal(gen[b, : j + 1], ref[b, : j + 1])
            assert np.all(gen[b, j + 1 :] == 0) and np.all(cm[b, : j + 1]) and not np.any(cm[b, j + 1 :])
            assert np.all(np.asarray(out.sampler_logp)[b, P + j + 1 :] == 0)
        else:
            assert out.lengths[b] == N and out.truncated[b] and np.all(cm[b])
            np.testing.assert_array_equal(gen[b], ref[b])
    assert not np.any(np.asarray(out.completion_mask)[:, :P])


def test_top_k_one_and_tiny_top_p_equal_greedy(setup):
    _, _, state, tokens, mask, sampler, _ = setup
    greedy = np.asarray(sampler(state, tokens, mask, jax.random.key(0), temperature=0.0).tokens)
    k1 = sampler(state, tokens, mask, jax.random.key(5), temperature=1.0, top_k=1)
    p0 = sampler(state, tokens, mask, jax.random.key(6), temperature=1.0, top_p=1e-6)
    np.testing.assert_array_equal(k1.tokens, greedy)
    np.testing.assert_array_equal(p0.tokens, greedy)


def test_no_recompiles_across_prompts_temperatures_seeds_and_eos(setup, compile_counter):
    cfg, _, state, tokens, mask, sampler, _ = setup
    sampler(state, tokens, mask, jax.random.key(0))
    compile_counter.reset()
    rng = np.random.default_rng(1)
    for i, (t, k, p) in enumerate([(0.0, 0, 1.0), (0.5, 3, 0.9), (1.5, 16, 0.5), (1.0, 0, 0.95)]):
        prompts = [list(rng.integers(4, cfg.vocab_size, n)) for n in rng.integers(1, P + 1, B)]
        tok, m = left_pad(prompts, P)
        sampler(state, tok, m, jax.random.key(i), temperature=t, top_k=k, top_p=p, eos_ids=(int(rng.integers(4, 100)),))
    assert compile_counter.count == 0


@pytest.mark.parametrize("chunk", [2, 5])
def test_decode_chunks_change_nothing_even_after_every_row_stopped(setup, chunk):
    # Chunks of decode steps (the accelerator default) give the same tokens, log-probs, masks and
    # routing; an EOS that stops every row mid-chunk leaves the later columns as one-step decoding does.
    cfg, graphdef, state, tokens, mask, sampler, _ = setup
    chunked = Sampler(graphdef, cfg, B, P, N, options=SamplerOptions(max_top_k=16, decode_chunk=chunk))
    ref = np.asarray(sampler(state, tokens, mask, jax.random.key(0), temperature=0.0).tokens)[:, P:]
    for kw in (dict(temperature=1.0), dict(temperature=0.0, eos_ids=tuple(int(t) for t in ref[:, 1]))):
        a = sampler(state, tokens, mask, jax.random.key(2), **kw)
        b = chunked(state, tokens, mask, jax.random.key(2), **kw)
        for f in ("tokens", "sampler_logp", "completion_mask", "lengths", "truncated", "topk"):
            np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)
    assert int(np.max(a.lengths)) == 2  # the second pass stopped every row at step 2 of 10
    with pytest.raises(ValueError, match="decode_chunk"):
        Sampler(graphdef, cfg, B, P, N, options=SamplerOptions(decode_chunk=3))


def test_bad_arguments_raise_early(setup):
    _, _, state, tokens, mask, sampler, _ = setup
    with pytest.raises(AssertionError, match="prompts"):  # chex shape check at the boundary
        sampler(state, tokens[:, 1:], mask[:, 1:], jax.random.key(0))
    with pytest.raises(ValueError, match="max_top_k"):
        sampler(state, tokens, mask, jax.random.key(0), top_k=17)
    with pytest.raises(ValueError, match="prompt"):
        left_pad([[1, 2, 3]], 2)


@pytest.mark.parametrize(
    "axes", [dict(data=2, expert=2, tensor=2), dict(fsdp=2, expert=2, tensor=2)], ids=["dp_ep_tp", "fsdp_ep_tp"]
)
def test_sharded_sampler_equals_unsharded(setup, axes):
    """On a mesh with an FSDP axis every decode step gathers the layers again (`gather_per_step`)."""
    cfg, graphdef, state, tokens, mask, sampler, _ = setup
    mesh = sharding.make_mesh(**axes)
    sharded_state = jax.device_put(state, sharding.param_shardings(mesh, state))
    s2 = Sampler(graphdef, cfg, B, P, N, mesh=mesh, state=state, options=Z16)
    assert s2._static[1].gather_per_step == ("fsdp" in axes)
    for t in (0.0, 1.0):
        a = sampler(state, tokens, mask, jax.random.key(3), temperature=t)
        b = s2(sharded_state, tokens, mask, jax.random.key(3), temperature=t)
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.sampler_logp, b.sampler_logp, atol=1e-5)
        np.testing.assert_array_equal(a.topk, b.topk)
    assert b.tokens.sharding.spec[0] == ("data", "fsdp", "expert")


def test_prefill_in_batch_chunks_changes_nothing(setup):
    """`batch_chunks=2` on a sharded batch: the prefill runs rows (0, 2) then (1, 3) into the cache in
    place; the samples, log-probs, routing and the cache handed back equal the one-piece prefill's."""
    cfg, graphdef, state, tokens, mask, _, _ = setup
    mesh = sharding.make_mesh(data=2, expert=2, tensor=2)
    sharded_state = jax.device_put(state, sharding.param_shardings(mesh, state))
    chunked_cfg = dataclasses.replace(cfg, batch_chunks=2)
    chunked_graphdef, _ = model_lib.abstract_model(chunked_cfg)
    one = Sampler(graphdef, cfg, B, P, N, mesh=mesh, state=state, options=Z16)
    two = Sampler(chunked_graphdef, chunked_cfg, B, P, N, mesh=mesh, state=state, options=Z16)
    for t in (0.0, 1.0):
        a = one(sharded_state, tokens, mask, jax.random.key(5), temperature=t)
        b = two(sharded_state, tokens, mask, jax.random.key(5), temperature=t)
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.sampler_logp, b.sampler_logp, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(a.topk, b.topk)
    chex.assert_trees_all_close(one._caches, two._caches, rtol=1e-6, atol=1e-6)


def test_threads_generate_the_slices_each_with_its_own_stream(setup):
    """threads=2: slice i of the batch is exactly what a one-thread sampler of half the batch draws
    from fold_in(key, i), made by one compiled program that later calls reuse."""
    cfg, graphdef, state, tokens, mask, _, _ = setup
    two = Sampler(graphdef, cfg, B, P, N, options=SamplerOptions(max_top_k=16, threads=2))
    half = Sampler(graphdef, cfg, B // 2, P, N, options=Z16)
    key = jax.random.key(3)
    out = two(state, tokens, mask, key, temperature=1.0, eos_ids=(5,))
    counter = compiles.CompileCounter()
    again = two(state, tokens, mask, key, temperature=1.0, eos_ids=(5,))
    assert counter.count == 0
    chex.assert_trees_all_equal(again, out)
    for i, rows in enumerate((slice(0, B // 2), slice(B // 2, B))):
        ref = half(state, tokens[rows], mask[rows], jax.random.fold_in(key, i), temperature=1.0, eos_ids=(5,))
        chex.assert_trees_all_equal(jax.tree.map(lambda x, r=rows: x[r], out), ref)
    whole = Sampler(graphdef, cfg, B, P, N, options=Z16)(state, tokens, mask, key, temperature=1.0, eos_ids=(5,))
    assert not np.array_equal(whole.tokens, out.tokens)  # the streams differ from one thread's


def test_threads_must_split_the_batch_on_one_device(setup):
    cfg, graphdef, state, *_ = setup
    with pytest.raises(ValueError, match=r"Sampler.threads=3 .*a divisor of batch_size=4"):
        Sampler(graphdef, cfg, B, P, N, options=SamplerOptions(threads=3))
    mesh = sharding.make_mesh(data=2, fsdp=1, expert=1, tensor=1, devices=jax.devices()[:2])  # conftest: 8
    with pytest.raises(ValueError, match=r"Sampler.threads=2 .*1 on a mesh of 2 devices"):
        Sampler(graphdef, cfg, B, P, N, mesh=mesh, state=state, options=SamplerOptions(threads=2))


# ------------------------------------------------------------------ the sampling distribution


LOGITS = jnp.asarray([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def draw(variant, n, **kw):
    fn = variant(functools.partial(sample_logits, max_top_k=8))
    tok, logp = fn(jnp.broadcast_to(LOGITS, (n, 8)), jax.random.key(11), **kw)
    return np.bincount(np.asarray(tok), minlength=8) / n, np.asarray(tok), np.asarray(logp)


class TestSampleLogits(chex.TestCase):
    """Runs with `sample_logits` as is and under `jax.jit` (chex variants)."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(
        (f"t{temperature}_k{top_k}_p{top_p}", temperature, top_k, top_p)
        for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.5, 0, 1.0), (2.0, 3, 1.0), (1.0, 0, 0.7), (1.0, 4, 0.8)]
    )
    def test_sampling_distribution_and_support(self, temperature, top_k, top_p):
        n = 40000
        freq, tok, logp = draw(
            self.variant, n, temperature=jnp.float32(temperature), top_k=jnp.int32(top_k), top_p=jnp.float32(top_p)
        )
        probs = np.asarray(jax.nn.softmax(LOGITS / temperature))
        keep = np.ones(8, bool)
        if top_k > 0:
            keep[top_k:] = False
        p = np.where(keep, probs, 0) / np.where(keep, probs, 0).sum()
        before = np.cumsum(p) - p
        keep &= before < top_p
        expected = np.where(keep, p, 0) / np.where(keep, p, 0).sum()
        assert np.all(freq[~keep] == 0)  # the support is exactly right
        np.testing.assert_allclose(freq, expected, atol=4 * np.sqrt(0.25 / n))
        # returned log-probs are the untruncated ones at the sampling temperature
        np.testing.assert_allclose(logp, np.log(probs[tok]), rtol=1e-5)


def test_output_does_not_depend_on_the_previous_call(setup):
    """The donated cache is reused; stale slots must never leak into any position's output."""
    cfg, _, state, tokens, mask, sampler, _ = setup
    a = sampler(state, tokens, mask, jax.random.key(4), temperature=1.0)
    other = np.asarray(np.random.default_rng(9).integers(4, cfg.vocab_size, tokens.shape), np.int32)
    sampler(state, other, np.ones_like(mask), jax.random.key(8), temperature=1.0)
    b = sampler(state, tokens, mask, jax.random.key(4), temperature=1.0)
    chex.assert_trees_all_equal(a, b)


def test_on_an_fsdp_tpu_mesh_the_decode_loop_holds_one_layers_gathered_weights_not_every_layers():
    """Compiled for a v5p:2x2x1 slice (no TPU attached) with the weights split over fsdp=4: two more
    layers add their KV caches and their slices of the shards to the sampler's temporaries, less than
    one layer's gathered experts; XLA would gather every layer once before the loop and keep them all
    (`DecodeSettings.gather_per_step`)."""
    from gspo_jax import aot

    devices = aot.topology_devices("v5p:2x2x1")
    mesh = sharding.make_mesh(fsdp=4, devices=devices)

    def temp_bytes(layers: int) -> tuple[int, int]:
        cfg = dataclasses.replace(
            model_config.get("tiny"), num_layers=layers, dense_layers=(), embed_dim=256, num_experts=16
        )
        cfg = dataclasses.replace(cfg, moe_mlp_dim=512, param_dtype="bfloat16", dtype="bfloat16")
        graphdef, abstract = model_lib.abstract_model(cfg)
        params = sharding.abstract(abstract, sharding.param_shardings(mesh, abstract))
        sampler = Sampler(graphdef, cfg, 8, 8, 8, mesh=mesh, state=params)
        experts = 3 * cfg.num_experts * cfg.embed_dim * cfg.moe_mlp_dim * 2  # one layer's, gathered, bf16
        with jax.default_matmul_precision("default"):  # as scripts/aot_compile.py compiles (conftest: highest)
            return sampler.lower(params).compile().memory_analysis().temp_size_in_bytes, experts

    (two, layer), (four, _) = temp_bytes(2), temp_bytes(4)
    # Measured: 7.9 MB (the layers' slices of their shards, their caches), hoisted 24 MB (and more).
    assert four - two < layer, (four - two, layer)

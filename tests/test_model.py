"""Tests for the NNX decoder (model.py), the MoE layer (moe.py), its dispatch paths (dispatch.py) and
expert parallelism (expert_parallel.py)."""

import dataclasses
import functools
import re
from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from flax import nnx

from gspo_jax import compiles, expert_parallel, layers, logprobs, model_config, moe, sharding
from gspo_jax import dispatch as dispatch_lib
from gspo_jax import model as model_lib

B, T = 2, 8


def build(cfg, seed=0):
    return nnx.split(model_lib.Transformer(cfg, rngs=nnx.Rngs(seed)))


@functools.cache
def tiny_model():
    """The tiny config, built once: (cfg, graphdef, state). Shared by the chex test classes and the fixture."""
    cfg = model_config.get("tiny")
    graphdef, state = build(cfg)
    return cfg, graphdef, state


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


def random_tokens(seed, shape=(B, T), vocab=128):
    return jax.random.randint(jax.random.key(seed), shape, 0, vocab, dtype=jnp.int32)


def arange_positions(b=B, t=T):
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


@functools.cache
def _fwd(graphdef, kw_items):
    return functools.partial(model_lib.apply, graphdef, **dict(kw_items))


def fwd(graphdef, **kw):
    """`apply` with graphdef bound; the same object for the same arguments, so jit caches are shared."""
    return _fwd(graphdef, tuple(sorted(kw.items())))


def router_params(state):
    """The router weights of every MoE layer, as a list (each stack holds its layers' stacked)."""
    stacks = [stack["layer"]["mlp"] for _, stack in sorted(state["stacks"].items())]
    return [w for mlp in stacks if "router" in mlp for w in mlp["router"][...]]


def set_routers(state, value_fn):
    """A copy of `state` with each router weight replaced by value_fn(old)."""
    state = jax.tree.map(lambda x: x, state)
    for stack in state["stacks"].values():
        mlp = stack["layer"]["mlp"]
        if "router" in mlp:
            mlp["router"] = mlp["router"].replace(value_fn(mlp["router"][...]))
    return state


# ------------------------------------------------------------------ config


def test_config_layer_rule():
    cfg = model_config.ModelConfig(num_layers=6, num_experts=4, top_k=2, moe_every=2, dense_layers=(3,))
    assert cfg.moe_layer_ids == (1, 5)
    assert cfg.num_moe_layers == 2
    assert model_config.ModelConfig(num_layers=3, num_experts=0).moe_layer_ids == ()
    assert model_config.get("tiny").moe_layer_ids == (1, 2)
    assert model_config.get("qwen3_30b_a3b").num_moe_layers == 48


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(num_heads=6, num_kv_heads=4), "num_heads"),
        (dict(num_experts=4, top_k=5), "top_k"),
        (dict(num_experts=4, top_k=0), "top_k"),
        (dict(dispatch="megablocks"), "dispatch"),
        (dict(dtype="float8"), "dtype"),
        (dict(param_dtype="int8"), "param_dtype"),
        (dict(embed_dim=0), "embed_dim"),
        (dict(vocab_size=-3), "vocab_size"),
        (dict(num_layers=0), "num_layers"),
        (dict(head_dim=7), "head_dim"),
        (dict(moe_every=0), "moe_every"),
        (dict(num_layers=2, dense_layers=(2,)), "dense_layers"),
        (dict(num_layers=2, dense_layers=(-1,)), "dense_layers"),
        (dict(num_experts=-1), "num_experts"),
        (dict(num_experts=4, moe_mlp_dim=0), "moe_mlp_dim"),
        (dict(num_experts=0, mlp_dim=0), "mlp_dim"),
        (dict(rms_eps=0.0), "rms_eps"),
        (dict(rope_theta=-1.0), "rope_theta"),
        (dict(lb_loss_coef=-0.1), "lb_loss_coef"),
    ],
)
def test_bad_config_raises(overrides, field):
    with pytest.raises(ValueError, match=field):
        model_config.ModelConfig(**overrides)


def test_all_moe_config_needs_no_dense_width():
    cfg = model_config.ModelConfig(num_experts=4, top_k=2, mlp_dim=0)
    assert cfg.num_moe_layers == cfg.num_layers


def test_qwen3_30b_a3b_param_count():
    cfg = model_config.get("qwen3_30b_a3b")
    total, active = model_lib.count_params(cfg)
    assert total == 30_532_122_624  # what Hugging Face reports for Qwen3-30B-A3B
    # Everything but the experts, plus top_k/num_experts of them.
    per_layer_dense = 2048 * (32 + 4 + 4) * 128 + 32 * 128 * 2048 + 2 * 128 + 2 * 2048 + 2048 * 128
    expert = 3 * 2048 * 768
    assert active == 48 * (per_layer_dense + 8 * expert) + 2 * 151936 * 2048 + 2048
    assert abs(total / 30.53e9 - 1) < 0.02
    assert abs(active / 3.34e9 - 1) < 0.02


# ------------------------------------------------------------------ forward basics


class TestForward(chex.TestCase):
    """The whole model under `jax.jit` (chex's variant), as every program runs it, here and in the classes
    below: eagerly it re-ran the same program op by op (~90 s of CI's two cores for nothing the jitted
    run misses). The small pieces (TestMoEPieces) still run both ways."""

    @chex.variants(with_jit=True)
    @parameterized.named_parameters(("float32", "float32"), ("bfloat16", "bfloat16"))
    def test_shapes_and_dtypes(self, dtype):
        cfg = model_config.get("tiny", param_dtype=dtype, dtype=dtype)
        graphdef, state = build(cfg)
        assert all(x.dtype == jnp.dtype(dtype) for x in jax.tree.leaves(state))
        fn = self.variant(fwd(graphdef, return_router_logits=True))
        logits, aux = fn(state, random_tokens(0), arange_positions())
        assert logits.shape == (B, T, cfg.vocab_size) and logits.dtype == jnp.float32
        assert aux.topk.shape == (B, 2, T, cfg.top_k) and aux.topk.dtype == jnp.int32  # batch-first
        assert aux.router_logits.shape == (B, 2, T, cfg.num_experts) and aux.router_logits.dtype == jnp.float32
        assert aux.lb_loss.shape == () and aux.z_loss.shape == () and aux.cache is None
        np.testing.assert_allclose(
            aux.aux_loss, cfg.lb_loss_coef * aux.lb_loss + cfg.z_loss_coef * aux.z_loss, rtol=1e-6
        )
        assert np.isfinite(np.asarray(logits)).all()
        assert ((aux.topk >= 0) & (aux.topk < cfg.num_experts)).all()
        # Top-k indices are distinct per token.
        assert (aux.topk[..., 0] != aux.topk[..., 1]).all()

        logits, aux = fn(state, random_tokens(0), arange_positions())
        assert aux.router_logits is not None
        _, aux = self.variant(fwd(graphdef))(state, random_tokens(0), arange_positions())
        assert aux.router_logits is None

    @chex.variants(with_jit=True)
    def test_dense_model_has_empty_topk(self):
        cfg = model_config.ModelConfig(num_layers=2, num_experts=0, top_k=3)
        graphdef, state = build(cfg)
        logits, aux = self.variant(fwd(graphdef, return_router_logits=True))(
            state, random_tokens(1), arange_positions()
        )
        assert logits.shape == (B, T, cfg.vocab_size)
        assert aux.topk.shape == (B, 0, T, 3) and aux.topk.dtype == jnp.int32
        assert aux.router_logits.shape == (B, 0, T, 0)
        assert float(aux.lb_loss) == 0.0 and float(aux.z_loss) == 0.0

    @chex.variants(with_jit=True)
    def test_tied_embeddings(self):
        cfg = model_config.get("tiny", tie_embeddings=True)
        graphdef, state = build(cfg)
        assert "lm_head" not in state
        logits, _ = self.variant(fwd(graphdef))(state, random_tokens(2), arange_positions())
        assert logits.shape == (B, T, cfg.vocab_size) and np.isfinite(np.asarray(logits)).all()

    @chex.variants(with_jit=True)
    def test_causality(self):
        cfg, graphdef, state = tiny_model()
        fn = self.variant(fwd(graphdef))
        tokens = random_tokens(3)
        base, aux0 = fn(state, tokens, arange_positions())
        for t in (3, T - 1):
            changed = tokens.at[:, t].set((tokens[:, t] + 1) % cfg.vocab_size)
            logits, aux = fn(state, changed, arange_positions())
            np.testing.assert_allclose(logits[:, :t], base[:, :t], atol=1e-6, rtol=0)
            np.testing.assert_array_equal(aux.topk[:, :, :t], aux0.topk[:, :, :t])
            assert np.abs(np.asarray(logits[:, t:] - base[:, t:])).max() > 1e-4

    @chex.variants(with_jit=True)
    def test_left_padding_matches_unpadded(self):
        _, graphdef, state = tiny_model()
        fn = self.variant(fwd(graphdef))
        n, pad = 5, T - 5
        real = random_tokens(4, (1, n))
        # Row 0: the n real tokens then more tokens (causality keeps its first n logits those of
        # the unpadded sequence); row 1: the same n tokens left-padded by `pad` pad tokens.
        tail = random_tokens(5, (1, pad))
        for pad_token in (0, 77):
            row1 = jnp.concatenate([jnp.full((1, pad), pad_token, jnp.int32), real], axis=1)
            tokens = jnp.concatenate([jnp.concatenate([real, tail], axis=1), row1])
            positions = model_lib.positions_from_mask(jnp.stack([jnp.ones(T, bool), jnp.arange(T) >= pad]))
            np.testing.assert_array_equal(positions[1], [-1, -1, -1, 0, 1, 2, 3, 4])
            logits, aux = fn(state, tokens, positions)
            assert np.isfinite(np.asarray(logits)).all()
            np.testing.assert_allclose(logits[1, pad:], logits[0, :n], atol=1e-5, rtol=1e-5)
            np.testing.assert_array_equal(aux.topk[1, :, pad:], aux.topk[0, :, :n])

    @chex.variants(with_jit=True)
    def test_fully_padded_row_is_finite(self):
        _, graphdef, state = tiny_model()
        positions = jnp.stack([jnp.full((T,), -1, jnp.int32), jnp.arange(T, dtype=jnp.int32)])
        logits, aux = self.variant(fwd(graphdef))(state, random_tokens(5), positions)
        assert np.isfinite(np.asarray(logits)).all()
        assert np.isfinite(float(aux.lb_loss)) and np.isfinite(float(aux.z_loss))

    @chex.variants(with_jit=True)
    @parameterized.named_parameters(*((d, d) for d in ("dense", "ragged", "sparse", "grouped")))
    def test_dropless_token_independent_of_other_rows(self, dispatch):
        cfg, _, state = tiny_model()
        graphdef, _ = build(dataclasses.replace(cfg, dispatch=dispatch))
        fn = self.variant(fwd(graphdef))
        tokens = random_tokens(6)
        base, aux0 = fn(state, tokens, arange_positions())
        other = tokens.at[1].set(random_tokens(7, (T,)))
        logits, aux = fn(state, other, arange_positions())
        np.testing.assert_allclose(logits[0], base[0], atol=1e-6, rtol=0)
        np.testing.assert_array_equal(aux.topk[0], aux0.topk[0])
        # The other row's padding also changes nothing.
        logits, _ = fn(state, tokens, arange_positions().at[1, :4].set(-1))
        np.testing.assert_allclose(logits[0], base[0], atol=1e-6, rtol=0)

    @chex.variants(with_jit=True)
    @parameterized.named_parameters(("ragged", "ragged"), ("sparse", "sparse"), ("grouped", "grouped"))
    def test_dispatch_paths_agree_with_dense(self, dispatch):
        cfg, _, state = tiny_model()
        graphdef_dense, _ = build(dataclasses.replace(cfg, dispatch="dense"))
        graphdef_other, _ = build(dataclasses.replace(cfg, dispatch=dispatch))
        tokens, positions = random_tokens(8), arange_positions().at[0, :2].set(-1)
        w = jax.random.normal(jax.random.key(9), (B, T, cfg.vocab_size))

        def loss(state, graphdef):
            logits, aux = model_lib.apply(graphdef, state, tokens, positions)
            return jnp.sum(logits * w) / logits.size + aux.aux_loss, (logits, aux)

        outs = {}
        for name, graphdef in (("dense", graphdef_dense), (dispatch, graphdef_other)):
            fn = self.variant(jax.value_and_grad(functools.partial(loss, graphdef=graphdef), has_aux=True))
            outs[name] = fn(state)
        (l_d, (logits_d, aux_d)), g_d = outs["dense"]
        (l_r, (logits_r, aux_r)), g_r = outs[dispatch]
        np.testing.assert_allclose(logits_d, logits_r, atol=1e-5, rtol=1e-5)
        np.testing.assert_array_equal(aux_d.topk, aux_r.topk)
        np.testing.assert_allclose(l_d, l_r, atol=1e-6, rtol=1e-6)
        chex.assert_trees_all_close(g_d, g_r, atol=1e-5, rtol=1e-5)
        assert max(float(jnp.abs(x).max()) for x in router_params(g_d)) > 0

    @chex.variants(with_jit=True)
    @parameterized.named_parameters(("ragged", "ragged"), ("sparse", "sparse"))
    def test_bfloat16_dispatch_paths_close(self, dispatch):
        cfg = model_config.get("tiny", param_dtype="bfloat16", dtype="bfloat16", dispatch="dense")
        graphdef_d, state = build(cfg)
        graphdef_r, _ = build(dataclasses.replace(cfg, dispatch=dispatch))
        tokens = random_tokens(10)
        logits_d, _ = self.variant(fwd(graphdef_d))(state, tokens, arange_positions())
        logits_r, _ = self.variant(fwd(graphdef_r))(state, tokens, arange_positions())
        np.testing.assert_allclose(logits_d, logits_r, atol=0.1, rtol=0.05)


def test_chunked_logprobs_equal_the_full_forward():
    """`model.logprobs` with the head in chunks of 3 positions = `sequence_logprobs` of `apply`'s logits,
    for values, router top-k and the gradient of every parameter. Tied embeddings: the head's gradient
    and the embedding lookup's meet in one parameter (the untied head: tests/test_logprobs.py)."""
    cfg = dataclasses.replace(model_config.get("tiny"), tie_embeddings=True, dispatch="dense")
    graphdef, state = model_lib.init(cfg, 0)
    g_chunked, _ = model_lib.abstract_model(dataclasses.replace(cfg, logprob_chunk=3))
    tokens, positions = random_tokens(1), arange_positions()
    w = jax.random.normal(jax.random.key(2), (B, T))

    def full(state):
        logits, aux = model_lib.apply(graphdef, state, tokens, positions)
        return logprobs.sequence_logprobs(logits, tokens, 0.7), aux.topk

    def by_chunks(state):
        logp, aux = model_lib.logprobs(g_chunked, state, tokens, positions, temperature=0.7)
        return logp, aux.topk

    (want, topk_want), (got, topk_got) = jax.jit(full)(state), jax.jit(by_chunks)(state)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(topk_got, topk_want)
    grad = lambda f: jax.jit(jax.grad(lambda s: jnp.sum(f(s)[0] * w)))(state)
    chex.assert_trees_all_close(grad(by_chunks), grad(full), rtol=1e-5, atol=1e-6)


def test_scoring_in_batch_chunks_equals_the_whole_batch():
    """`score` with a batch of 32 sharded over 8 devices, in 4 strided chunks of 8: the same log-probs and
    routing as at once, with and without a replayed routing; each chunk is split over all 8 devices
    (XLA counts the loop body once: a quarter of the whole batch's FLOPs, not 8 × that), and the
    result is sharded like the batch."""
    cfg = dataclasses.replace(model_config.get("tiny"), dispatch="dense")
    graphdef, state = model_lib.init(cfg, 0)
    g_chunked, _ = model_lib.abstract_model(dataclasses.replace(cfg, batch_chunks=4))
    mesh = sharding.make_mesh(data=8)
    b2 = sharding.batch_sharding(mesh, 2)
    tokens, positions = jax.device_put((random_tokens(3, (32, T)), arange_positions(32)), b2)
    forced = jax.random.randint(jax.random.key(4), (32, cfg.num_moe_layers, T, cfg.top_k), 0, cfg.num_experts)
    score = jax.jit(model_lib.score, static_argnums=(0, 1))
    for replay in (None, forced):
        want = score(graphdef, 0.9, state, tokens, positions, replay)
        got = score(g_chunked, 0.9, state, tokens, positions, replay)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(got[1], want[1])
        assert got[0].sharding.is_equivalent_to(b2, 2)
    flops = lambda g: score.lower(g, 0.9, state, tokens, positions, None).compile().cost_analysis()["flops"]
    assert flops(g_chunked) < 0.3 * flops(graphdef)


def test_in_batch_chunks_by_hand():
    """Piece i of the batch is rows i, i + chunks, ...; results come back in the batch's order."""
    seen = []

    def fn(x, y):
        seen.append(x.shape)
        return x * 10, (y, None)

    x = jnp.arange(6)
    out, (y, none) = model_lib.in_batch_chunks(fn, 3, x, x + 100)
    np.testing.assert_array_equal(out, x * 10)
    np.testing.assert_array_equal(y, x + 100)
    assert none is None and seen == [(2,)]  # traced once, for a piece of 2 rows
    first = model_lib.in_batch_chunks(lambda x: jnp.full_like(x, x[0]), 3, x)  # each row: its piece's first
    np.testing.assert_array_equal(first, [0, 1, 2, 0, 1, 2])


def test_layer_runs_by_hand():
    """Consecutive layers of one kind form one stack."""
    assert model_config.get("tiny").layer_runs == ((0, 1), (1, 2))  # dense, then 2 MoE
    assert model_config.get("qwen3_30b_a3b").layer_runs == ((0, 48),)
    cfg = model_config.ModelConfig(num_layers=6, num_experts=4, top_k=2, moe_every=2, dense_layers=(3,))
    assert cfg.layer_runs == ((0, 1), (1, 1), (2, 3), (5, 1))  # MoE layers 1 and 5
    assert model_config.ModelConfig(num_layers=3, num_experts=0).layer_runs == ((0, 3),)


class TestLayerStacks(chex.TestCase):
    """The stacked layers scanned, unrolled and rematerialised compute one function."""

    # Jitted only: remat and scan are program transformations, and the eager variant (94 s on CI's two
    # cores, the suite's second slowest test) re-ran JAX's own op-by-op path of the same program.
    @chex.variants(with_jit=True)
    def test_scanned_unrolled_and_remat_agree(self):
        cfg, _, state = tiny_model()
        tokens, positions = random_tokens(5), arange_positions()
        forced = jax.random.randint(jax.random.key(1), (B, cfg.num_moe_layers, T, 2), 0, 4) * 2 + jnp.array([0, 1])

        def loss(graphdef, state, forced):
            logits, aux = model_lib.apply(graphdef, state, tokens, positions, forced_topk=forced)
            return jnp.mean(jax.nn.log_softmax(logits)[..., 3]) + aux.aux_loss, (logits, aux.topk, aux.lb_loss)

        def run(cfg, forced=None):
            g, _ = build(cfg)
            fn = self.variant(jax.value_and_grad(functools.partial(loss, g), has_aux=True))
            return fn(state, forced)

        variants = (dict(scan_layers=False), dict(remat="full"), dict(remat="save_dots"))
        for replay in (None, forced):
            (want, want_aux), want_grad = run(cfg, replay)
            for overrides in variants if replay is None else variants[:2]:  # save_dots: remat's policy only
                (got, got_aux), got_grad = run(dataclasses.replace(cfg, **overrides), replay)
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
                np.testing.assert_array_equal(got_aux[1], want_aux[1])
                np.testing.assert_allclose(got_aux[0], want_aux[0], rtol=1e-5, atol=1e-6)
                for a, b in zip(jax.tree.leaves(got_grad), jax.tree.leaves(want_grad)):
                    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
        assert replay is not None and (want_aux[1] == forced).all()  # replay reached every stacked layer

    def test_each_stacked_layer_is_its_own_layer(self):
        """Zeroing one layer's slice of a stack changes the output only through that layer."""
        cfg, graphdef, state = tiny_model()
        tokens, positions = random_tokens(6), arange_positions()
        _, aux = model_lib.apply(graphdef, state, tokens, positions)
        mlp = state["stacks"][1]["layer"]["mlp"]
        for j in range(2):  # the MoE stack holds layers 1 and 2; its router of layer 1 + j forced to zero
            s = jax.tree.map(lambda x: x, state)
            s["stacks"][1]["layer"]["mlp"]["router"] = mlp["router"].replace(mlp["router"][...].at[j].set(0.0))
            _, aux_j = model_lib.apply(graphdef, s, tokens, positions)
            # A zero router picks experts 0 and 1 (ties go to the lower index) in that layer only.
            assert (aux_j.topk[:, j] == jnp.array([0, 1])).all()
            assert not (aux.topk[:, j] == jnp.array([0, 1])).all()
            if j == 1:  # the layer before is untouched
                np.testing.assert_array_equal(aux_j.topk[:, 0], aux.topk[:, 0])


def test_compiled_program_size_is_flat_in_depth():
    """Scanned, a 2-layer and an 8-layer model lower to programs of about one size; unrolled, not."""

    def hlo_size(**overrides):
        cfg = model_config.ModelConfig(num_experts=4, top_k=2, **overrides)
        graphdef, state = model_lib.abstract_model(cfg)
        tokens, positions = jnp.zeros((B, T), jnp.int32), arange_positions()
        grad = jax.grad(lambda s: model_lib.apply(graphdef, s, tokens, positions)[0].sum())
        return len(jax.jit(grad).lower(state).as_text())

    scanned = hlo_size(num_layers=8) / hlo_size(num_layers=2)
    unrolled = hlo_size(num_layers=8, scan_layers=False) / hlo_size(num_layers=2, scan_layers=False)
    assert scanned < 1.1 and unrolled > 1.5, (scanned, unrolled)  # unrolled: 1.67 here


def test_init_is_one_program_and_seeded(compile_counter):
    cfg = model_config.get("tiny", num_layers=4)
    graphdef, state = model_lib.init(cfg, seed=3)
    assert compile_counter.count == 1
    _, abstract = model_lib.abstract_model(cfg)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == jax.tree.map(lambda x: (x.shape, x.dtype), abstract)
    again, other = model_lib.init(cfg, seed=3)[1], model_lib.init(cfg, seed=4)[1]
    assert compile_counter.count == 1  # the same program for every seed
    for a, b, c in zip(jax.tree.leaves(state), jax.tree.leaves(again), jax.tree.leaves(other)):
        np.testing.assert_array_equal(a, b)
        assert np.all(a == 1) or not np.array_equal(a, c)  # norm scales are ones for every seed
    w = state["stacks"][1]["layer"]["self_attn"]["q_proj"][...]  # layers of a stack are drawn independently
    assert not np.allclose(w[0], w[1])


def test_init_at_fast_compile_options_draws_the_same_bits(fully_optimised):
    # model.init compiles at compiles.run_once_options() (LLVM -O1 on CPU, and the older loop emitters where
    # XLA still has them), or at the test suite's -O0 where that is on: the draw must not change.
    cfg = model_config.get("tiny", num_layers=2)
    lowered = jax.jit(model_lib._random_state, static_argnums=0).lower(cfg, np.int32(0))
    default = lowered.compile()(np.int32(5))
    fast = lowered.compile(compiler_options=compiles.run_once_options())(np.int32(5))
    used = model_lib.init(cfg, seed=5)[1]  # with the options model.init passes
    jax.config.update("jax_disable_most_optimizations", True)  # the fixture restores it
    suite = lowered.compile()(np.int32(5))
    leaves = [jax.tree.leaves(t) for t in (default, fast, used, suite)]
    for a, *others in zip(*leaves, strict=True):
        for b in others:
            np.testing.assert_array_equal(a, b)


def _loop_fusions_that_transpose_and_compute(hlo: str) -> list[str]:
    names = []
    for m in re.finditer(r"^\s+%(\S+) = \S+ fusion\(.*?\), kind=kLoop, calls=(%[\w.\-]+)", hlo, re.M):
        body = re.search(r"^" + re.escape(m.group(2)) + r" \(.*?\n\}", hlo, re.M | re.S).group(0)
        if " transpose(" in body and re.search(r" (multiply|add|subtract)\(", body):
            names.append(m.group(1))
    return names


def test_row_major_cotangent_is_the_identity_and_unfuses_the_weight_gradients_transpose():
    # A projection followed by a norm, as q and k are: without the helper XLA:CPU computes the norm's
    # backward inside the transposed copy the weight gradient's matmul reads (a strided loop).
    def loss(w, x, c, helper):
        y = jnp.einsum("btd,dhw->bthw", x, w)
        y = layers.row_major_cotangent(y) if helper else y
        return jnp.sum(jnp.sin(y * jax.lax.rsqrt(jnp.mean(y * y, -1, keepdims=True) + 1e-6)) * c)

    k = jax.random.split(jax.random.key(0), 3)
    w, x, c = (jax.random.normal(kk, s) for kk, s in zip(k, [(64, 4, 16), (4, 36, 64), (4, 36, 4, 16)]))
    grad = jax.jit(jax.value_and_grad(loss), static_argnums=3)
    (v0, g0), (v1, g1) = grad(w, x, c, False), grad(w, x, c, True)
    assert v0 == v1
    np.testing.assert_array_equal(g0, g1)
    assert jax.default_backend() == "cpu"  # the suite's backend; elsewhere the helper is the identity only
    assert _loop_fusions_that_transpose_and_compute(grad.lower(w, x, c, False).compile().as_text())
    assert not _loop_fusions_that_transpose_and_compute(grad.lower(w, x, c, True).compile().as_text())


class TestSparseDispatch(chex.TestCase):
    """The block-sorted sparse path against the all-experts dense one, and its layout by hand."""

    def test_block_layout_by_hand(self):
        # 3 tokens, top-2 over 3 experts, blocks of 2 rows: expert 0 gets assignments (t0,k0), (t2,k1);
        # expert 1 gets (t0,k1), (t1,k0), (t2,k0); expert 2 gets (t1,k1).
        topk_NK = jnp.array([[0, 1], [1, 2], [1, 0]], jnp.int32)
        layout = dispatch_lib.block_layout(topk_NK, 3, 2)
        # Expert 0: rows 0-1 (one block); expert 1: rows 2-5 (two blocks, one padding row); expert 2: 6-7.
        np.testing.assert_array_equal(layout.row_NK, [[0, 2], [3, 6], [4, 1]])
        np.testing.assert_array_equal(layout.token_R[:8], [0, 2, 0, 1, 2, 3, 1, 3])
        assert int(layout.num_blocks) == 4
        np.testing.assert_array_equal(layout.expert_NB[:4], [0, 1, 1, 2])
        # Static size: enough blocks for the worst routing, (A + E(b-1)) // b = (6 + 3) // 2 = 4.
        assert layout.token_R.shape == (8,) and layout.expert_NB.shape == (4,)
        assert np.all(np.asarray(layout.token_R[8:]) == 3)

    def test_block_size_rule(self):
        assert dispatch_lib.sparse_block_size(20480, 4) == 256
        assert dispatch_lib.sparse_block_size(2304, 8) == 64  # E·b <= A/4
        assert dispatch_lib.sparse_block_size(256, 4) == 16
        assert dispatch_lib.sparse_block_size(4, 128) == 8  # never below 8

    def test_chunk_levels_rule(self):
        assert dispatch_lib.chunk_levels(4352, 16) == (16, 4, 1)  # the deep_moe step: up to 256-row matmuls
        assert dispatch_lib.chunk_levels(2304, 32) == (4, 1)  # `bench`
        assert dispatch_lib.chunk_levels(4608, 64) == (4, 1)  # the default config
        assert dispatch_lib.chunk_levels(20480, 256) == (1,)  # blocks already wide
        assert dispatch_lib.chunk_levels(256, 8) == (1,)  # the tiny preset (and decoding): too small to pay
        with self.assertRaisesRegex(ValueError, "levels must be blocks per chunk, largest first, ending in 1"):
            dispatch_lib.sparse_experts(
                jnp.ones((1, 4, 8)),
                jnp.zeros((1, 4, 1), jnp.int32),
                jnp.ones((1, 4, 1)),
                jnp.ones((2, 8, 4)),
                jnp.ones((2, 8, 4)),
                jnp.ones((2, 4, 8)),
                levels=(4, 2),
            )

    @chex.variants(with_jit=True)
    @parameterized.named_parameters(
        ("auto_block", 3, 7, 16, 12, 4, 2, None, "random"),
        ("k_equals_e", 2, 5, 8, 8, 4, 4, 8, "random"),
        ("top3_of_32_one_loop", 2, 9, 16, 8, 32, 3, 8, "random"),  # E > STATIC_EXPERT_LOOPS: a loop over blocks
        ("all_to_one_expert", 3, 11, 16, 8, 4, 2, 8, "skewed"),
        # Blocks of 2 rows, 3 at a time: expert 2 gets 17+ blocks, the others a few, so both loops run.
        ("chunks_all_to_one_expert", 3, 11, 16, 8, 4, 2, 2, "skewed", (3, 1)),
        # E > STATIC_EXPERT_LOOPS with chunks: the loop over experts, each expert's blocks 9, 3, 1 at a time.
        ("levels_top3_of_32", 2, 9, 16, 8, 32, 3, 2, "random", (9, 3, 1)),
        ("levels_all_to_one_of_32", 3, 11, 16, 8, 32, 2, 2, "skewed", (9, 3, 1)),
    )
    def test_matches_dense_values_and_gradients(self, B_, T_, D, F, E, K, block, routing, levels=None):
        ks = jax.random.split(jax.random.key(B_ * 100 + E), 6)
        x = jax.random.normal(ks[0], (B_, T_, D))
        w = [jax.random.normal(k, s) * s[-2] ** -0.5 for k, s in zip(ks[1:4], [(E, D, F), (E, D, F), (E, F, D)])]
        logits = jax.random.normal(ks[4], (B_, T_, E))
        if routing == "skewed":  # every token's first choice is expert 2: the most blocks any routing needs
            logits = logits.at[..., 2].add(100.0)
        topk, gates, _ = moe.route(logits, K, True)
        if routing == "skewed":
            assert np.all(np.asarray(topk[..., 0]) == 2)
        sparse = functools.partial(dispatch_lib.sparse_experts, block=block, levels=levels)

        def loss(fn, x, gates, *w):
            return jnp.sum(jnp.sin(fn(x, topk, gates, *w)))

        dense = dispatch_lib.dense_experts
        y_d = dense(x, topk, gates, *w)
        y_s = self.variant(lambda *a: sparse(a[0], topk, *a[1:]))(x, gates, *w)
        np.testing.assert_allclose(y_s, y_d, atol=1e-5, rtol=1e-5)
        grad = lambda fn: jax.value_and_grad(functools.partial(loss, fn), argnums=(0, 1, 2, 3, 4))
        (l_d, g_d), (l_s, g_s) = grad(dense)(x, gates, *w), self.variant(grad(sparse))(x, gates, *w)
        np.testing.assert_allclose(l_s, l_d, rtol=1e-5)
        chex.assert_trees_all_close(g_s, g_d, atol=1e-5, rtol=1e-4)
        assert all(float(jnp.abs(g).max()) > 0 for g in g_s)


class TestExpertParallel(chex.TestCase):
    """The all-to-all expert-parallel MoE (`expert_parallel.expert_parallel`) on the fake 8-device mesh
    against the single-device dense path, in values and gradients."""

    @parameterized.named_parameters(*((d, d) for d in ("dense", "ragged", "sparse", "grouped")))
    def test_no_expert_index_gives_zero_rows(self, dispatch):
        # Index E ("no expert") is how the exchange marks empty slots: such a row outputs exactly 0 and
        # the other rows are what they would be without it.
        ks = jax.random.split(jax.random.key(7), 5)
        E, D, F = 4, 8, 6
        x = jax.random.normal(ks[0], (1, 10, D))
        w = [jax.random.normal(k, s) for k, s in zip(ks[1:4], [(E, D, F), (E, D, F), (E, F, D)])]
        topk = jax.random.randint(ks[4], (1, 10, 1), 0, E)
        none = jnp.arange(10)[None, :, None] % 3 == 0
        fn = dispatch_lib.experts_fn(dispatch, "cpu")
        ones = jnp.ones((1, 10, 1))
        y = fn(x, jnp.where(none, E, topk), ones, *w)
        y_all = fn(x, topk, ones, *w)
        np.testing.assert_array_equal(np.asarray(y)[0, ::3], 0.0)
        keep = np.asarray(~none[0, :, 0])
        np.testing.assert_allclose(np.asarray(y)[0, keep], np.asarray(y_all)[0, keep], atol=1e-5, rtol=1e-5)

    @parameterized.named_parameters(
        ("fsdp2_ep4_sparse", dict(fsdp=2, expert=4), "sparse", (4, 6), "random"),
        ("ep8_ragged", dict(expert=8), "ragged", (4, 6), "random"),
        ("dp2_ep2_tp2_dense", dict(data=2, expert=2, tensor=2), "dense", (4, 6), "random"),
        ("ep4_tp2_sparse_skewed", dict(expert=4, tensor=2), "sparse", (4, 6), "skewed"),
        ("fsdp2_ep4_ragged_padded", dict(fsdp=2, expert=4), "ragged", (2, 5), "random"),  # 10 tokens, 8 devices
        ("ep4_grouped_padded", dict(expert=4), "grouped", (2, 5), "random"),
    )
    def test_matches_dense_values_and_gradients(self, axes, dispatch, shape, routing):
        E, K, D, F = 8, 2, 16, 8
        ks = jax.random.split(jax.random.key(3), 6)
        x = jax.random.normal(ks[0], (*shape, D))
        w = [jax.random.normal(k, s) * s[-2] ** -0.5 for k, s in zip(ks[1:4], [(E, D, F), (E, D, F), (E, F, D)])]
        logits = jax.random.normal(ks[4], (*shape, E))
        if routing == "skewed":  # every token picks experts 2 and 3, both on one expert shard
            logits = logits.at[..., 2:4].add(100.0)
        topk, gates, _ = moe.route(logits, K, True)
        local = dispatch_lib.experts_fn(dispatch, "cpu")

        def loss(experts, x, gates, *w):
            y = experts(x, topk, gates, *w)
            return jnp.sum(jnp.sin(y)), y

        grad = lambda experts: jax.value_and_grad(
            functools.partial(loss, experts), argnums=(0, 1, 2, 3, 4), has_aux=True
        )
        (l_d, y_d), g_d = grad(dispatch_lib.dense_experts)(x, gates, *w)

        mesh = sharding.make_mesh(**axes)
        ep = lambda *a: expert_parallel.expert_parallel(local, jax.sharding.get_abstract_mesh(), *a)
        rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        fn = jax.jit(sharding.under_mesh(grad(ep), mesh), in_shardings=rep, out_shardings=rep)
        assert "all-to-all" in fn.lower(x, gates, *w).compile().as_text()  # tokens really travel
        (l_e, y_e), g_e = fn(x, gates, *w)
        np.testing.assert_allclose(y_e, y_d, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(l_e, l_d, rtol=1e-5)
        chex.assert_trees_all_close(g_e, g_d, atol=1e-5, rtol=1e-4)
        assert all(float(jnp.abs(g).max()) > 0 for g in g_e)

    def test_experts_must_divide_over_the_expert_axis(self):
        mesh = sharding.make_mesh(expert=8)
        x, w = jnp.zeros((1, 8, 4)), jnp.zeros((4, 4, 2))
        with pytest.raises(ValueError, match="num_experts"):
            expert_parallel.expert_parallel(
                dispatch_lib.dense_experts, mesh, x, jnp.zeros((1, 8, 1), jnp.int32), jnp.ones((1, 8, 1)), w, w, w
            )


# ------------------------------------------------------------------ KV cache


class TestKVCache(chex.TestCase):
    @chex.variants(with_jit=True)
    @parameterized.named_parameters(*((d, d) for d in ("dense", "ragged", "sparse", "grouped")))
    def test_prefill_then_decode_matches_full_forward(self, dispatch):
        cfg, _, state = tiny_model()
        graphdef, _ = build(dataclasses.replace(cfg, dispatch=dispatch))
        P, steps, S = 5, T - 5, 12
        tokens = random_tokens(11, (B, P + steps))
        # Row 1 is a left-padded prompt (2 pad tokens).
        mask = jnp.ones((B, P + steps), bool).at[1, :2].set(False)
        positions = model_lib.positions_from_mask(mask)
        full, aux_full = model_lib.apply(graphdef, state, tokens, positions)

        fn = self.variant(fwd(graphdef))
        if self.variant.type == chex.ChexVariantType.WITH_JIT:
            # chex's jit variant has no donate_argnames: jit once more, donating the cache as the sampler does.
            fn = jax.jit(fn, donate_argnames=("cache",))
        cache = model_lib.init_cache(cfg, B, S)
        logits, aux = fn(state, tokens[:, :P], positions[:, :P], cache=cache)
        # Padding tokens' own outputs are arbitrary (finite); compare real tokens only.
        real = np.asarray(mask[:, :P])
        np.testing.assert_allclose(logits[real], full[:, :P][real], atol=1e-5, rtol=1e-5)
        np.testing.assert_array_equal(
            aux.topk.transpose(0, 2, 1, 3)[real], aux_full.topk[:, :, :P].transpose(0, 2, 1, 3)[real]
        )
        assert np.isfinite(np.asarray(logits)).all()
        cache = aux.cache
        assert int(cache.index) == P
        for t in range(P, P + steps):
            logits, aux = fn(state, tokens[:, t : t + 1], positions[:, t : t + 1], cache=cache)
            cache = aux.cache
            np.testing.assert_allclose(logits[:, 0], full[:, t], atol=1e-5, rtol=1e-5)
            np.testing.assert_array_equal(aux.topk[:, :, 0], aux_full.topk[:, :, t])
        assert int(cache.index) == P + steps
        np.testing.assert_array_equal(cache.positions[:, : P + steps], positions)
        assert (cache.positions[:, P + steps :] == -1).all()
        assert len(cache.k) == len(cache.v) == cfg.num_layers
        assert cache.k[0].shape == (B, cfg.num_kv_heads, S, cfg.head_dim)


def test_prefill_into_an_empty_cache_equals_the_cache_path():
    """`hidden(..., empty_cache=True)` (the layers as scans, attending within the prompt) writes the
    same keys/values and gives the same hidden states and routing as the per-layer cache path, and
    leaves the cache's stale slots (positions -1) as they were."""
    cfg, graphdef, state = tiny_model()
    P, S = 6, 10
    tokens = random_tokens(5, (B, P))
    mask = jnp.ones((B, P), bool).at[1, :3].set(False)  # a left-padded prompt
    positions = model_lib.positions_from_mask(mask)
    stale = jax.random.normal(jax.random.key(1), (B, cfg.num_kv_heads, S, cfg.head_dim))
    empty = model_lib.init_cache(cfg, B, S)
    empty = dataclasses.replace(
        empty, k=tuple(stale + i for i in range(cfg.num_layers)), v=(stale * 2,) * cfg.num_layers
    )

    @functools.partial(jax.jit, static_argnums=0)
    def prefill(scan, cache):
        return nnx.merge(graphdef, state).hidden(tokens, positions, cache=cache, empty_cache=scan)

    x_ref, aux_ref = prefill(False, empty)
    x, aux = prefill(True, empty)
    # One layer body per stack in the program (tiny: a dense stack of 1 and a MoE stack of 2 layers).
    dots = lambda scan: prefill.lower(scan, empty).as_text().count("dot_general")
    assert dots(True) < dots(False)
    real = np.asarray(mask)
    np.testing.assert_allclose(x[real], x_ref[real], atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(aux.topk.transpose(0, 2, 1, 3)[real], aux_ref.topk.transpose(0, 2, 1, 3)[real])
    assert int(aux.cache.index) == P and (aux.cache.positions == aux_ref.cache.positions).all()
    for i in range(cfg.num_layers):
        for new, ref, old in (
            (aux.cache.k[i], aux_ref.cache.k[i], empty.k[i]),
            (aux.cache.v[i], aux_ref.cache.v[i], empty.v[i]),
        ):
            np.testing.assert_allclose(new[:, :, :P], ref[:, :, :P], atol=1e-5, rtol=1e-5)
            np.testing.assert_array_equal(new[:, :, P:], old[:, :, P:])


def test_cache_pytree_roundtrip():
    cfg = model_config.get("tiny")
    cache = model_lib.init_cache(cfg, 2, 4)
    leaves, treedef = jax.tree.flatten(cache)
    assert len(leaves) == 2 * cfg.num_layers + 2
    again = jax.tree.unflatten(treedef, leaves)
    assert isinstance(again, model_lib.KVCache) and again.index.dtype == jnp.int32
    assert (again.positions == -1).all()


# ------------------------------------------------------------------ routing replay


class TestRoutingReplay(chex.TestCase):
    @chex.variants(with_jit=True)
    def test_replaying_own_routing_is_exact(self):
        _, graphdef, state = tiny_model()
        tokens, positions = random_tokens(12), arange_positions()
        logits, aux = self.variant(fwd(graphdef))(state, tokens, positions)
        replay = self.variant(fwd(graphdef))
        logits_r, aux_r = replay(state, tokens, positions, forced_topk=aux.topk)
        np.testing.assert_array_equal(aux_r.topk, aux.topk)
        np.testing.assert_array_equal(logits_r, logits)
        np.testing.assert_array_equal(aux_r.lb_loss, aux.lb_loss)

    @chex.variants(with_jit=True)
    def test_replay_router_gets_gradient(self):
        _, graphdef, state = tiny_model()
        tokens, positions = random_tokens(13), arange_positions()
        _, aux = model_lib.apply(graphdef, state, tokens, positions)
        w = jax.random.normal(jax.random.key(14), (B, T, 128))

        def loss(state):
            logits, _ = model_lib.apply(graphdef, state, tokens, positions, forced_topk=aux.topk)
            return jnp.sum(jax.nn.log_softmax(logits) * w)

        grads = self.variant(jax.grad(loss))(state)
        for g in router_params(grads):
            assert float(jnp.abs(g).max()) > 1e-6

    @chex.variants(with_jit=True)
    def test_forcing_other_experts_changes_output(self):
        cfg, graphdef, state = tiny_model()
        tokens, positions = random_tokens(15), arange_positions()
        fn = self.variant(fwd(graphdef))
        logits, aux = fn(state, tokens, positions)
        forced = (aux.topk + 1) % cfg.num_experts
        logits_f, aux_f = fn(state, tokens, positions, forced_topk=forced)
        np.testing.assert_array_equal(aux_f.topk, forced)
        assert float(jnp.abs(logits_f - logits).max()) > 1e-3


def test_forced_topk_shape_checked(tiny):
    _, graphdef, state = tiny
    with pytest.raises(AssertionError, match="forced_topk"):  # chex shape check at the boundary
        model_lib.apply(
            graphdef, state, random_tokens(0), arange_positions(), forced_topk=jnp.zeros((1, B, T, 2), jnp.int32)
        )


# ------------------------------------------------------------------ MoE pieces


class TestMoEPieces(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_lb_loss_is_k_for_uniform_router(self):
        cfg, graphdef, state = tiny_model()
        state = set_routers(state, jnp.zeros_like)
        _, aux = self.variant(fwd(graphdef))(state, random_tokens(16), arange_positions())
        np.testing.assert_allclose(aux.lb_loss, cfg.top_k, rtol=1e-6)
        np.testing.assert_allclose(aux.z_loss, np.log(cfg.num_experts) ** 2, rtol=1e-6)
        # lax.top_k ties go to the lower index.
        np.testing.assert_array_equal(aux.topk, np.broadcast_to(np.arange(cfg.top_k), aux.topk.shape))

    @chex.variants(with_jit=True, without_jit=True)
    def test_route_renormalisation_and_replay_gates(self):
        logits = jax.random.normal(jax.random.key(17), (2, 3, 6))
        topk, gates, _ = self.variant(functools.partial(moe.route, top_k=2, renormalize=True))(logits)
        np.testing.assert_allclose(gates.sum(-1), 1.0, rtol=1e-6)
        np.testing.assert_allclose(gates, jax.nn.softmax(jnp.take_along_axis(logits, topk, -1)), rtol=1e-5)
        _, raw, _ = moe.route(logits, 2, False)
        np.testing.assert_allclose(raw, jnp.take_along_axis(jax.nn.softmax(logits), topk, -1), rtol=1e-6)
        forced = jnp.zeros_like(topk).at[..., 1].set(5)
        topk_f, gates_f, _ = moe.route(logits, 2, True, forced)
        np.testing.assert_array_equal(topk_f, forced)
        np.testing.assert_allclose(gates_f.sum(-1), 1.0, rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_lb_loss_ignores_padding(self):
        probs = jax.nn.softmax(jax.random.normal(jax.random.key(18), (1, 4, 4)))
        topk = jnp.array([[[0, 1], [2, 3], [0, 1], [0, 0]]])
        valid = jnp.array([[True, True, True, False]])
        lb = self.variant(moe.load_balancing_loss)(probs, topk, valid)
        f = np.array([2, 2, 1, 1]) / 3
        p = np.asarray(probs[0, :3]).mean(0)
        np.testing.assert_allclose(lb, 4 * np.sum(f * p), rtol=1e-6)

    @chex.variants(with_jit=True)
    @parameterized.named_parameters(*((d, d) for d in ("dense", "ragged", "sparse", "grouped")))
    def test_padding_tokens_skip_the_experts(self, dispatch):
        # A padding token's experts output exactly 0 (it adds nothing to the residual stream: nothing reads
        # it); a valid token's output, the routing and the aux losses are those of the layer that runs
        # every token, and so are the gradients (a padding token's output gradient is 0 in any loss
        # masked to valid tokens).
        layer = moe.MoE(16, 6, 2, 8, renormalize=True, dispatch=dispatch, rngs=nnx.Rngs(3))
        graphdef, state = nnx.split(layer)
        x = jax.random.normal(jax.random.key(4), (2, 7, 16))
        valid = jnp.arange(7)[None, :] >= jnp.array([[2], [0]])  # row 0: two padding tokens
        valid = valid & (jnp.arange(7)[None, :] < jnp.array([[7], [5]]))  # row 1: two after its end

        def run(skip):
            def loss(state, x):
                y, stats = nnx.merge(graphdef, state)(x, valid)
                return jnp.sum(jnp.where(valid[..., None], jnp.sin(y), 0.0)), (y, stats)

            with mock.patch.object(moe, "SKIP_PADDING", skip):
                return self.variant(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(state, x)

        (l_skip, (y_skip, s_skip)), g_skip = run(True)
        (l_all, (y_all, s_all)), g_all = run(False)
        np.testing.assert_array_equal(np.asarray(y_skip)[~np.asarray(valid)], 0.0)
        assert float(jnp.abs(y_all[~valid]).min()) > 0  # the layer that runs every token: not 0 there
        np.testing.assert_allclose(y_skip[valid], y_all[valid], atol=1e-6, rtol=1e-6)
        np.testing.assert_array_equal(s_skip.topk_BTK, s_all.topk_BTK)
        np.testing.assert_allclose(
            [s_skip.lb_loss, s_skip.z_loss, l_skip], [s_all.lb_loss, s_all.z_loss, l_all], rtol=1e-6
        )
        chex.assert_trees_all_close(g_skip, g_all, atol=1e-6, rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_rope_depends_on_relative_position(self):
        q = jax.random.normal(jax.random.key(19), (1, 1, 1, 16))
        k = jax.random.normal(jax.random.key(20), (1, 1, 1, 16))
        rope = self.variant(functools.partial(layers.apply_rope, theta=10_000.0))

        def score(m, n):
            return float(jnp.sum(rope(q, jnp.array([[m]])) * rope(k, jnp.array([[n]]))))

        np.testing.assert_allclose(score(7, 3), score(14, 10), rtol=1e-5)
        np.testing.assert_allclose(rope(q, jnp.array([[0]])), q)
        np.testing.assert_allclose(rope(q, jnp.array([[-1]])), q)  # padding rotates as position 0
        np.testing.assert_allclose(jnp.linalg.norm(rope(q, jnp.array([[5]]))), jnp.linalg.norm(q), rtol=1e-6)


# ------------------------------------------------------------------ sharding, compilation


class TestSharding(chex.TestCase):
    @chex.variants(with_jit=True)
    @parameterized.named_parameters(
        ("dp_ep_tp_dense", dict(data=2, expert=2, tensor=2), "dense"),
        ("fsdp_ep_tp_ragged", dict(fsdp=2, expert=2, tensor=2), "ragged"),
        ("dp_ep_tp_sparse", dict(data=2, expert=2, tensor=2), "sparse"),
        ("fsdp_ep_all_to_all_ragged", dict(fsdp=2, expert=4), "ragged", True),
        ("dp_ep_tp_all_to_all_sparse", dict(data=2, expert=2, tensor=2), "sparse", True),
    )
    def test_sharded_forward_matches_single_device(self, axes, dispatch, on_mesh=False):
        """Auto-partitioned, and (`on_mesh`) traced under the mesh: activation constraints and the
        expert-parallel all-to-all MoE."""
        cfg, _, state = tiny_model()
        graphdef, _ = build(dataclasses.replace(cfg, dispatch=dispatch))
        tokens, positions = random_tokens(21, (8, T)), arange_positions(8)  # a sequence per data shard
        expected, aux_e = model_lib.apply(graphdef, state, tokens, positions)

        mesh = sharding.make_mesh(**axes)
        shardings = sharding.param_shardings(mesh, state)
        sharded_state = jax.device_put(state, shardings)
        w = sharded_state["stacks"][1]["layer"]["mlp"]["gate_proj"][...]  # [layers, E, D, F]
        assert w.sharding.spec[:2] == (None, "expert") and len(w.sharding.device_set) == 8
        batch = sharding.batch_sharding(mesh, 2)
        tokens_s, positions_s = jax.device_put(tokens, batch), jax.device_put(positions, batch)
        f = sharding.under_mesh(fwd(graphdef), mesh) if on_mesh else fwd(graphdef)
        if on_mesh:
            assert "all-to-all" in jax.jit(f).lower(sharded_state, tokens_s, positions_s).compile().as_text()
        logits, aux = self.variant(f)(sharded_state, tokens_s, positions_s)
        np.testing.assert_allclose(logits, expected, atol=1e-5, rtol=1e-5)
        np.testing.assert_array_equal(aux.topk, aux_e.topk)


def test_jit_compiles_once(tiny, compile_counter):
    cfg, graphdef, state = tiny
    fn = jax.jit(lambda state, tokens, positions: model_lib.apply(graphdef, state, tokens, positions))
    forced_fn = jax.jit(
        lambda state, tokens, positions, forced: model_lib.apply(graphdef, state, tokens, positions, forced_topk=forced)
    )
    forced = [
        jax.random.randint(jax.random.key(seed), (B, cfg.num_moe_layers, T, 2), 0, 4) * 2 + jnp.array([0, 1])
        for seed in range(3)
    ]
    tokens = [random_tokens(seed) for seed in range(3)]
    positions = arange_positions()
    fn(state, tokens[0], positions)
    forced_fn(state, tokens[0], positions, forced[0])
    compile_counter.reset()
    for seed in (1, 2):
        fn(state, tokens[seed], positions)
        forced_fn(state, tokens[seed], positions, forced[seed])
    assert compile_counter.count == 0

"""Low-rank adapters on the experts (`dispatch.ExpertAdapters`, issue 64): on every dispatch path the
values and the gradients (input, gates, base weights, A and B) equal the dense path on the merged
weights W + A·B; sharded (expert and batch parallelism on the fake 8-device CPU mesh) equals one
device; `adapters=None` is the program without adapters; and a frozen base's weight gradients are
compiled away."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax import dispatch as dispatch_lib
from gspo_jax import expert_parallel, grouped, sharding
from gspo_jax.dispatch import ExpertAdapters

D, F, R = 32, 16, 4


def inputs(N=40, E=6, K=2, empty=(3,), seed=0):
    """Tokens, a routing that never picks the experts `empty`, the base weights and adapters (B nonzero)."""
    ks = jax.random.split(jax.random.key(seed), 12)
    x = jax.random.normal(ks[0], (1, N, D))
    w = [jax.random.normal(k, s) * s[-2] ** -0.5 for k, s in zip(ks[1:4], [(E, D, F), (E, D, F), (E, F, D)])]
    logits = jax.random.uniform(ks[4], (1, N, E)).at[..., list(empty)].set(-1.0)
    topk = jax.lax.top_k(logits, K)[1].astype(jnp.int32)
    gates = jax.nn.softmax(jax.random.normal(ks[5], (1, N, K)), axis=-1)
    shapes = [(E, D, R), (E, R, F), (E, D, R), (E, R, F), (E, F, R), (E, R, D)]
    ad = ExpertAdapters(*(0.5 * jax.random.normal(k, s) * s[-2] ** -0.5 for k, s in zip(ks[6:], shapes)))
    return x, topk, gates, w, ad


def merged(experts):
    """`experts` on the merged weights W + A·B: the reference for the adapters' gradients too."""

    def fn(x, topk, gates, w_gate, w_up, w_down, ad):
        w = [w_gate + ad.a_gate_EDR @ ad.b_gate_ERF, w_up + ad.a_up_EDR @ ad.b_up_ERF]
        return experts(x, topk, gates, *w, w_down + ad.a_down_EFR @ ad.b_down_ERD)

    return fn


def value_and_grads(experts, x, topk, gates, w, ad, jit=jax.jit):
    loss = lambda x, gates, w, ad: jnp.sum(jnp.sin(experts(x, topk, gates, *w, ad)))
    return jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, gates, w, ad)


def assert_close(got, want, atol=2e-5, rtol=2e-5):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, atol=atol, rtol=rtol)


PATHS = {
    "dense": dispatch_lib.dense_experts,
    "ragged": dispatch_lib.ragged_experts,
    "sparse": dispatch_lib.sparse_experts,
    "sparse_b8_chunk2": functools.partial(dispatch_lib.sparse_experts, block=8, levels=(2, 1)),
    "sparse_b8_levels": functools.partial(dispatch_lib.sparse_experts, block=8, levels=(4, 2, 1)),
    "grouped_xla": functools.partial(grouped.grouped_experts, kernels="xla"),
    "grouped_interpret": functools.partial(grouped.grouped_experts, kernels="interpret"),
}


@pytest.mark.parametrize("path", PATHS)
def test_every_path_equals_the_merged_weights(path):
    x, topk, gates, w, ad = inputs()
    want = value_and_grads(merged(dispatch_lib.dense_experts), x, topk, gates, w, ad)
    got = value_and_grads(PATHS[path], x, topk, gates, w, ad)
    assert_close(got, want)
    d_ad = got[1][3]
    for g in d_ad:  # expert 3 got no rows: its adapters' gradients are exact zeros, the others' are not
        assert np.all(np.asarray(g[3]) == 0.0) or path == "dense"
        assert all(float(jnp.abs(g[e]).max()) > 0 for e in (0, 1, 2, 4, 5))


@pytest.mark.parametrize("path", ["sparse", "sparse_b8_levels", "grouped_interpret"])
def test_more_experts_and_wider_rows(path):
    # 20 experts: the sparse loop reads each block's expert (past STATIC_EXPERT_LOOPS), or with chunks
    # loops over the experts; 300 rows: several 128-row megablox tiles, the last padded.
    x, topk, gates, w, ad = inputs(N=150, E=20, empty=(3, 7))
    want = value_and_grads(merged(dispatch_lib.dense_experts), x, topk, gates, w, ad)
    assert_close(value_and_grads(PATHS[path], x, topk, gates, w, ad), want, atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize("path", ["ragged", "sparse", "grouped_xla", "grouped_interpret"])
def test_zero_b_is_the_base_and_none_is_the_program_without_adapters(path):
    x, topk, gates, w, ad = inputs(N=24)
    fn = PATHS[path]
    base = value_and_grads(lambda x, topk, gates, *w: fn(x, topk, gates, *w[:3]), x, topk, gates, w, None)
    none = value_and_grads(fn, x, topk, gates, w, None)
    for a, b in zip(jax.tree.leaves(none), jax.tree.leaves(base), strict=True):
        np.testing.assert_array_equal(a, b)
    loss = lambda x, gates, w, ad: jnp.sum(jnp.sin(fn(x, topk, gates, *w, ad)))
    jaxpr = lambda ad: str(jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, gates, w, ad))
    assert jaxpr(None) == str(
        jax.make_jaxpr(jax.value_and_grad(lambda x, g, w: jnp.sum(jnp.sin(fn(x, topk, g, *w))), argnums=(0, 1, 2)))(
            x, gates, w
        )
    )
    # B = 0 (LoRA's initialisation): the adapted output is the base output exactly.
    zero_b = ad._replace(b_gate_ERF=0 * ad.b_gate_ERF, b_up_ERF=0 * ad.b_up_ERF, b_down_ERD=0 * ad.b_down_ERD)
    np.testing.assert_array_equal(jax.jit(fn)(x, topk, gates, *w, zero_b), jax.jit(fn)(x, topk, gates, *w))


@pytest.mark.parametrize("path", ["sparse", "grouped_interpret"])
def test_bfloat16_close_to_float32(path):
    x, topk, gates, w, ad = inputs()
    bf = lambda t: jax.tree.map(lambda a: a.astype(jnp.bfloat16), t)
    f32 = lambda t: jax.tree.map(lambda a: a.astype(jnp.float32), t)
    y16 = PATHS[path](bf(x), topk, gates, *bf(w), bf(ad))
    y32 = merged(dispatch_lib.dense_experts)(f32(bf(x)), topk, gates, *f32(bf(w)), f32(bf(ad)))
    assert y16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y16, np.float32), y32, atol=0.03 * float(jnp.abs(y32).max()))


def test_mosaic_gpu_rank_is_padded_to_whole_tiles():
    _, _, _, _, ad = inputs()
    padded = grouped._pad_rank(ad, grouped.GPU_DIM_MULTIPLE)
    assert padded.a_gate_EDR.shape[-1] == padded.b_down_ERD.shape[1] == 128
    for p, a in zip(padded, ad):
        np.testing.assert_array_equal(p[..., : a.shape[1], : a.shape[2]], a)  # zeros after: same products


# ------------------------------------------------------------------ a frozen base


def _dot_shapes(hlo: str) -> list[str]:
    return re.findall(r"= f32\[([\d,]*)\]\{[^}]*\} dot\(", hlo)


@pytest.mark.parametrize("path", ["sparse", "grouped_xla"])
def test_a_frozen_bases_weight_gradients_are_compiled_away(path):
    """Differentiating wrt the adapters only (the LoRA trainer), the compiled program computes no base
    weight gradient: no [D, F] / [F, D] (per expert, or [E, D, F]) products. Wrt the weights too, it does."""
    x, topk, gates, w, ad = inputs()
    fn = PATHS[path]

    def compiled(argnums):
        loss = lambda x, gates, w, ad: jnp.sum(jnp.sin(fn(x, topk, gates, *w, ad)))
        return jax.jit(jax.grad(loss, argnums=argnums)).lower(x, gates, w, ad).compile().as_text()

    frozen, full = compiled((0, 1, 3)), compiled((0, 1, 2, 3))
    # sparse: per block [D, F], [F, D]; grouped (XLA:CPU expands the ragged dots): [E, D, F], [E, F, D]
    weight_grads = {f"{D},{F}", f"{F},{D}", f"6,{D},{F}", f"6,{F},{D}"}
    assert weight_grads & set(_dot_shapes(full)) and not weight_grads & set(_dot_shapes(frozen))


# ------------------------------------------------------------------ on a mesh

LAYOUTS = {
    "expert2": dict(expert=2),
    "data2_expert2": dict(data=2, expert=2),
    "fsdp2_expert2_tensor2": dict(fsdp=2, expert=2, tensor=2),
    "data2_tensor2": dict(data=2, tensor=2),
    "data4": dict(data=4),
}


# Each layout's essentials run by default (expert parallelism with F over "tensor", batch parallelism for
# the grouped kernels); the rest are `slow`.
FAST = {("fsdp2_expert2_tensor2", "sparse"), ("data2_expert2", "grouped_xla"), ("data2_tensor2", "grouped_xla")}
SHARDED = [(k, p) for k in LAYOUTS for p in ("sparse", "grouped_xla")] + [("data2_expert2", "ragged")]


@pytest.mark.parametrize(
    "axes, path",
    [pytest.param(LAYOUTS[k], p, marks=() if (k, p) in FAST else pytest.mark.slow) for k, p in SHARDED],
    ids=[f"{k}-{p}" for k, p in SHARDED],
)
def test_sharded_equals_one_device(axes, path):
    """Expert parallelism (an expert axis: adapters split over "expert" like the weights) and batch
    parallelism (none: every device has every expert's adapters), both with F split over "tensor":
    values and every gradient equal the path on one device."""
    x, topk, gates, w, ad = inputs(N=20, E=8, empty=())
    fn = PATHS[path]
    want = value_and_grads(fn, x, topk, gates, w, ad)
    mesh = sharding.make_mesh(**axes)
    wrap = expert_parallel.expert_parallel if axes.get("expert", 1) > 1 else expert_parallel.batch_parallel
    on_mesh = lambda *a: wrap(fn, jax.sharding.get_abstract_mesh(), *a)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    jit = lambda f: jax.jit(sharding.under_mesh(f, mesh), in_shardings=rep, out_shardings=rep)
    got = value_and_grads(on_mesh, x, topk, gates, w, ad, jit=jit)
    assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_parallel_experts_passes_adapters_by_keyword():
    x, topk, gates, w, ad = inputs(N=16, E=8, empty=())
    mesh = sharding.make_mesh(data=2, expert=2)
    fn = lambda *a: expert_parallel.parallel_experts(dispatch_lib.sparse_experts, "sparse", mesh.abstract_mesh)(
        *a, adapters=ad
    )
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    y = jax.jit(sharding.under_mesh(fn, mesh), in_shardings=rep, out_shardings=rep)(x, topk, gates, *w)
    np.testing.assert_allclose(y, dispatch_lib.sparse_experts(x, topk, gates, *w, adapters=ad), atol=1e-5)

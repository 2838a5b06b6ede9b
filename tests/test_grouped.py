"""The grouped expert path (`gspo_jax.grouped`): its hand-written backward with the reference kernels
(`lax.ragged_dot`) and with megablox run in Pallas interpret mode (the TPU kernels' own code) against
the dense path, empty experts, "no expert" rows, the `dispatch="auto"` rule, and the kernels run per
device in a shard_map on every mesh layout of the fake 8-device CPU mesh (tests/conftest.py)."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gspo_jax import dispatch as dispatch_lib
from gspo_jax import expert_parallel, grouped, model_config, moe, sharding
from gspo_jax import model as model_lib
from gspo_jax.sampler import Sampler, SamplerOptions, left_pad


def inputs(N=40, D=32, F=16, E=6, K=2, empty=(3,), seed=0):
    ks = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(ks[0], (1, N, D))
    w = [jax.random.normal(k, s) * s[-2] ** -0.5 for k, s in zip(ks[1:4], [(E, D, F), (E, D, F), (E, F, D)])]
    logits = jax.random.uniform(ks[4], (1, N, E)).at[..., list(empty)].set(-1.0)  # never chosen
    topk = jax.lax.top_k(logits, K)[1].astype(jnp.int32)
    gates = jax.nn.softmax(jax.random.normal(ks[5], (1, N, K)), axis=-1)
    return x, topk, gates, w


def value_and_grads(experts, x, topk, gates, w):
    loss = lambda x, gates, *w: jnp.sum(jnp.sin(experts(x, topk, gates, *w)))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))(x, gates, *w)


@pytest.mark.parametrize("kernels, N", [("xla", 40), ("interpret", 40), ("interpret", 100)])
def test_values_and_gradients_equal_the_dense_path(kernels, N):
    # N = 100: 200 rows, more than one 128-row megablox tile and not a multiple of it (padded)
    x, topk, gates, w = inputs(N=N)
    want = value_and_grads(dispatch_lib.dense_experts, x, topk, gates, w)
    got = value_and_grads(functools.partial(grouped.grouped_experts, kernels=kernels), x, topk, gates, w)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)
    # Expert 3 got no rows: its weight gradients are exact zeros, the others' are not.
    for g in got[1][2:]:
        assert np.all(np.isfinite(g)) and np.all(np.asarray(g[3]) == 0.0)
        assert all(float(jnp.abs(g[e]).max()) > 0 for e in (0, 1, 2, 4, 5))


@pytest.mark.parametrize("kernels", ["xla", "interpret"])
def test_no_expert_rows_give_zero_and_leave_the_rest_unchanged(kernels):
    # Index E marks the expert-parallel exchange's empty slots: the rows are sorted past every group.
    x, topk, gates, w = inputs(N=24, K=1, empty=())
    none = (jnp.arange(24) % 3 == 0)[None, :, None]
    fn = functools.partial(grouped.grouped_experts, kernels=kernels)
    y = np.asarray(fn(x, jnp.where(none, 6, topk), jnp.ones_like(gates), *w))
    y_all = np.asarray(fn(x, topk, jnp.ones_like(gates), *w))
    np.testing.assert_array_equal(y[0, ::3], 0.0)
    keep = ~np.asarray(none)[0, :, 0]
    np.testing.assert_allclose(y[0, keep], y_all[0, keep], atol=1e-6, rtol=1e-6)
    _, grads = value_and_grads(fn, x, jnp.where(none, 6, topk), gates, w)
    np.testing.assert_array_equal(np.asarray(grads[0])[0, ::3], 0.0)  # "no expert" rows get no input gradient


def test_bfloat16_close_to_float32():
    x, topk, gates, w = inputs()
    bf = lambda t: jax.tree.map(lambda a: a.astype(jnp.bfloat16), t)
    fn = functools.partial(grouped.grouped_experts, kernels="interpret")
    y16 = fn(bf(x), topk, gates, *bf(w))
    y32 = dispatch_lib.dense_experts(bf(x).astype(jnp.float32), topk, gates, *[a.astype(jnp.float32) for a in bf(w)])
    assert y16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y16, np.float32), y32, atol=0.02 * float(jnp.abs(y32).max()))


@pytest.mark.parametrize(
    "platform, dtype, want",
    [
        ("cpu", jnp.bfloat16, "sparse"),
        ("cpu", jnp.float32, "sparse"),
        ("tpu", jnp.float32, "grouped"),
        ("gpu", jnp.bfloat16, "grouped"),
        ("gpu", jnp.float16, "grouped"),
        ("gpu", jnp.float32, "dense"),
    ],
)
def test_the_auto_rule(platform, dtype, want):
    assert dispatch_lib.resolve_dispatch("auto", platform, dtype) == want
    assert dispatch_lib.resolve_dispatch("ragged", platform, dtype) == "ragged"  # an explicit choice is kept


def test_gpus_without_wgmma_get_dense_and_a_named_refusal(monkeypatch):
    monkeypatch.setattr(grouped, "gpus_have_wgmma", lambda: False)  # e.g. an A100 (compute capability 8.0)
    assert dispatch_lib.resolve_dispatch("auto", "gpu", jnp.bfloat16) == "dense"
    assert dispatch_lib.resolve_dispatch("auto", "tpu", jnp.bfloat16) == "grouped"
    with pytest.raises(ValueError, match="compute capability 9.0"):
        dispatch_lib.experts_fn("grouped", "gpu", jnp.bfloat16)


def test_widths_that_are_not_whole_gpu_tiles_get_dense_and_a_named_refusal():
    # The tiny preset's experts (D=64, F=32) on a GPU: the Mosaic GPU kernels need multiples of 128.
    assert dispatch_lib.resolve_dispatch("auto", "gpu", jnp.bfloat16, (64, 32)) == "dense"
    assert dispatch_lib.resolve_dispatch("auto", "gpu", jnp.bfloat16, (2048, 768)) == "grouped"
    assert dispatch_lib.resolve_dispatch("auto", "tpu", jnp.bfloat16, (64, 32)) == "grouped"  # megablox pads its tiles
    with pytest.raises(ValueError, match="model.embed_dim and model.moe_mlp_dim in multiples of 128"):
        dispatch_lib.experts_fn("grouped", "gpu", jnp.bfloat16, (2048, 96))


def test_grouped_float32_on_a_gpu_is_refused_by_name():
    with pytest.raises(ValueError, match="dispatch='grouped'.*float32"):
        dispatch_lib.experts_fn("grouped", "gpu", jnp.float32)
    assert dispatch_lib.experts_fn("grouped", "tpu", jnp.float32).keywords == {"kernels": "megablox"}
    assert dispatch_lib.experts_fn("grouped", "gpu", jnp.bfloat16).keywords == {"kernels": "mosaic_gpu"}


def test_platform_is_the_mesh_devices_under_a_mesh():
    mesh = sharding.make_mesh(data=2)
    seen = []
    fn = sharding.under_mesh(lambda x: seen.append(sharding.platform()) or x, mesh)
    jax.jit(fn)(jnp.zeros(2))
    assert seen == [mesh.devices.flat[0].platform] and sharding.platform() == jax.default_backend()


def test_unknown_kernels_are_refused_by_name():
    x = jnp.zeros((4, 8))
    with pytest.raises(ValueError, match="kernels='triton'"):
        grouped.gmm("triton", x, jnp.zeros((2, 8, 4)), jnp.array([2, 2], jnp.int32))


# ------------------------------------------------------------------ every mesh layout

# The layouts the TPU compiles in tests/test_aot.py guard; {}: one device.
LAYOUTS = {
    "one_device": {},
    "data4": dict(data=4),
    "fsdp4": dict(fsdp=4),
    "data2_fsdp2": dict(data=2, fsdp=2),
    "data2_tensor2": dict(data=2, tensor=2),
    "fsdp2_expert2": dict(fsdp=2, expert=2),
    "data2_expert2": dict(data=2, expert=2),
}


def grouped_layer_grads(axes, shape):
    """An MoE layer with dispatch="grouped": its loss, output and gradients (params and input) on the mesh
    `axes` (None: no mesh), and the text of its jaxpr."""
    layer = moe.MoE(16, 4, 2, 8, renormalize=True, dispatch="grouped", rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(layer)
    x = jax.random.normal(jax.random.key(1), (*shape, 16))
    valid = jnp.ones(shape, bool)

    def loss(state, x):
        y, _ = nnx.merge(graphdef, state)(x, valid)
        return jnp.sum(jnp.sin(y)), y

    fn = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    if axes is not None:
        mesh = sharding.make_mesh(**axes)
        fn = sharding.under_mesh(fn, mesh)
        state = jax.device_put(state, sharding.param_shardings(mesh, state))
        spec = sharding.logical_to_spec(("batch", None, None), shape=x.shape, mesh=mesh)
        x = jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
    traced = jax.jit(fn).trace(state, x)
    return traced.lower().compile()(state, x), str(traced.jaxpr)


@pytest.mark.parametrize(
    "axes, shape, kernels",
    [(axes, (4, 5), "xla") for axes in LAYOUTS.values()]
    + [(LAYOUTS["data4"], (2, 5), "xla"), (LAYOUTS["data2_tensor2"], (2, 5), "interpret")],
    ids=[*LAYOUTS, "data4_padded", "data2_tensor2_megablox_padded"],
)
def test_every_mesh_layout_runs_the_kernels_per_device_and_equals_one_device(axes, shape, kernels, monkeypatch):
    """On a mesh of several devices the grouped kernels run inside a shard_map (XLA cannot partition a
    Mosaic kernel's call): `expert_parallel.batch_parallel` without an expert axis (tokens over the data axes,
    expert widths over "tensor"), `expert_parallel.expert_parallel` with one; on one device, no shard_map. Values
    and gradients equal the run without a mesh, with the CPU's reference kernels or megablox's own code
    (interpreted); (2, 5): 10 tokens padded to split over 4 devices."""
    monkeypatch.setattr(grouped, "for_platform", lambda platform: kernels)
    ((loss_ref, y_ref), g_ref), _ = grouped_layer_grads(None, shape)
    ((loss, y), g), jaxpr = grouped_layer_grads(axes, shape)
    several, expert_parallel = math.prod(axes.values()) > 1, axes.get("expert", 1) > 1
    assert ("shard_map" in jaxpr) == several and ("all_to_all" in jaxpr) == expert_parallel
    np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
    assert all(float(jnp.abs(a).max()) > 0 for a in jax.tree.leaves(g))


def test_the_other_dispatches_are_left_to_xla_without_an_expert_axis():
    dense, on_mesh = dispatch_lib.dense_experts, expert_parallel.parallel_experts
    mesh = sharding.make_mesh(data=2, fsdp=2).abstract_mesh
    for dispatch in ("sparse", "dense", "ragged"):
        assert on_mesh(dense, dispatch, mesh) is dense
    assert on_mesh(dense, "grouped", mesh).func is expert_parallel.batch_parallel
    one = sharding.make_mesh().abstract_mesh
    assert on_mesh(dense, "grouped", one) is dense


def test_sampler_and_scoring_in_batch_chunks_on_a_mesh_equal_one_device():
    """The grouped path's shard_map in a real program: the sampler's prefill in batch chunks and its
    decode steps (one token per sequence, 2 per device), and the scoring forward in batch chunks, on
    data=2 × tensor=2, equal the same programs on one device."""
    cfg = model_config.get("tiny", num_layers=1, dense_layers=(), dispatch="grouped", batch_chunks=2)
    graphdef, state = nnx.split(model_lib.Transformer(cfg, rngs=nnx.Rngs(0)))
    B, P, C = 4, 8, 6
    rng = np.random.default_rng(0)
    tokens, mask = left_pad([list(rng.integers(4, cfg.vocab_size, n)) for n in (3, 8, 5, 1)], P)
    mesh = sharding.make_mesh(data=2, tensor=2)
    sharded = jax.device_put(state, sharding.param_shardings(mesh, state))
    options = SamplerOptions(max_top_k=16)
    on_one = Sampler(graphdef, cfg, B, P, C, options=options)(state, tokens, mask, jax.random.key(3))
    on_mesh = Sampler(graphdef, cfg, B, P, C, mesh=mesh, state=state, options=options)(
        sharded, tokens, mask, jax.random.key(3)
    )
    np.testing.assert_array_equal(on_mesh.tokens, on_one.tokens)
    np.testing.assert_allclose(on_mesh.sampler_logp, on_one.sampler_logp, atol=1e-5)
    np.testing.assert_array_equal(on_mesh.topk, on_one.topk)
    positions = model_lib.positions_from_mask(on_one.prompt_mask | on_one.completion_mask)
    score = functools.partial(model_lib.score, graphdef, 1.0)
    logp, topk = jax.jit(score)(state, on_one.tokens, positions)
    score_mesh = jax.jit(sharding.under_mesh(score, mesh))
    logp_mesh, topk_mesh = score_mesh(sharded, on_one.tokens, positions)
    assert "shard_map" in str(score_mesh.trace(sharded, on_one.tokens, positions).jaxpr)
    np.testing.assert_allclose(logp_mesh, logp, atol=1e-5)
    np.testing.assert_array_equal(topk_mesh, topk)

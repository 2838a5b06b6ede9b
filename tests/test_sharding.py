"""Tests for the logical-axis sharding helpers (sharding.py) on the fake 8-device mesh."""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gspo_jax import model as model_lib
from gspo_jax import model_config, sharding


@pytest.fixture(scope="module")
def abstract():
    cfg = model_config.get("tiny")
    graphdef, state = model_lib.abstract_model(cfg)
    return cfg, graphdef, state


def is_var(x):
    return isinstance(x, nnx.Variable)


def test_make_mesh():
    mesh = sharding.make_mesh(data=2, expert=2, tensor=2)
    assert mesh.axis_names == sharding.MESH_AXES
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "expert": 2, "tensor": 2}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    with pytest.raises(ValueError, match="needs 16 devices"):
        sharding.make_mesh(data=16)
    with pytest.raises(ValueError, match=">= 1"):
        sharding.make_mesh(tensor=0)


def test_logical_to_spec():
    assert sharding.logical_to_spec(("embed", "vocab")) == P("fsdp", "tensor")
    assert sharding.logical_to_spec(("expert", "embed", "mlp")) == P("expert", "fsdp", "tensor")
    assert sharding.logical_to_spec(("norm",)) == P(None)
    assert sharding.logical_to_spec((None, "layers")) == P(None, None)
    # A mesh axis is used at most once.
    assert sharding.logical_to_spec(("mlp", "heads")) == P("tensor", None)
    assert sharding.logical_to_spec(("batch", "embed")) == P(("data", "fsdp", "expert"), None)
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    # Axes that do not divide the dimension are dropped, the others kept.
    assert sharding.logical_to_spec(("vocab", "embed"), shape=(3, 64), mesh=mesh) == P(None, "fsdp")
    # (A size-1 axis divides anything: kept, harmlessly.)
    assert sharding.logical_to_spec(("batch", None), shape=(2, 5), mesh=mesh) == P(("data", "expert"), None)
    assert sharding.logical_to_spec(("batch", None), shape=(4, 5), mesh=mesh) == P(("data", "fsdp", "expert"), None)
    custom = (("embed", "tensor"), ("mlp", "tensor"))
    assert sharding.logical_to_spec(("embed", "mlp"), custom) == P("tensor", None)


def test_every_param_is_annotated(abstract):
    _, _, state = abstract
    variables = jax.tree.leaves(state, is_leaf=is_var)
    assert variables
    for v in variables:
        names = v.get_metadata()["out_sharding"]
        assert len(names) == v.get_value().ndim
        assert set(names) <= set(sharding.LOGICAL_AXES)
    names = sharding.logical_axes(state)
    assert names["stacks"][1]["layer"]["mlp"]["gate_proj"].get_value() == ("layers", "expert", "embed", "mlp")
    assert names["embed_tokens"].get_value() == ("vocab", "embed")


def test_param_shardings(abstract):
    _, _, state = abstract
    mesh = sharding.make_mesh(fsdp=2, expert=2, tensor=2)
    shardings = sharding.param_shardings(mesh, state)
    assert jax.tree.structure(shardings) == jax.tree.structure(state)
    assert all(isinstance(s, NamedSharding) for s in jax.tree.leaves(shardings))
    moe = shardings["stacks"][1]["layer"]["mlp"]  # every layer parameter has a leading, unsharded "layers" axis
    assert moe["gate_proj"].get_value().spec == P(None, "expert", "fsdp", "tensor")
    assert moe["down_proj"].get_value().spec == P(None, "expert", "tensor", "fsdp")
    assert moe["router"].get_value().spec == P(None, "fsdp", "expert")
    attn = shardings["stacks"][0]["layer"]["self_attn"]
    assert attn["q_proj"].get_value().spec == P(None, "fsdp", "tensor", None)
    assert attn["o_proj"].get_value().spec == P(None, "tensor", None, "fsdp")
    assert shardings["norm"]["scale"].get_value().spec == P(None)

    # Usable as jit in/out shardings for real params.
    _, params = nnx.split(model_lib.Transformer(model_config.get("tiny"), rngs=nnx.Rngs(0)))
    placed = jax.jit(lambda s: jax.tree.map(lambda x: x * 2, s), in_shardings=(shardings,), out_shardings=shardings)(
        params
    )
    w = placed["stacks"][1]["layer"]["mlp"]["up_proj"].get_value()
    assert w.sharding.spec == P(None, "expert", "fsdp", "tensor")
    np.testing.assert_allclose(w, 2 * params["stacks"][1]["layer"]["mlp"]["up_proj"].get_value())


@pytest.mark.parametrize("pure_dict", [False, True], ids=["nnx-state", "pure-dict"])
def test_opt_state_shardings(abstract, pure_dict):
    _, _, state = abstract
    mesh = sharding.make_mesh(fsdp=2, expert=2, tensor=2)
    shardings = sharding.param_shardings(mesh, state)
    if pure_dict:
        state, shardings = nnx.to_pure_dict(state), nnx.to_pure_dict(shardings)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    opt_abstract = jax.eval_shape(tx.init, state)
    opt_shardings = sharding.opt_state_shardings(mesh, opt_abstract, shardings)
    assert jax.tree.structure(opt_shardings) == jax.tree.structure(opt_abstract)
    adam = opt_shardings[1][0]
    assert jax.tree.leaves(adam.mu) == jax.tree.leaves(shardings)
    assert jax.tree.leaves(adam.nu) == jax.tree.leaves(shardings)
    assert adam.count.spec == P()


def test_opt_state_mismatched_rank_is_replicated():
    mesh = sharding.make_mesh(tensor=2)
    params = {"w": jax.ShapeDtypeStruct((4, 6), jnp.float32)}
    shardings = {"w": NamedSharding(mesh, P(None, "tensor"))}
    opt = {
        "stats": {"w": jax.ShapeDtypeStruct((4,), jnp.float32)},
        "mu": params,
        "odd": {"w": jax.ShapeDtypeStruct((4, 3), jnp.float32)},
    }
    out = sharding.opt_state_shardings(mesh, opt, shardings)
    assert out["mu"]["w"].spec == P(None, "tensor")
    assert out["stats"]["w"].spec == P()
    assert out["odd"]["w"].spec == P()  # 3 is not divisible by tensor=2


def test_batch_and_cache_shardings():
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    assert sharding.batch_sharding(mesh, 2).spec == P(("data", "fsdp", "expert"), None)
    cache = jax.eval_shape(lambda: model_lib.init_cache(model_config.get("tiny"), 4, 16))
    cs = sharding.cache_shardings(mesh, cache)
    assert isinstance(cs, model_lib.KVCache)
    assert len(cs.k) == len(cs.v) == model_config.get("tiny").num_layers
    assert all(x.spec == P(("data", "fsdp", "expert"), "tensor", None, None) for x in cs.k + cs.v)
    assert cs.positions.spec == P(("data", "fsdp", "expert"), None)
    assert cs.index.spec == P()
    placed = jax.device_put(model_lib.init_cache(model_config.get("tiny"), 4, 16), cs)
    assert all(x.sharding.spec == want.spec for x, want in zip(placed.k + placed.v, cs.k + cs.v))


def test_a_mesh_on_part_of_the_devices_warns_in_one_line_naming_the_idle_ones(caplog):
    assert len(jax.local_devices()) == 8  # conftest's fake CPU devices
    with caplog.at_level(logging.WARNING, logger="gspo_jax.sharding"):
        idle = sharding.warn_idle_devices(sharding.mesh_from_config(data=2, fsdp=1, expert=1, tensor=1))
    assert idle == jax.local_devices()[2:]
    [message] = [r.getMessage() for r in caplog.records]
    assert message == (
        "the mesh {'data': 2, 'fsdp': 1, 'expert': 1, 'tensor': 1} uses 2 of this process's 8 devices; "
        "idle: cpu:2, cpu:3, cpu:4, cpu:5, cpu:6, cpu:7 (set a mesh axis to -1 to use them all)"
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gspo_jax.sharding"):
        assert sharding.warn_idle_devices(sharding.mesh_from_config(data=2, fsdp=-1, expert=1, tensor=1)) == []
    assert not caplog.records  # a mesh over every device: silent


def test_a_partial_traced_under_a_mesh_is_named_by_its_function():
    """Compile tables (`benchmarks.suite_compiles`, profiles) name a program by its function: a partial
    (the warm start's SFT step) is named by the function it binds, not by the wrapper."""

    def scale(k, x):
        return k * x

    mesh = sharding.make_mesh(data=2)
    traced = sharding.under_mesh(functools.partial(scale, 3.0), mesh)
    assert traced.__name__ == "scale"
    assert "@jit_scale" in jax.jit(traced).lower(1.0).as_text()
    assert float(jax.jit(traced)(2.0)) == 6.0
    plain = sharding.under_mesh(scale, mesh)
    assert plain.__name__ == "scale" and "@jit_scale" in jax.jit(plain).lower(1.0, 2.0).as_text()

"""Compile options and background compilation (`gspo_jax.compiles`)."""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from gspo_jax import compiles, train
from gspo_jax.config import base_config, build
from gspo_jax.sharding import mesh_from_config
from gspo_jax.validation import ConfigError


def _f(scale, x_NK, w_KM):
    h_NM = x_NK @ w_KM
    return jax.nn.log_softmax(jax.nn.silu(h_NM) * h_NM * scale, axis=-1)


def test_background_compiles_once_and_runs_only_that_executable(compile_counter):
    """A Background program equals the jitted one, compiles once for all its calls, and refuses
    arguments of another shape (TypeError) instead of compiling again."""
    jitted = jax.jit(_f, static_argnums=0)
    x, w = jnp.arange(12.0).reshape(3, 4) / 10, jnp.ones((4, 5)) / 4
    x1, x2 = x + 1, x[:2]
    want, want1 = jitted(2.0, x, w), jitted(2.0, x1, w)
    jax.clear_caches()
    compile_counter.reset()
    abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, w)]
    program = compiles.Background(functools.partial(jitted, 2.0), *abstract)
    np.testing.assert_array_equal(program(x, w), want)
    np.testing.assert_array_equal(program(x1, w), want1)
    assert compile_counter.count == 1
    compile_counter.reset()
    with pytest.raises(TypeError, match="differ from the types for which this computation was compiled"):
        program(x2, w)
    assert program(x, w).shape == (3, 5) and compile_counter.count == 0


def test_step_options_reach_xla_and_keep_the_suites_O0():
    """Fast compile on CPU: XLA's older loop emitters (a different compiled program, the same values),
    and no -O1 where JAX_DISABLE_MOST_OPTIMIZATIONS (this suite's -O0) is on; XLA's defaults when off."""
    assert compiles.step_options(False) is None
    assert compiles.step_options(True) == {"xla_cpu_use_fusion_emitters": False}  # conftest: -O0 stays
    x, w = (jax.ShapeDtypeStruct(s, jnp.float32) for s in ((64, 128), (128, 128)))
    fast = jax.jit(_f, static_argnums=0, compiler_options=compiles.step_options(True)).lower(2.0, x, w).compile()
    default = jax.jit(_f, static_argnums=0).lower(2.0, x, w).compile()
    assert fast.as_text() != default.as_text()
    xv, wv = np.random.default_rng(0).normal(size=(2, 128, 128)).astype(np.float32)
    np.testing.assert_allclose(fast(xv[:64], wv), default(xv[:64], wv), rtol=1e-5, atol=1e-5)


def test_the_trainers_programs_compile_with_the_configs_options():
    """`cpu_fast_compile` changes what the trainer's programs compile to (here its scoring forward)."""
    texts = []
    for fast in (True, False):
        c = base_config("gspo", "tiny")
        c.cpu_fast_compile = fast
        built = build(c)
        mesh = mesh_from_config(**c.mesh)
        graphdef, params = train.init_policy(c, built.model, mesh)
        score = train.compile_programs(c, built, graphdef, params, mesh).score
        tokens = jax.ShapeDtypeStruct((8, 32), jnp.int32)
        texts.append(score.func.lower(*score.args, params, tokens, tokens).compile().as_text())
    assert texts[0] != texts[1]


def test_cpu_fast_compile_must_be_a_bool():
    d = base_config("gspo", "tiny").to_dict()
    d["cpu_fast_compile"] = "no"  # a config read back from JSON: ConfigDict's own type check is bypassed
    with pytest.raises(ConfigError, match=r"config.cpu_fast_compile='no' is not allowed; True or False"):
        build(ml_collections.ConfigDict(d))

"""Compile options and background compilation (`gspo_jax.compiles`)."""

import logging

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from gspo_jax import compiles
from gspo_jax import programs as programs_lib
from gspo_jax.built import build
from gspo_jax.config import base_config
from gspo_jax.sharding import mesh_from_config
from gspo_jax.validation import ConfigError


def _f(scale, x_NK, w_KM):
    h_NM = x_NK @ w_KM
    return jax.nn.log_softmax(jax.nn.silu(h_NM) * h_NM * scale, axis=-1)


def test_background_compiles_once_and_runs_only_that_executable(compile_counter):
    """A program compiled in the background equals the jitted one, compiles once for all its calls, and refuses
    arguments of another shape (TypeError) instead of compiling again."""
    jitted = jax.jit(_f, static_argnums=0)
    x, w = jnp.arange(12.0).reshape(3, 4) / 10, jnp.ones((4, 5)) / 4
    x1, x2 = x + 1, x[:2]
    want, want1 = jitted(2.0, x, w), jitted(2.0, x1, w)
    jax.clear_caches()
    compile_counter.reset()
    abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, w)]
    program = compiles.Program(jitted, 2.0).in_background(*abstract)
    np.testing.assert_array_equal(program(x, w), want)
    np.testing.assert_array_equal(program(x1, w), want1)
    assert compile_counter.count == 1
    compile_counter.reset()
    with pytest.raises(TypeError, match="differ from the types for which this computation was compiled"):
        program(x2, w)
    assert program(x, w).shape == (3, 5) and compile_counter.count == 0


def test_step_options_keep_the_suites_O0_and_the_same_values():
    """Fast compile on CPU: no -O1 where JAX_DISABLE_MOST_OPTIMIZATIONS (this suite's -O0) is on; XLA's
    defaults when off; the same values as the default program, and where this XLA still has the older
    loop emitters, a different compiled program."""
    assert compiles.step_options(False) is None
    assert compiles.run_once_options() is None  # conftest: -O0 stays for random init too
    fast_options = compiles.step_options(True)  # conftest: -O0 stays
    assert fast_options == compiles.supported({"xla_cpu_use_fusion_emitters": False})
    x, w = (jax.ShapeDtypeStruct(s, jnp.float32) for s in ((64, 128), (128, 128)))
    fast = jax.jit(_f, static_argnums=0, compiler_options=fast_options).lower(2.0, x, w).compile()
    default = jax.jit(_f, static_argnums=0).lower(2.0, x, w).compile()
    assert (fast.as_text() != default.as_text()) == bool(fast_options)
    xv, wv = np.random.default_rng(0).normal(size=(2, 128, 128)).astype(np.float32)
    np.testing.assert_allclose(fast(xv[:64], wv), default(xv[:64], wv), rtol=1e-5, atol=1e-5)


def test_every_compile_option_the_project_passes_is_known_to_this_xla(fully_optimised):
    """What the project passes (fast-compile options for every program kind, -O0 suite or not)
    compiles under the installed XLA: an option it does not know would raise here, as it did when
    jax 0.12 dropped `xla_cpu_use_fusion_emitters`."""
    x = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    passed = [compiles.run_once_options(), compiles.step_options(True)]
    jax.config.update("jax_disable_most_optimizations", True)
    passed.append(compiles.step_options(True))
    jax.config.update("jax_disable_most_optimizations", False)
    assert passed[0] == compiles.supported(compiles.FAST_CPU_COMPILE)  # a real run's init: the fast options
    for options in passed:
        assert set(options) <= set(compiles.FAST_CPU_COMPILE)
        assert all(compiles.xla_knows(k, v) for k, v in options.items())
        jax.jit(_f, static_argnums=0, compiler_options=options).lower(2.0, x, x).compile()
    assert compiles.xla_knows("xla_backend_optimization_level", 1)  # kept on every XLA this project supports


def test_unknown_options_are_dropped_with_one_debug_line_and_count_no_compile(caplog, compile_counter):
    with pytest.raises(Exception, match="No such compile option"):  # what XLA does with one
        jax.jit(lambda a: a * 2, compiler_options={"xla_gspo_jax_no_such_option": 1}).lower(1.0).compile()
    compile_counter.reset()
    with caplog.at_level(logging.DEBUG, logger="gspo_jax.compiles"):
        kept = compiles.supported({"xla_gspo_jax_no_such_option": 1, "xla_backend_optimization_level": 1})
    assert kept == {"xla_backend_optimization_level": 1}
    dropped = [r for r in caplog.records if "xla_gspo_jax_no_such_option" in r.getMessage()]
    assert len(dropped) == 1 and dropped[0].levelno == logging.DEBUG
    assert compile_counter.count == 0  # the probe compiles are not the run's
    assert compiles.supported(None) is None


def test_the_trainers_programs_compile_with_the_configs_options(monkeypatch):
    """`cpu_fast_compile` decides the options the trainer's programs (here its scoring forward) are
    compiled with: an option XLA does not know, put in `step_options` for the test, reaches XLA (and
    fails the compile) exactly when the config asks for fast compile."""
    probe = {"xla_gspo_jax_probe_option": 1}
    monkeypatch.setattr(compiles, "step_options", lambda fast: dict(probe) if fast else None)
    for fast in (True, False):
        c = base_config("gspo", "tiny")
        c.cpu_fast_compile = fast
        built = build(c)
        mesh = mesh_from_config(**c.mesh)
        graphdef, params = programs_lib.init_policy(built, mesh)
        score = programs_lib.compile_programs(built, graphdef, params, mesh).score
        tokens = jax.ShapeDtypeStruct((8, 32), jnp.int32)
        lowered = score.lower(params, tokens, tokens)
        if fast:
            with pytest.raises(Exception, match="xla_gspo_jax_probe_option"):
                lowered.compile()
        else:
            lowered.compile()


def test_cpu_fast_compile_must_be_a_bool():
    d = base_config("gspo", "tiny").to_dict()
    d["cpu_fast_compile"] = "no"  # a config read back from JSON: ConfigDict's own type check is bypassed
    with pytest.raises(ConfigError, match=r"config.cpu_fast_compile='no' is not allowed; True or False"):
        build(ml_collections.ConfigDict(d))

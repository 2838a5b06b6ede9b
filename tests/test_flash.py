"""The fused attention path (`gspo_jax.flash`): its reordering of each row's real tokens plus a causal
padding mask equals the model's own mask, values and gradients, checked on a CPU with JAX's reference
of the same `dot_product_attention` call (cuDNN's kernel itself needs a GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gspo_jax import flash, model_config
from gspo_jax import model as model_lib


def batch(T=12):
    # Left-padded prompts with completions padded after EOS, a row with no padding, one real token.
    real = np.zeros((4, T), bool)
    real[0, 3:10] = True
    real[1, :] = True
    real[2, 5:6] = True
    real[3, 1:T] = True
    tokens = np.where(real, np.random.default_rng(0).integers(4, 64, (4, T)), 0).astype(np.int32)
    return jnp.asarray(tokens), jnp.asarray(real), model_lib.positions_from_mask(jnp.asarray(real))


def loss_and_grads(cfg, tokens, real, positions):
    graphdef, state = nnx.split(model_lib.Transformer(cfg, rngs=nnx.Rngs(0)))

    def loss(state):
        logits, _ = nnx.merge(graphdef, state)(tokens, positions)
        return jnp.sum(jnp.where(real[..., None], jnp.sin(logits), 0.0)), logits

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(state)


def test_fused_attention_equals_the_einsum_path_values_and_gradients(monkeypatch):
    cfg = model_config.get("tiny", vocab_size=64)  # grouped-query: 4 heads over 2 key/value heads
    tokens, real, positions = batch()
    (want_loss, want_logits), want_grads = loss_and_grads(cfg, tokens, real, positions)
    monkeypatch.setattr(flash, "implementation", lambda platform, dtype, head_dim: "xla")
    (loss, logits), grads = loss_and_grads(cfg, tokens, real, positions)
    np.testing.assert_allclose(
        np.asarray(logits)[np.asarray(real)], np.asarray(want_logits)[np.asarray(real)], atol=2e-5
    )
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-4)


def test_padded_queries_read_nothing_and_pass_no_gradient():
    tokens, real, positions = batch()
    q, k, v = (jax.random.normal(jax.random.key(i), (4, 12, 2, 8)) for i in range(3))
    f = lambda q, k, v: flash.attend(q, k, v, positions, implementation="xla")
    out = f(q, k, v)
    assert np.all(np.asarray(out)[~np.asarray(real)] == 0.0)
    grads = jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 2))(q, k, v)
    for g in grads:
        assert np.all(np.isfinite(g)) and np.all(np.asarray(g)[~np.asarray(real)] == 0.0)


def test_the_fused_kernel_is_cudnn_on_a_gpu_in_16_bits_at_head_widths_it_takes():
    assert flash.implementation("gpu", jnp.bfloat16) == "cudnn"
    assert flash.implementation("gpu", jnp.float16) == "cudnn"
    assert flash.implementation("gpu", jnp.float32) is None  # cuDNN's flash kernel takes no float32
    assert flash.implementation("cpu", jnp.bfloat16) is None
    assert flash.implementation("tpu", jnp.bfloat16) is None
    assert flash.implementation("gpu", jnp.bfloat16, head_dim=64) == "cudnn"
    assert flash.implementation("gpu", jnp.bfloat16, head_dim=12) is None  # not a multiple of 8
    assert flash.implementation("gpu", jnp.bfloat16, head_dim=256) is None  # wider than measured

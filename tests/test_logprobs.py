"""The log-prob head (gspo_jax/logprobs.py): token log-probs against float64, and the LM head in chunks of
positions against the whole [B, T, V] logits, in values, gradients and memory."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

from gspo_jax import logprobs
from gspo_jax.logprobs import token_logprobs


class TestTokenLogprobs(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_token_logprobs_match_float64_log_softmax(self):
        rng = np.random.default_rng(13)
        logits = rng.normal(0, 3, (2, 5, 11))
        tokens = rng.integers(0, 11, (2, 5))
        for temp in (1.0, 0.7):
            z = logits / temp
            ref = z - np.log(np.exp(z).sum(-1, keepdims=True))
            expect = np.take_along_axis(ref, tokens[..., None], -1)[..., 0]
            got = self.variant(token_logprobs)(jnp.asarray(logits, jnp.bfloat16).astype(jnp.float32), tokens, temp)
            np.testing.assert_allclose(got, expect, atol=0.05)  # bf16-rounded logits
            got = self.variant(token_logprobs)(jnp.asarray(logits, jnp.float32), tokens, temp)
            np.testing.assert_allclose(got, expect, atol=1e-5)
        out = token_logprobs(jnp.asarray(logits, jnp.bfloat16), tokens)
        assert out.dtype == jnp.float32


class TestChunkedLogprobs(parameterized.TestCase):
    """`sequence_logprobs_from_hidden`: the LM head and log-softmax in chunks of positions give the same
    log-probs and gradients as the whole [B, T, V] logits, and hold only a chunk's logits at a time."""

    @staticmethod
    def inputs(B=3, T=13, D=8, V=50, seed=0):
        k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
        h = jax.random.normal(k1, (B, T, D))
        head = jax.random.normal(k2, (D, V)) * 0.7
        tokens = jax.random.randint(k3, (B, T), 0, V)
        return h, head, tokens

    @parameterized.parameters(0, 1, 4, 5, 13, 40)  # none, every position, uneven tail, exact, one, longer than T
    def test_values_and_gradients_match_the_full_logits(self, chunk):
        h, head, tokens = self.inputs()
        w = jax.random.normal(jax.random.key(9), tokens.shape)  # a random linear loss on the log-probs

        def full(h, head):
            return logprobs.sequence_logprobs(jnp.einsum("btd,dv->btv", h, head), tokens, 0.8)

        def chunked(h, head):
            return logprobs.sequence_logprobs_from_hidden(h, head, tokens, 0.8, chunk)

        want, got = jax.jit(full)(h, head), jax.jit(chunked)(h, head)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(got[:, 0], 0.0)  # nothing predicts position 0
        grad = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1)))(h, head)
        g_want, g_got = grad(full), grad(chunked)
        chex.assert_trees_all_close(g_got, g_want, rtol=1e-5, atol=1e-6)

    def test_bfloat16_backward_matmuls_stay_bfloat16_and_match_float32(self):
        """With a bfloat16 head the backward's two vocabulary-wide matmuls take bfloat16 operands (float32
        accumulation), not float32 ones, and the gradients match the float32 computation to bfloat16
        precision."""
        h, head, tokens = self.inputs(B=2, T=16, D=32, V=256)
        w = jax.random.normal(jax.random.key(9), tokens.shape)

        def grad(h, head):
            loss = lambda h, head: jnp.sum(logprobs.sequence_logprobs_from_hidden(h, head, tokens, 1.0, 4) * w)
            return jax.jit(jax.grad(loss, argnums=(0, 1)))

        bf = lambda x: x.astype(jnp.bfloat16)
        hlo = grad(bf(h), bf(head)).lower(bf(h), bf(head)).as_text()
        dots = [line for line in hlo.splitlines() if "stablehlo.dot_general" in line]
        assert len(dots) >= 3 and all("f32>, tensor" not in d.split("->")[0] for d in dots), dots
        g16 = grad(bf(h), bf(head))(bf(h), bf(head))
        g32 = grad(h, head)(bf(h).astype(jnp.float32), bf(head).astype(jnp.float32))
        for a, b in zip(g16, g32):
            assert a.dtype == jnp.bfloat16
            np.testing.assert_allclose(np.asarray(a, np.float32), b, atol=0.02 * float(jnp.max(jnp.abs(b))))

    def test_a_chunk_of_logits_is_all_the_backward_pass_holds(self):
        """The compiled gradient's temporaries: the whole [B, T, V] float32 logits without chunking,
        a fraction of them with 8 of 128 positions at a time."""
        B, T, D, V = 2, 128, 16, 4096
        h, head, tokens = self.inputs(B, T, D, V)
        logits_bytes = B * T * V * 4

        def temp_bytes(chunk):
            loss = lambda h, head: jnp.sum(logprobs.sequence_logprobs_from_hidden(h, head, tokens, 1.0, chunk))
            compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(h, head).compile()
            return compiled.memory_analysis().temp_size_in_bytes

        assert temp_bytes(0) >= logits_bytes
        assert temp_bytes(8) < logits_bytes / 4

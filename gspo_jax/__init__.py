"""gspo_jax: critic-free RL (GRPO, DAPO, GSPO, ...) for sparse-MoE language models in JAX."""

__version__ = "0.1.0"

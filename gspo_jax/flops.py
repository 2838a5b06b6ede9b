"""Analytic useful FLOPs of the policy's programs: what MFU and the implied step times are measured
against, never XLA's `cost_analysis` (it counts a loop body once).

A matmul of [m, k] × [k, n] is 2·m·k·n. A forward over B sequences of T tokens is 2 × (active matmul
parameters) × B·T plus attention, 4 × layers × B × T² × H × W (QKᵀ and PV); a backward is twice a
forward, so a train step is 6 × parameters × tokens plus 12 × layers × B × T² × H × W (under LoRA 4 × the
frozen base's and 6 × the adapters').
"""

import dataclasses

from gspo_jax import model as model_lib
from gspo_jax.lora import LoraConfig
from gspo_jax.model_config import ModelConfig


def matmul_params(cfg: ModelConfig) -> int:
    """Active parameters that take part in a matmul per token (embedding lookups excluded)."""
    _, active = model_lib.count_params(cfg)
    return active - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.embed_dim)


def forward_flops(cfg: ModelConfig, B: int, T: int) -> float:
    """One forward over B × T tokens (causal attention counted in full, as is usual)."""
    attention = 4 * cfg.num_layers * B * T * T * cfg.num_heads * cfg.head_dim
    return 2 * matmul_params(cfg) * B * T + attention


def train_flops(cfg: ModelConfig, B: int, T: int) -> float:
    """Forward and backward over B × T tokens: three forwards. Under LoRA the frozen base's weight
    gradients are never computed: its matmuls count twice a forward's (forward, input gradients), the
    adapters' three times."""
    if not cfg.lora.on:
        return 3 * forward_flops(cfg, B, T)
    base = matmul_params(dataclasses.replace(cfg, lora=LoraConfig()))
    return 3 * forward_flops(cfg, B, T) - 2 * base * B * T


def critic_train_flops(cfg: ModelConfig, B: int, T: int) -> float:
    """PPO's critic update over B × T tokens (`gspo_jax/critic.py`): its trunk without an LM head and a
    value head of width 1, forward and backward."""
    untied = dataclasses.replace(cfg, tie_embeddings=False)
    trunk = matmul_params(untied) - cfg.vocab_size * cfg.embed_dim + cfg.embed_dim
    attention = 4 * cfg.num_layers * B * T * T * cfg.num_heads * cfg.head_dim
    return 3 * (2 * trunk * B * T + attention)


def sample_flops(cfg: ModelConfig, B: int, P: int, C: int) -> float:
    """Prefill of P prompt tokens, then C decoded tokens each attending over the P + C cache slots."""
    decode = 2 * matmul_params(cfg) * B * C + 4 * cfg.num_layers * B * C * (P + C) * cfg.num_heads * cfg.head_dim
    return forward_flops(cfg, B, P) + decode

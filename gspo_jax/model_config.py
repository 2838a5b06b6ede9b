"""The policy's architecture, `ModelConfig`, and the one table of model sizes, `SIZES`.

A size names a `ModelConfig`: `config.base_config(algorithm, size)` starts a run's `config.model` from
`SIZES[size]` (and sets the size's lengths, batch and mesh); tests and benchmarks take `get(size, ...)`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gspo_jax.dispatch import DISPATCHES
from gspo_jax.lora import LoraConfig, check_targets
from gspo_jax.validation import check, check_choice, check_int, check_number

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# What a layer keeps for the backward pass: "none" keeps every intermediate; "full" keeps only the
# layer's input and recomputes the rest; "save_dots" keeps matmul outputs; "save_dots_no_batch" keeps
# those without batch dimensions (projections, not attention scores).
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.checkpoint_dots,
    "save_dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of the policy. Validated at construction (ValueError names the field)."""

    vocab_size: int = 128
    embed_dim: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    qk_norm: bool = True
    rope_theta: float = 10_000.0
    rms_eps: float = 1e-6
    mlp_dim: int = 128  # dense FFN width (layers that are not MoE)
    tie_embeddings: bool = False
    # MoE
    num_experts: int = 0  # 0: every layer dense
    top_k: int = 2
    moe_mlp_dim: int = 32
    renormalize_topk: bool = True
    moe_every: int = 1  # like Qwen3-MoE decoder_sparse_step
    dense_layers: tuple[int, ...] = ()  # like Qwen3-MoE mlp_only_layers
    lb_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    # "auto": "sparse" on CPUs, "grouped" on GPUs and TPUs (`dispatch.resolve_dispatch`); or one of those,
    # "dense" (every expert on every token) or "ragged" (`lax.ragged_dot` under autodiff).
    dispatch: str = "auto"
    param_dtype: str = "float32"
    dtype: str = "float32"  # compute dtype; router, softmax and logits are float32 regardless
    # Layers of one kind are stacked and run by `lax.scan`: trace and compile time stay flat in depth.
    # scan_layers=False unrolls the same stacked layers (e.g. for XLA's per-op cost analysis).
    scan_layers: bool = True
    remat: str = "none"  # per-layer rematerialisation in the backward pass: one of REMAT_POLICIES
    # Log-probs (scoring and the loss) run the LM head over this many positions at a time, so [B, T, V]
    # float32 logits never exist at once (`logprobs.sequence_logprobs_from_hidden`); 0: all at once.
    logprob_chunk: int = 0
    # The scoring forward (π_old, π_ref, drift: `model.score`) and the sampler's prefill run the batch as
    # this many chunks, one after another, so their activations are a chunk's; 1: the whole batch at once.
    batch_chunks: int = 1
    # Low-rank adapters (`gspo_jax/lora.py`): not a `config.model` key (`CONFIG_KEYS`); `built.build` sets it
    # from the `config.lora` section. The default (rank 0) adds nothing.
    lora: LoraConfig = LoraConfig()

    def __post_init__(self):
        object.__setattr__(self, "dense_layers", tuple(int(i) for i in self.dense_layers))

        own = "ModelConfig"
        for f in ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "moe_every"):
            check_int(own, f, getattr(self, f), low=1)
        check(self.head_dim % 2 == 0, own, "head_dim", self.head_dim, "it must be even (RoPE rotates pairs)")
        check(
            self.num_heads % self.num_kv_heads == 0,
            own,
            "num_heads",
            self.num_heads,
            f"it must be divisible by num_kv_heads={self.num_kv_heads}",
        )
        check_number(own, "rope_theta", self.rope_theta, low=0.0, strict=True)
        check_number(own, "rms_eps", self.rms_eps, low=0.0, strict=True)
        check_int(own, "num_experts", self.num_experts, low=0)
        for i in self.dense_layers:
            check(0 <= i < self.num_layers, own, "dense_layers", self.dense_layers, f"ids in [0, {self.num_layers})")
        if self.num_experts > 0:
            check(1 <= self.top_k <= self.num_experts, own, "top_k", self.top_k, f"in [1, {self.num_experts}]")
            if self.num_moe_layers:
                check_int(own, "moe_mlp_dim", self.moe_mlp_dim, low=1)
        check_int(own, "mlp_dim", self.mlp_dim, low=1 if self.num_moe_layers < self.num_layers else 0)
        for f in ("lb_loss_coef", "z_loss_coef"):
            check_number(own, f, getattr(self, f), low=0.0)
        check_choice(own, "dispatch", self.dispatch, DISPATCHES)
        for f in ("param_dtype", "dtype"):
            check_choice(own, f, getattr(self, f), tuple(DTYPES))
        check_choice(own, "remat", self.remat, tuple(REMAT_POLICIES))
        check_int(own, "logprob_chunk", self.logprob_chunk, low=0)
        check_int(own, "batch_chunks", self.batch_chunks, low=1)
        if isinstance(self.lora, dict):  # as `dataclasses.asdict` writes it (e.g. a model_config.json)
            object.__setattr__(self, "lora", LoraConfig(**self.lora))
        check(isinstance(self.lora, LoraConfig), own, "lora", self.lora, "a lora.LoraConfig")
        check_targets(self.lora, self.num_moe_layers > 0, own)

    def is_moe_layer(self, i: int) -> bool:
        """Qwen3-MoE rule: MoE iff experts exist, (i+1) % moe_every == 0 and i not in dense_layers."""
        return self.num_experts > 0 and (i + 1) % self.moe_every == 0 and i not in self.dense_layers

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layer_ids)

    @property
    def layer_runs(self) -> tuple[tuple[int, int], ...]:
        """(first layer, count) of each run of consecutive layers of one kind (dense or MoE): the
        model's stacks, one parameter stack and one scan each."""
        runs: list[list[int]] = []
        for i in range(self.num_layers):
            if runs and self.is_moe_layer(i) == self.is_moe_layer(runs[-1][0]):
                runs[-1][1] += 1
            else:
                runs.append([i, 1])
        return tuple((first, n) for first, n in runs)

    @property
    def jnp_dtype(self):
        return DTYPES[self.dtype]

    @property
    def jnp_param_dtype(self):
        """The weights' storage dtype: `param_dtype`, or with LoRA on its frozen base's `lora.base_dtype`
        where set (the adapters are float32 whatever it is)."""
        return DTYPES[(self.lora.on and self.lora.base_dtype) or self.param_dtype]


# The fields that are `config.model` keys: all but `lora`, which the `config.lora` section sets.
CONFIG_KEYS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name != "lora")


def config_fields(cfg: ModelConfig) -> dict:
    """`cfg` as `config.model` lays it out (`CONFIG_KEYS`)."""
    return {k: getattr(cfg, k) for k in CONFIG_KEYS}


SIZES: dict[str, ModelConfig] = {
    # Fast on CPU, for tests: layer 0 dense, layers 1-2 MoE (8 experts, top-2).
    "tiny": ModelConfig(
        vocab_size=128,
        embed_dim=64,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        qk_norm=True,
        mlp_dim=128,
        num_experts=8,
        top_k=2,
        moe_mlp_dim=32,
        dense_layers=(0,),
        lb_loss_coef=0.01,
        z_loss_coef=0.001,
    ),
    # Learns in minutes on 2 CPU cores: layer 0 dense, layers 1-3 MoE (8 experts, top-2).
    "default": ModelConfig(
        vocab_size=128,
        embed_dim=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        mlp_dim=256,
        num_experts=8,
        top_k=2,
        moe_mlp_dim=128,
        dense_layers=(0,),
        lb_loss_coef=0.01,
        z_loss_coef=0.001,
    ),
    # Qwen/Qwen3-30B-A3B (the TPU shape): 48 MoE layers, 128 experts, top-8.
    "qwen3_30b_a3b": ModelConfig(
        vocab_size=151936,
        embed_dim=2048,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        qk_norm=True,
        rope_theta=1e6,
        rms_eps=1e-6,
        mlp_dim=6144,
        tie_embeddings=False,
        num_experts=128,
        top_k=8,
        moe_mlp_dim=768,
        renormalize_topk=True,
        moe_every=1,
        lb_loss_coef=0.001,
        dispatch="auto",
        param_dtype="bfloat16",
        dtype="bfloat16",
    ),
}


def get(size: str, **overrides) -> ModelConfig:
    """`SIZES[size]` with fields overridden (re-validated)."""
    if size not in SIZES:
        raise ValueError(f"model_config.get: unknown size {size!r}; known {tuple(SIZES)}")
    return dataclasses.replace(SIZES[size], **overrides)

"""A LoRA run's adapters in Hugging Face PEFT's format (`adapter_config.json` + `adapter_model.safetensors`),
which `peft.PeftModel.from_pretrained` loads onto the transformers model of the run's base.

Attention and dense-MLP projections are `nn.Linear`s there (attention: PEFT's `target_modules`; the dense
MLP's weights: `target_parameters`, see `peft_config`): lora_A [r, in] and lora_B [out, r] are our
A [in, r] and B [r, out] transposed (the per-head axes flattened). Routers and experts are `nn.Parameter`s
in transformers v5 (`mlp.gate.weight` [E, D]; `mlp.experts.gate_up_proj` [E, 2M, D], gate rows first;
`mlp.experts.down_proj` [E, D, M]), PEFT's `target_parameters` (`lora.ParamWrapper`). For a 3-D parameter
[E, out, in] PEFT (0.21) adds ΔW[e] = s·Σ_k B[:, k·E+e] ⊗ A[e·r+k, :] to W[e], A's rows expert-major and
B's columns rank-major. transformers fuses gate and up into one parameter while each has its own pair
here, so that adapter has rank 2r (gate's ranks first, each pair's B zero on the other's rows) and α
doubled (`rank_pattern`, `alpha_pattern`): the same update, exactly. A parameter that holds two targets
nests one wrapper in the other: the experts' gate_up_proj pair is saved under `mlp.experts.base_layer`,
down_proj's under `mlp.experts`. No torch is needed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from gspo_jax import hf
from gspo_jax.model_config import ModelConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModel's prefix on the transformers model's own names
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
DENSE_MLP = ("gate_proj", "up_proj", "down_proj")
MODEL_TYPES = (
    "qwen3_moe",
    "mixtral",
)  # transformers v5 names both models' MoE blocks alike (`mlp.gate`, `mlp.experts`)
EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def _check(cfg: ModelConfig, model_type: str) -> None:
    if not cfg.lora.on:
        raise ValueError("hf_lora: the model has no adapters (lora.rank=0)")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"hf_lora: model_type={model_type!r} is not allowed; allowed: {MODEL_TYPES}")


def _linear(a_IR: np.ndarray, b_RO: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """PEFT's (lora_A.weight [r, in], lora_B.weight [out, r]) from our A [*ins, r], B [r, *outs]."""
    r = a_IR.shape[-1]
    return a_IR.reshape(-1, r).T, b_RO.reshape(r, -1).T


def _experts(a_EIR: np.ndarray, b_ERO: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ParamWrapper's (A [E·r, I], B [O, r·E]) for transformers' [E, O, I] expert weight, from our
    per-expert pairs A [E, I, r], B [E, r, O]: PEFT's ΔW[e] = s·Σ_k B[:, k·E+e] ⊗ A[e·r+k, :] is
    s·(A_e·B_e)ᵀ when A's row e·r+k is A_e[:, k] and B's column k·E+e is B_e[k]."""
    E, n_in, r = a_EIR.shape
    return a_EIR.transpose(0, 2, 1).reshape(E * r, n_in), b_ERO.transpose(2, 1, 0).reshape(-1, r * E)


def _stack_ranks(*pairs: tuple[np.ndarray, np.ndarray], experts: int) -> tuple[np.ndarray, np.ndarray]:
    """One ParamWrapper pair of rank n·r from n pairs (A [E·r, I], B [O_j, r·E]) whose outputs are
    stacked (transformers' fused gate_up): A's per-expert ranks side by side, B block-diagonal."""
    E, n = experts, len(pairs)
    r, n_in = pairs[0][0].shape[0] // E, pairs[0][0].shape[1]
    a = np.zeros((E, n * r, n_in), np.float32)
    b = np.zeros((sum(pb.shape[0] for _, pb in pairs), n * r, E), np.float32)
    row = 0
    for j, (pa, pb) in enumerate(pairs):
        a[:, j * r : (j + 1) * r] = pa.reshape(E, r, n_in)
        b[row : row + pb.shape[0], j * r : (j + 1) * r] = pb.reshape(-1, r, E)
        row += pb.shape[0]
    return a.reshape(E * n * r, n_in), b.reshape(row, n * r * E)


def to_peft(adapters: Mapping[hf.ParamPath, np.ndarray], cfg: ModelConfig, model_type: str) -> dict[str, np.ndarray]:
    """PEFT's tensors (its names, float32) from our adapters' per-layer arrays (`hf.stacked_to_layers`
    of the adapters' `hf.state_to_params`): ("layers", i, ..., "<weight>_lora", "a" | "b")."""
    _check(cfg, model_type)
    out: dict[str, np.ndarray] = {}

    def put(name: str, a: np.ndarray, b: np.ndarray) -> None:
        out[f"{PREFIX}{name}.lora_A.weight"] = np.ascontiguousarray(a, np.float32)
        out[f"{PREFIX}{name}.lora_B.weight"] = np.ascontiguousarray(b, np.float32)

    def pair(*path) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(adapters[(*path, "a")], np.float32), np.asarray(adapters[(*path, "b")], np.float32)

    lora = cfg.lora
    for i in range(cfg.num_layers):
        p, ours = f"model.layers.{i}", ("layers", i)
        if lora.adapts("attention"):
            for w in ATTENTION:
                put(f"{p}.self_attn.{w}", *_linear(*pair(*ours, "self_attn", f"{w}_lora")))
        if not cfg.is_moe_layer(i):
            if lora.adapts("mlp"):
                for w in DENSE_MLP:
                    put(f"{p}.mlp.{w}", *_linear(*pair(*ours, "mlp", f"{w}_lora")))
            continue
        if lora.adapts("router"):
            put(f"{p}.mlp.gate", *_linear(*pair(*ours, "mlp", "router_lora")))
        if lora.adapts("experts"):
            gate = _experts(*pair(*ours, "mlp", "gate_proj_lora"))
            up = _experts(*pair(*ours, "mlp", "up_proj_lora"))
            put(f"{p}.mlp.experts.base_layer", *_stack_ranks(gate, up, experts=cfg.num_experts))
            put(f"{p}.mlp.experts", *_experts(*pair(*ours, "mlp", "down_proj_lora")))
    return out


def peft_config(cfg: ModelConfig, model_type: str, base_model_name_or_path: str = "") -> dict:
    """`adapter_config.json`: PEFT's `LoraConfig` for `to_peft`'s tensors (dropout 0, no bias, plain α/r)."""
    _check(cfg, model_type)
    lora = cfg.lora
    modules = [*(ATTENTION if lora.adapts("attention") else ())]
    parameters = []
    if lora.adapts("mlp") and any(not cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
        # As parameters: PEFT on transformers v5 reads the module names gate_proj / up_proj / down_proj of a
        # Qwen-MoE model as its (v4) experts' and retargets them to the fused experts, the dense layers' lost.
        parameters += [f"mlp.{w}.weight" for w in DENSE_MLP]
    if lora.adapts("router"):
        parameters.append("mlp.gate.weight")
    if lora.adapts("experts"):
        parameters += [f"mlp.experts.{w}" for w in EXPERT_PARAMS]
    fused = {"gate_up_proj": 2 * lora.rank} if lora.adapts("experts") else {}
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "rank_pattern": fused,
        "alpha_pattern": {k: 2 * lora.alpha for k in fused},
        "target_modules": modules,
        "target_parameters": parameters,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


def save_peft_adapter(
    directory: str | os.PathLike,
    cfg: ModelConfig,
    adapters: nnx.State,
    model_type: str = "qwen3_moe",
    *,
    base_model_name_or_path: str = "",
) -> list[str]:
    """Writes `adapter_config.json` and `adapter_model.safetensors` for the adapters of a LoRA model
    `cfg` (an `nnx.State` of its `nnx.LoRAParam`s, stacked as the model holds them); returns the names."""
    tensors = to_peft(hf.stacked_to_layers(cfg, hf.state_to_params(adapters)), cfg, model_type)
    config = peft_config(cfg, model_type, base_model_name_or_path)
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(directory, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return [ADAPTER_CONFIG, ADAPTER_WEIGHTS]

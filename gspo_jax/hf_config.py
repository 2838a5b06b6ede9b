"""Hugging Face `config.json` <-> our `ModelConfig`, for Qwen3-MoE and Mixtral: which HF field sets which
of ours (transformers 5 names, v4's read too), what the model cannot do (ValueError naming the HF field),
and which of our fields an HF config does not hold (`RUN_FIELDS`), so that an export can be checked to
load back as the same model (`exportable_config`). The tensors and checkpoint files: `gspo_jax/hf.py`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from gspo_jax.model_config import ModelConfig

MODEL_TYPES = ("qwen3_moe", "mixtral")
ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
_ROPE_THETA_DEFAULT = {"qwen3_moe": 10_000.0, "mixtral": 1_000_000.0}  # transformers 5 defaults


def load_json(path_or_dict: Mapping | str | os.PathLike, filename: str = "config.json") -> dict:
    """A JSON dict as given, or read from a file, or from `filename` in a directory (a checkpoint's config)."""
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict)
    path = os.fspath(path_or_dict)
    if os.path.isdir(path):
        path = os.path.join(path, filename)
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _rope_theta(hf: dict, model_type: str) -> float:
    """rope_theta from transformers 5 `rope_parameters`, or v4 top-level `rope_theta` + `rope_scaling`."""
    params = hf.get("rope_parameters")
    if params is not None:
        if not isinstance(params, Mapping) or any(isinstance(v, Mapping) for v in params.values()):
            raise ValueError(f"config_from_hf: rope_parameters per layer type are not supported, got {params!r}")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise ValueError(
                f"config_from_hf: rope_parameters.rope_type {rope_type!r} is not supported (only 'default')"
            )
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("config_from_hf: rope_parameters.partial_rotary_factor != 1 is not supported")
    scaling = hf.get("rope_scaling")
    if scaling:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"config_from_hf: rope_scaling {rope_type!r} is not supported (only unscaled RoPE)")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("config_from_hf: partial_rotary_factor != 1 is not supported")
    for source in (params or {}, scaling or {}, hf):
        if source.get("rope_theta") is not None:
            return float(source["rope_theta"])
    return _ROPE_THETA_DEFAULT[model_type]


def _param_dtype(hf: dict) -> str:
    """'bfloat16' if the checkpoint says so, else 'float32' (float16 is upcast losslessly)."""
    name = str(hf.get("dtype") or hf.get("torch_dtype") or "float32").removeprefix("torch.")
    return "bfloat16" if name == "bfloat16" else "float32"


def config_from_hf(hf_config: Mapping | str | os.PathLike, **overrides) -> ModelConfig:
    """`ModelConfig` from an HF config dict, config.json or checkpoint directory.

    `overrides` replace fields HF does not describe (dispatch, dtype, z_loss_coef, ...).
    Unsupported model types or features raise ValueError naming the HF field.
    """
    hf = load_json(hf_config)
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"config_from_hf: model_type {model_type!r} is not supported; supported {MODEL_TYPES}")

    def req(field):
        if hf.get(field) is None:
            raise ValueError(f"config_from_hf: {model_type} config is missing required field {field!r}")
        return hf[field]

    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config_from_hf: hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        field = "attention_bias" if hf.get("attention_bias") else "mlp_bias"
        raise ValueError(f"config_from_hf: {field}=True is not supported (no biases)")
    for field in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
        if hf.get(field):
            raise ValueError(f"config_from_hf: {field}={hf[field]!r}: shared experts are not supported")
    if any(t != "full_attention" for t in hf.get("layer_types") or ()):
        raise ValueError(
            f"config_from_hf: layer_types other than 'full_attention' are not supported: {hf['layer_types']}"
        )
    # Sliding-window attention is only an error where the HF model would apply it.
    uses_window = hf.get("sliding_window") is not None
    if model_type == "qwen3_moe":
        uses_window = uses_window and bool(hf.get("use_sliding_window"))
    if uses_window:
        field = "use_sliding_window" if model_type == "qwen3_moe" else "sliding_window"
        raise ValueError(f"config_from_hf: {field}: sliding-window attention is not supported")

    hidden, heads = int(req("hidden_size")), int(req("num_attention_heads"))
    common = dict(
        vocab_size=int(req("vocab_size")),
        embed_dim=hidden,
        num_layers=int(req("num_hidden_layers")),
        num_heads=heads,
        # Mixtral falls back to plain multi-head attention; Qwen3-MoE configs always carry it.
        num_kv_heads=int(
            heads if model_type == "mixtral" and hf.get("num_key_value_heads") is None else req("num_key_value_heads")
        ),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        rope_theta=_rope_theta(hf, model_type),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        top_k=int(req("num_experts_per_tok")),
        # transformers adds this aux loss only with output_router_logits=True; we keep the coefficient.
        lb_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
        param_dtype=_param_dtype(hf),
        dtype=_param_dtype(hf),
    )
    if model_type == "qwen3_moe":
        num_experts = hf.get("num_experts", hf.get("num_local_experts"))  # v5 writes num_local_experts
        if num_experts is None:
            raise ValueError("config_from_hf: qwen3_moe config is missing required field 'num_experts'")
        fields = dict(
            common,
            qk_norm=True,
            rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
            mlp_dim=int(req("intermediate_size")),
            num_experts=int(num_experts),
            moe_mlp_dim=int(req("moe_intermediate_size")),
            renormalize_topk=bool(hf.get("norm_topk_prob", False)),
            moe_every=int(hf.get("decoder_sparse_step", 1)),
            dense_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
        )
    else:  # mixtral: every layer MoE, no q/k norm, top-k always renormalised
        fields = dict(
            common,
            qk_norm=False,
            rms_eps=float(hf.get("rms_norm_eps", 1e-5)),
            mlp_dim=int(req("intermediate_size")),  # unused (no dense layers); matches the preset
            num_experts=int(req("num_local_experts")),
            moe_mlp_dim=int(req("intermediate_size")),
            renormalize_topk=True,
            moe_every=1,
            dense_layers=(),
        )
    fields.update(overrides)
    return ModelConfig(**fields)


def config_to_hf(cfg: ModelConfig, model_type: str = "qwen3_moe", *, extra: Mapping | None = None) -> dict:
    """The HF config.json dict for `cfg` (transformers 5 names, readable by v4 too).

    `extra` is merged last (e.g. bos/eos token ids, max_position_embeddings). Raises
    ValueError naming the `ModelConfig` field the HF architecture cannot express.
    """
    if model_type not in MODEL_TYPES:
        raise ValueError(f"config_to_hf: model_type {model_type!r} is not supported; supported {MODEL_TYPES}")
    hf: dict[str, Any] = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.embed_dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings,
        "num_experts_per_tok": cfg.top_k,
        "router_aux_loss_coef": cfg.lb_loss_coef,
        "sliding_window": None,
        "dtype": cfg.param_dtype,
    }
    if model_type == "qwen3_moe":
        if not cfg.qk_norm:
            raise ValueError("config_to_hf: ModelConfig.qk_norm must be True for qwen3_moe")
        hf.update(
            intermediate_size=cfg.mlp_dim,
            moe_intermediate_size=cfg.moe_mlp_dim,
            num_experts=cfg.num_experts,
            norm_topk_prob=cfg.renormalize_topk,
            decoder_sparse_step=cfg.moe_every,
            mlp_only_layers=list(cfg.dense_layers),
            attention_bias=False,
            use_sliding_window=False,
            max_position_embeddings=32768,
        )
    else:
        if cfg.qk_norm:
            raise ValueError("config_to_hf: ModelConfig.qk_norm must be False for mixtral")
        if cfg.num_experts <= 0 or cfg.num_moe_layers != cfg.num_layers:
            field = "num_experts" if cfg.num_experts <= 0 else "dense_layers" if cfg.dense_layers else "moe_every"
            raise ValueError(f"config_to_hf: mixtral needs every layer MoE (ModelConfig.{field})")
        if not cfg.renormalize_topk:
            raise ValueError("config_to_hf: ModelConfig.renormalize_topk must be True for mixtral")
        hf.update(
            intermediate_size=cfg.moe_mlp_dim,
            num_local_experts=cfg.num_experts,
            router_jitter_noise=0.0,
            max_position_embeddings=131072,
        )
    hf.update(extra or {})
    return hf


# `ModelConfig` fields that say how a run computes or trains, not what the model is: an HF config does
# not hold them, and a model exported without them computes the same function (HF computes in the
# weights' dtype: a run with dtype != param_dtype differs from its export by that rounding only).
RUN_FIELDS = ("z_loss_coef", "dispatch", "dtype", "scan_layers", "remat", "logprob_chunk", "batch_chunks")


def exportable_config(cfg: ModelConfig, model_type: str = "qwen3_moe", *, extra: Mapping | None = None) -> dict:
    """`config_to_hf(cfg, model_type, extra=extra)`, checked to read back (`config_from_hf`) as the same
    model: ValueError naming the first `ModelConfig` field that would come back different."""
    hf = config_to_hf(cfg, model_type, extra=extra)
    back = config_from_hf(json.loads(json.dumps(hf)), **{f: getattr(cfg, f) for f in RUN_FIELDS})
    for field in dataclasses.fields(cfg):
        name = field.name
        if name == "lora":
            continue  # a run's adapters, not the architecture (an export is of merged weights)
        if name == "mlp_dim" and cfg.num_moe_layers == cfg.num_layers:
            continue  # no dense layer uses it (Mixtral configs cannot hold it)
        if getattr(back, name) != getattr(cfg, name):
            raise ValueError(
                f"config_to_hf: ModelConfig.{name}={getattr(cfg, name)!r} cannot be expressed as {model_type} "
                f"(it would load back as {getattr(back, name)!r})"
            )
    return hf

"""Hugging Face Qwen3-MoE / Mixtral checkpoints <-> our `ModelConfig` and NNX state.

Reads and writes `config.json` + safetensors (single file or sharded with
`model.safetensors.index.json`) through the `safetensors` numpy API, so no torch is
needed; bf16 tensors come back as `ml_dtypes.bfloat16` arrays. Expert weights are read
in both layouts a checkpoint may hold: the classic per-expert names that Hub
checkpoints and transformers' `save_pretrained` write (`...experts.{j}.gate_proj.weight`,
Mixtral `...block_sparse_moe.experts.{j}.w1.weight`) and transformers v5's fused
in-memory layout (`...mlp.experts.gate_up_proj` [E,2M,D], `...mlp.experts.down_proj`
[E,D,M]), which `save_pretrained(save_original_format=False)` writes. Export always
writes the classic per-expert names. Loading then exporting is bitwise exact.

torch `nn.Linear` stores [out, in]; our parameters are [in, out] (split per head for
attention, stacked over experts for MoE), so every matrix is transposed on the way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import safe_open
from safetensors.numpy import save_file

from gspo_jax import model as model_lib
from gspo_jax import sharding
from gspo_jax.model_config import ModelConfig

MODEL_TYPES = ("qwen3_moe", "mixtral")
ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
# Expert projection names per model type: (gate, up, down) in our terms.
EXPERT_NAMES = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}
# Files copied verbatim from a source directory on export (tokenizer and generation defaults).
PASSTHROUGH_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' default "5GB"
SAFETENSORS_INDEX = "model.safetensors.index.json"
_ROPE_THETA_DEFAULT = {"qwen3_moe": 10_000.0, "mixtral": 1_000_000.0}  # transformers 5 defaults

# A parameter's path: in the NNX state, e.g. ("stacks", 1, "layer", "mlp", "router") for a run of stacked
# layers; per layer, as HF checkpoints name them, e.g. ("layers", 0, "mlp", "router") (`stacked_to_layers`).
ParamPath = tuple[str | int, ...]


# ---------------------------------------------------------------------------- config


def _load_json(path_or_dict: Mapping | str | os.PathLike, filename: str = "config.json") -> dict:
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
    hf = _load_json(hf_config)
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
        if name == "mlp_dim" and cfg.num_moe_layers == cfg.num_layers:
            continue  # no dense layer uses it (Mixtral configs cannot hold it)
        if getattr(back, name) != getattr(cfg, name):
            raise ValueError(
                f"config_to_hf: ModelConfig.{name}={getattr(cfg, name)!r} cannot be expressed as {model_type} "
                f"(it would load back as {getattr(back, name)!r})"
            )
    return hf


# ---------------------------------------------------------------------------- name / layout mapping


def _moe_prefixes(model_type: str, layer: int) -> tuple[str, ...]:
    """Where a layer's MoE block lives; Mixtral's classic name first, v5's renamed one second."""
    p = f"model.layers.{layer}"
    return (f"{p}.mlp",) if model_type == "qwen3_moe" else (f"{p}.block_sparse_moe", f"{p}.mlp")


class _Tensors:
    """Reads HF tensors by name, once each, remembering which were used."""

    def __init__(self, tensors: Mapping[str, Any]):
        self.tensors, self.used = tensors, set()

    def __contains__(self, name):
        return name in self.tensors

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.tensors:
            raise ValueError(f"load_hf_checkpoint: missing tensor {name!r}")
        x = np.asarray(self.tensors[name])
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"load_hf_checkpoint: tensor {name!r} has shape {tuple(x.shape)}, expected {tuple(shape)}")
        self.used.add(name)
        return x


def hf_to_params(tensors: Mapping[str, Any], cfg: ModelConfig, model_type: str) -> dict[ParamPath, np.ndarray]:
    """Our parameters (path -> array in our layout) from HF tensors (name -> [out, in] arrays).

    Raises ValueError for a missing, misshapen or unused tensor.
    """
    t = _Tensors(tensors)
    D, H, KV, Dh, V = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size
    E, Mm = cfg.num_experts, cfg.moe_mlp_dim
    out: dict[ParamPath, np.ndarray] = {("embed_tokens",): t.get("model.embed_tokens.weight", (V, D))}
    if cfg.tie_embeddings:
        t.used.add("lm_head.weight")  # a tied checkpoint may still carry a copy
    else:
        out[("lm_head",)] = t.get("lm_head.weight", (V, D)).T
    out[("norm", "scale")] = t.get("model.norm.weight", (D,))
    for i in range(cfg.num_layers):
        p, ours = f"model.layers.{i}", ("layers", i)
        a = f"{p}.self_attn"
        out[ours + ("input_layernorm", "scale")] = t.get(f"{p}.input_layernorm.weight", (D,))
        out[ours + ("post_attention_layernorm", "scale")] = t.get(f"{p}.post_attention_layernorm.weight", (D,))
        out[ours + ("self_attn", "q_proj")] = t.get(f"{a}.q_proj.weight", (H * Dh, D)).T.reshape(D, H, Dh)
        out[ours + ("self_attn", "k_proj")] = t.get(f"{a}.k_proj.weight", (KV * Dh, D)).T.reshape(D, KV, Dh)
        out[ours + ("self_attn", "v_proj")] = t.get(f"{a}.v_proj.weight", (KV * Dh, D)).T.reshape(D, KV, Dh)
        out[ours + ("self_attn", "o_proj")] = t.get(f"{a}.o_proj.weight", (D, H * Dh)).T.reshape(H, Dh, D)
        if cfg.qk_norm:
            out[ours + ("self_attn", "q_norm", "scale")] = t.get(f"{a}.q_norm.weight", (Dh,))
            out[ours + ("self_attn", "k_norm", "scale")] = t.get(f"{a}.k_norm.weight", (Dh,))
        mlp = ours + ("mlp",)
        if not cfg.is_moe_layer(i):
            Md = cfg.mlp_dim
            out[mlp + ("gate_proj",)] = t.get(f"{p}.mlp.gate_proj.weight", (Md, D)).T
            out[mlp + ("up_proj",)] = t.get(f"{p}.mlp.up_proj.weight", (Md, D)).T
            out[mlp + ("down_proj",)] = t.get(f"{p}.mlp.down_proj.weight", (D, Md)).T
            continue
        prefixes = _moe_prefixes(model_type, i)
        fused = [q for q in prefixes if f"{q}.experts.gate_up_proj" in t]
        q = fused[0] if fused else next((q for q in prefixes if f"{q}.gate.weight" in t), prefixes[0])
        out[mlp + ("router",)] = t.get(f"{q}.gate.weight", (E, D)).T
        if fused:  # transformers v5 layout: gate_up [E, 2M, D] (gate rows first), down [E, D, M]
            gate_up = t.get(f"{q}.experts.gate_up_proj", (E, 2 * Mm, D))
            out[mlp + ("gate_proj",)] = gate_up[:, :Mm, :].transpose(0, 2, 1)
            out[mlp + ("up_proj",)] = gate_up[:, Mm:, :].transpose(0, 2, 1)
            out[mlp + ("down_proj",)] = t.get(f"{q}.experts.down_proj", (E, D, Mm)).transpose(0, 2, 1)
        else:  # classic per-expert Linear weights
            g, u, d = EXPERT_NAMES[model_type]
            x = f"{q}.experts"
            out[mlp + ("gate_proj",)] = np.stack([t.get(f"{x}.{j}.{g}.weight", (Mm, D)).T for j in range(E)])
            out[mlp + ("up_proj",)] = np.stack([t.get(f"{x}.{j}.{u}.weight", (Mm, D)).T for j in range(E)])
            out[mlp + ("down_proj",)] = np.stack([t.get(f"{x}.{j}.{d}.weight", (D, Mm)).T for j in range(E)])
    unused = sorted(n for n in t.tensors if n not in t.used and not n.endswith("rotary_emb.inv_freq"))
    if unused:
        more = f" (+{len(unused) - 5} more)" if len(unused) > 5 else ""
        raise ValueError(f"load_hf_checkpoint: tensors not used by the {model_type} mapping: {unused[:5]}{more}")
    return out


def params_to_hf(params: Mapping[ParamPath, np.ndarray], cfg: ModelConfig, model_type: str) -> dict[str, np.ndarray]:
    """HF tensors with the classic per-expert names `save_pretrained` writes, from our parameters."""
    D = cfg.embed_dim
    c = np.ascontiguousarray
    out = {"model.embed_tokens.weight": c(params[("embed_tokens",)]), "model.norm.weight": c(params[("norm", "scale")])}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = c(params[("lm_head",)].T)
    for i in range(cfg.num_layers):
        p, ours = f"model.layers.{i}", ("layers", i)
        a = f"{p}.self_attn"
        out[f"{p}.input_layernorm.weight"] = c(params[ours + ("input_layernorm", "scale")])
        out[f"{p}.post_attention_layernorm.weight"] = c(params[ours + ("post_attention_layernorm", "scale")])
        for name in ("q_proj", "k_proj", "v_proj"):
            out[f"{a}.{name}.weight"] = c(params[ours + ("self_attn", name)].reshape(D, -1).T)
        out[f"{a}.o_proj.weight"] = c(params[ours + ("self_attn", "o_proj")].reshape(-1, D).T)
        if cfg.qk_norm:
            out[f"{a}.q_norm.weight"] = c(params[ours + ("self_attn", "q_norm", "scale")])
            out[f"{a}.k_norm.weight"] = c(params[ours + ("self_attn", "k_norm", "scale")])
        mlp = ours + ("mlp",)
        if not cfg.is_moe_layer(i):
            for name in ("gate_proj", "up_proj", "down_proj"):
                out[f"{p}.mlp.{name}.weight"] = c(params[mlp + (name,)].T)
            continue
        q = _moe_prefixes(model_type, i)[0]
        out[f"{q}.gate.weight"] = c(params[mlp + ("router",)].T)
        for ours_name, hf_name in zip(("gate_proj", "up_proj", "down_proj"), EXPERT_NAMES[model_type]):
            w_E = params[mlp + (ours_name,)]
            for j in range(cfg.num_experts):
                out[f"{q}.experts.{j}.{hf_name}.weight"] = c(w_E[j].T)
    return out


# ---------------------------------------------------------------------------- safetensors files


def _safetensors_files(directory: str) -> list[str]:
    """The checkpoint's safetensors files: from the index if there is one, else every *.safetensors."""
    index = os.path.join(directory, SAFETENSORS_INDEX)
    if os.path.exists(index):
        files = sorted(set(_load_json(index)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"load_hf_checkpoint: no *.safetensors files in {directory!r}")
    return [os.path.join(directory, f) for f in files]


class _LazyTensors(Mapping):
    """name -> numpy array over open safetensors files, read on access (bf16 via ml_dtypes)."""

    def __init__(self, handles):
        self._where = {name: h for h in handles for name in h.keys()}  # noqa: SIM118 - safe_open is not iterable

    def __getitem__(self, name):
        return self._where[name].get_tensor(name)

    def __iter__(self):
        return iter(self._where)

    def __len__(self):
        return len(self._where)


def write_safetensors(directory: str, tensors: Mapping[str, np.ndarray], max_shard_bytes: int) -> list[str]:
    """Writes `model.safetensors`, or numbered shards plus the index when over `max_shard_bytes`."""
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors, key=_natural_key):
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    for fname, shard in zip(names, shards):
        save_file(shard, os.path.join(directory, fname), metadata={"format": "pt"})
    if n > 1:
        index = {
            "metadata": {"total_size": int(sum(x.nbytes for x in tensors.values()))},
            "weight_map": {name: fname for fname, shard in zip(names, shards) for name in shard},
        }
        with open(os.path.join(directory, SAFETENSORS_INDEX), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    return names


def _natural_key(name: str):
    """Sort key putting layer 2 before layer 10."""
    return tuple((0, int(s), "") if s.isdigit() else (1, 0, s) for s in name.split("."))


# ---------------------------------------------------------------------------- state <-> params


def state_to_params(state: nnx.State) -> dict[ParamPath, np.ndarray]:
    """path -> host numpy array for every Variable of an NNX state."""
    leaves = jax.tree_util.tree_flatten_with_path(state, is_leaf=sharding.is_variable)[0]
    return {sharding.path_key(p): np.asarray(jax.device_get(v.get_value())) for p, v in leaves}


def stacked_to_layers(cfg: ModelConfig, params: dict) -> dict:
    """Per-layer view of a {path: array} dict: ("stacks", s, "layer", *rest) [n, ...] becomes
    ("layers", i, *rest) for each of the stack's layers i (how HF checkpoints name them)."""
    out = {}
    for path, x in params.items():
        if path[:1] != ("stacks",):
            out[path] = x
            continue
        first, n = cfg.layer_runs[path[1]]
        for j in range(n):
            out[("layers", first + j) + tuple(path[3:])] = x[j]
    return out


def layers_to_stacked(cfg: ModelConfig, params: dict) -> dict:
    """Inverse of `stacked_to_layers`: stacks each run's per-layer arrays (numpy or jax)."""
    out, per = {}, {}
    for path, x in params.items():
        if path[:1] == ("layers",):
            per[path] = x
        else:
            out[path] = x
    for s, (first, n) in enumerate(cfg.layer_runs):
        for rest in sorted({p[2:] for p in per if first <= p[1] < first + n}):
            xs = [per.pop(("layers", first + j) + rest, None) for j in range(n)]
            missing = [first + j for j, x in enumerate(xs) if x is None]
            if missing:
                raise ValueError(f"layers_to_stacked: no {rest} for layers {missing}")
            out[("stacks", s, "layer") + rest] = (jnp if isinstance(xs[0], jax.Array) else np).stack(xs)
    if per:
        raise ValueError(f"layers_to_stacked: parameters of no layer run: {sorted(per)[:5]}")
    return out


def params_to_state(
    cfg: ModelConfig, params: Mapping[ParamPath, np.ndarray], mesh: Mesh | None = None
) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, state) of `Transformer(cfg)` holding `params`, each cast to cfg.param_dtype.

    With `mesh`, each parameter is placed straight into its logical-axis sharding
    (`sharding.param_shardings`), so no single device ever holds the whole model.
    """
    graphdef, abstract = model_lib.abstract_model(cfg)
    dtype = np.dtype(cfg.jnp_param_dtype)
    where: dict[ParamPath, Any] = {}
    if mesh is not None:
        leaves = jax.tree_util.tree_flatten_with_path(
            sharding.param_shardings(mesh, abstract), is_leaf=sharding.is_variable
        )
        where = {sharding.path_key(p): v.get_value() for p, v in leaves[0]}

    def fill(path, var):
        key = sharding.path_key(path)
        x = params[key]
        if tuple(x.shape) != tuple(var.get_value().shape):
            raise ValueError(f"params_to_state: {key} has shape {x.shape}, expected {var.get_value().shape}")
        x = x.astype(dtype, copy=False)
        return var.replace(jax.device_put(x, where[key]) if key in where else jnp.asarray(x))

    state = jax.tree_util.tree_map_with_path(fill, abstract, is_leaf=sharding.is_variable)
    return graphdef, state


# ---------------------------------------------------------------------------- checkpoints


def load_hf_checkpoint(
    directory: str | os.PathLike,
    *,
    dtype: str | None = None,
    dispatch: str | None = None,
    mesh: Mesh | None = None,
) -> tuple[ModelConfig, nnx.GraphDef, nnx.State]:
    """(cfg, graphdef, state) from an HF Qwen3-MoE / Mixtral checkpoint directory.

    `dtype` ('float32' | 'bfloat16') sets parameter and compute dtype; default: the
    checkpoint's own (config `dtype`/`torch_dtype`). `dispatch` picks the MoE path.
    `mesh` places parameters sharded (see `params_to_state`); host memory still holds
    the whole checkpoint once while converting.
    """
    directory = os.fspath(directory)
    hf = _load_json(directory)
    overrides = {}
    if dtype is not None:
        name = jnp.dtype(dtype).name
        overrides.update(param_dtype=name, dtype=name)
    if dispatch is not None:
        overrides["dispatch"] = dispatch
    cfg = config_from_hf(hf, **overrides)
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(safe_open(f, framework="numpy")) for f in _safetensors_files(directory)]
        params = layers_to_stacked(cfg, hf_to_params(_LazyTensors(handles), cfg, hf["model_type"]))
    graphdef, state = params_to_state(cfg, params, mesh)
    return cfg, graphdef, state


def save_hf_checkpoint(
    directory: str | os.PathLike,
    cfg: ModelConfig,
    state: nnx.State,
    model_type: str = "qwen3_moe",
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    tokenizer_dir: str | os.PathLike | None = None,
    extra_config: Mapping | None = None,
) -> list[str]:
    """Writes config.json + safetensors (per-expert names) that `from_pretrained` loads.

    Tensors keep the state's dtypes. Files in `PASSTHROUGH_FILES` found in
    `tokenizer_dir` are copied alongside. Returns the safetensors file names.
    """
    directory = os.fspath(directory)
    hf = config_to_hf(cfg, model_type, extra=extra_config)
    tensors = params_to_hf(stacked_to_layers(cfg, state_to_params(state)), cfg, model_type)
    os.makedirs(directory, exist_ok=True)
    for stale in [SAFETENSORS_INDEX] + [f for f in os.listdir(directory) if f.endswith(".safetensors")]:
        if os.path.exists(os.path.join(directory, stale)):
            os.remove(os.path.join(directory, stale))
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf, f, indent=2, sort_keys=True)
    names = write_safetensors(directory, tensors, max_shard_bytes)
    if tokenizer_dir is not None:
        copy_passthrough_files(tokenizer_dir, directory)
    return names


def copy_passthrough_files(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Copies the tokenizer / generation-config files present in `src` to `dst`; returns their names."""
    copied = []
    for name in PASSTHROUGH_FILES:
        path = os.path.join(src, name)
        if os.path.isfile(path):
            shutil.copyfile(path, os.path.join(dst, name))
            copied.append(name)
    return copied

"""Hugging Face Qwen3-MoE / Mixtral checkpoints <-> our `ModelConfig` and NNX state (the config.json
mapping itself: `gspo_jax/hf_config.py`).

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
from gspo_jax.hf_config import config_from_hf, config_to_hf, load_json
from gspo_jax.model_config import ModelConfig

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

# A parameter's path: in the NNX state, e.g. ("stacks", 1, "layer", "mlp", "router") for a run of stacked
# layers; per layer, as HF checkpoints name them, e.g. ("layers", 0, "mlp", "router") (`stacked_to_layers`).
ParamPath = tuple[str | int, ...]


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
        files = sorted(set(load_json(index)["weight_map"].values()))
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
    hf = load_json(directory)
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

"""Hugging Face checkpoint interop (gspo_jax/hf.py, hf_config.py) against fixtures written by transformers.

The fixtures under tests/fixtures/ come from scripts/make_hf_fixture.py (transformers
5.23 + torch, run by hand); these tests need neither torch nor a network.
"""

import dataclasses
import functools
import importlib.util
import json
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from gspo_jax import hf, hf_config, model_config, sharding
from gspo_jax import model as model_lib
from gspo_jax.tasks.tokenizer import TOKENIZER_DIR

FIXTURES = Path(__file__).parent / "fixtures"
PARITY = ["qwen3_moe_tiny", "qwen3_moe_tiny_dense0", "mixtral_tiny"]


@functools.cache
def load(name, dtype=None, dispatch=None):
    return hf.load_hf_checkpoint(FIXTURES / name, dtype=dtype, dispatch=dispatch)


def expected(name):
    return dict(np.load(FIXTURES / name / "expected.npz"))


def forward(graphdef, state, input_ids):
    ids = jnp.asarray(input_ids, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    return model_lib.apply(graphdef, state, ids, positions, return_router_logits=True)


def params(state):
    return hf.state_to_params(state)


def assert_bitwise_equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k, x in a.items():
        assert (x.dtype, x.shape) == (b[k].dtype, b[k].shape), k
        assert x.tobytes() == b[k].tobytes(), k


def read_tensors(directory) -> dict:
    out = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(f, framework="numpy") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})  # noqa: SIM118 - safe_open is not iterable
    return out


# ------------------------------------------------------------------ parity with transformers


@pytest.mark.parametrize("dispatch", ["dense", "ragged", "sparse"])
@pytest.mark.parametrize("name", PARITY)
def test_logits_and_topk_match_transformers(name, dispatch):
    cfg, graphdef, state = load(name, dispatch=dispatch)
    exp = expected(name)
    logits, aux = forward(graphdef, state, exp["input_ids"])
    assert cfg.num_moe_layers == exp["topk"].shape[0]  # the fixture keeps HF's layer-first layout
    np.testing.assert_allclose(np.asarray(logits), exp["logits"], atol=1e-4, rtol=0)
    router_logits_LBTE = np.moveaxis(np.asarray(aux.router_logits), 1, 0)  # ours are batch-first
    np.testing.assert_allclose(router_logits_LBTE, exp["router_logits"], atol=1e-4, rtol=0)
    for layer in range(cfg.num_moe_layers):  # same experts in the same (descending-probability) order
        np.testing.assert_array_equal(np.asarray(aux.topk[:, layer]), exp["topk"][layer], err_msg=f"MoE layer {layer}")


def test_fixture_configs_map():
    cfg = load("qwen3_moe_tiny")[0]
    assert (cfg.vocab_size, cfg.embed_dim, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        128,
        32,
        2,
        4,
        2,
        8,
    )
    assert (cfg.num_experts, cfg.top_k, cfg.moe_mlp_dim, cfg.mlp_dim) == (8, 2, 16, 64)
    assert cfg.qk_norm and cfg.renormalize_topk and cfg.moe_layer_ids == (0, 1)
    dense0 = load("qwen3_moe_tiny_dense0")[0]
    assert dense0.moe_layer_ids == (1,) and dense0.dense_layers == (0,)
    assert dense0.tie_embeddings and not dense0.renormalize_topk and dense0.head_dim == 16
    assert dense0.rope_theta == 1e6
    mixtral = load("mixtral_tiny")[0]
    assert not mixtral.qk_norm and mixtral.renormalize_topk and mixtral.head_dim == 32 // 4
    assert mixtral.moe_mlp_dim == 16 and mixtral.moe_layer_ids == (0, 1) and mixtral.rms_eps == 1e-5


# ------------------------------------------------------------------ config mapping

QWEN3_30B_A3B_HUB = {  # config.json of Qwen/Qwen3-30B-A3B (transformers 4.51 names)
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
MIXTRAL_8X7B_HUB = {  # config.json of mistralai/Mixtral-8x7B-v0.1
    "architectures": ["MixtralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mixtral",
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1e6,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 32000,
}
# What MIXTRAL_8X7B_HUB describes, written out by hand (not a size of ours: `model_config.SIZES`).
MIXTRAL_8X7B = model_config.ModelConfig(
    vocab_size=32000,
    embed_dim=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    qk_norm=False,
    rope_theta=1e6,
    rms_eps=1e-5,
    mlp_dim=14336,
    tie_embeddings=False,
    num_experts=8,
    top_k=2,
    moe_mlp_dim=14336,
    renormalize_topk=True,
    moe_every=1,
    lb_loss_coef=0.02,
    dispatch="auto",
    param_dtype="bfloat16",
    dtype="bfloat16",
)


def test_hub_configs_give_their_models():
    assert hf_config.config_from_hf(QWEN3_30B_A3B_HUB, dispatch="auto") == model_config.get("qwen3_30b_a3b")
    assert hf_config.config_from_hf(MIXTRAL_8X7B_HUB, dispatch="auto") == MIXTRAL_8X7B


def test_transformers5_config_names():
    """v5 writes num_local_experts for qwen3_moe and rope_theta inside rope_parameters."""
    v5 = json.loads((FIXTURES / "qwen3_moe_tiny" / "config.json").read_text())
    assert "num_local_experts" in v5 and "num_experts" not in v5 and "rope_theta" not in v5
    v4 = dict(v5, num_experts=v5.pop("num_local_experts"), rope_theta=10_000.0, rope_scaling=None)
    del v4["rope_parameters"]
    assert hf_config.config_from_hf(v4) == hf_config.config_from_hf(FIXTURES / "qwen3_moe_tiny")


@pytest.mark.parametrize(
    "cfg, model_type",
    [
        (model_config.get("tiny"), "qwen3_moe"),
        (
            model_config.ModelConfig(
                num_layers=4,
                num_experts=4,
                moe_every=2,
                dense_layers=(3,),
                tie_embeddings=True,
                renormalize_topk=False,
                param_dtype="bfloat16",
                dtype="bfloat16",
            ),
            "qwen3_moe",
        ),
        (model_config.ModelConfig(num_experts=0, mlp_dim=96), "qwen3_moe"),
        (dataclasses.replace(MIXTRAL_8X7B, dispatch=model_config.ModelConfig().dispatch), "mixtral"),
    ],
    ids=["tiny", "sparse_step", "all_dense", "mixtral"],
)
def test_config_roundtrip(cfg, model_type):
    back = hf_config.config_from_hf(json.loads(json.dumps(hf_config.config_to_hf(cfg, model_type))))
    # HF configs describe the model, not how it runs: scan_layers, remat, logprob_chunk come back as defaults.
    runs = {f: getattr(model_config.ModelConfig(), f) for f in ("scan_layers", "remat", "logprob_chunk")}
    assert back == dataclasses.replace(cfg, z_loss_coef=0.0, **runs)


@pytest.mark.parametrize(
    "base, change, field",
    [
        (QWEN3_30B_A3B_HUB, dict(model_type="llama"), "model_type"),
        (QWEN3_30B_A3B_HUB, dict(attention_bias=True), "attention_bias"),
        (QWEN3_30B_A3B_HUB, dict(use_sliding_window=True, sliding_window=4096), "use_sliding_window"),
        (MIXTRAL_8X7B_HUB, dict(sliding_window=4096), "sliding_window"),
        (QWEN3_30B_A3B_HUB, dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling"),
        (QWEN3_30B_A3B_HUB, dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6}), "rope_parameters"),
        (QWEN3_30B_A3B_HUB, dict(hidden_act="gelu"), "hidden_act"),
        (QWEN3_30B_A3B_HUB, dict(shared_expert_intermediate_size=512), "shared_expert_intermediate_size"),
        (QWEN3_30B_A3B_HUB, dict(hidden_size=None), "hidden_size"),
        (QWEN3_30B_A3B_HUB, dict(num_experts=None), "num_experts"),
        (MIXTRAL_8X7B_HUB, dict(num_local_experts=None), "num_local_experts"),
        (QWEN3_30B_A3B_HUB, dict(num_experts_per_tok=200), "top_k"),
    ],
)
def test_bad_hf_config_names_field(base, change, field):
    with pytest.raises(ValueError, match=field):
        hf_config.config_from_hf(dict(base, **change))


@pytest.mark.parametrize(
    "cfg, model_type, field",
    [
        (model_config.get("tiny"), "llama", "model_type"),
        (model_config.get("tiny", qk_norm=False), "qwen3_moe", "qk_norm"),
        (model_config.get("tiny", qk_norm=False), "mixtral", "dense_layers"),
        (dataclasses.replace(MIXTRAL_8X7B, qk_norm=True), "mixtral", "qk_norm"),
        (dataclasses.replace(MIXTRAL_8X7B, renormalize_topk=False), "mixtral", "renormalize_topk"),
    ],
)
def test_unexpressible_config_names_field(cfg, model_type, field):
    with pytest.raises(ValueError, match=field):
        hf_config.config_to_hf(cfg, model_type)


# ------------------------------------------------------------------ export / reload


@pytest.mark.parametrize("name", PARITY)
def test_export_reload_bitwise(name, tmp_path):
    cfg, _, state = load(name)
    model_type = json.loads((FIXTURES / name / "config.json").read_text())["model_type"]
    hf.save_hf_checkpoint(tmp_path, cfg, state, model_type)
    back_cfg, _, back_state = hf.load_hf_checkpoint(tmp_path)
    assert back_cfg == cfg
    assert_bitwise_equal(params(back_state), params(state))
    # Same tensor names, shapes and bytes as transformers' own save_pretrained.
    assert_bitwise_equal(read_tensors(tmp_path), read_tensors(FIXTURES / name))


def test_export_dense_layer_sharded_bf16(tmp_path):
    """A random bf16 model with a dense layer, tied embeddings and moe_every=2, written in several shards."""
    cfg = model_config.ModelConfig(
        vocab_size=64,
        embed_dim=16,
        num_layers=4,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        mlp_dim=24,
        num_experts=4,
        top_k=2,
        moe_mlp_dim=8,
        moe_every=2,
        dense_layers=(3,),
        tie_embeddings=True,
        param_dtype="bfloat16",
        dtype="bfloat16",
    )
    rng = np.random.default_rng(3)
    _, abstract = model_lib.abstract_model(cfg)
    leaves = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    random = {tuple(k.key for k in path): rng.standard_normal(v.get_value().shape, np.float32) for path, v in leaves}
    _, state = hf.params_to_state(cfg, random)
    files = hf.save_hf_checkpoint(tmp_path, cfg, state, "qwen3_moe", max_shard_bytes=4096)
    assert len(files) > 1 and (tmp_path / hf.SAFETENSORS_INDEX).exists()
    index = json.loads((tmp_path / hf.SAFETENSORS_INDEX).read_text())
    names = set(index["weight_map"])
    assert {
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.2.mlp.down_proj.weight",
        "model.layers.3.mlp.up_proj.weight",
    } <= names  # dense: layers 0, 2 (sparse step), 3 (mlp_only)
    assert "model.layers.1.mlp.gate.weight" in names and "model.layers.1.mlp.experts.3.down_proj.weight" in names
    assert "lm_head.weight" not in names  # tied
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    assert hf_cfg["mlp_only_layers"] == [3] and hf_cfg["decoder_sparse_step"] == 2 and hf_cfg["dtype"] == "bfloat16"
    back_cfg, _, back_state = hf.load_hf_checkpoint(tmp_path)
    assert back_cfg == cfg
    assert_bitwise_equal(params(back_state), params(state))


def test_tokenizer_passthrough(tmp_path):
    cfg, _, state = load("qwen3_moe_tiny")
    hf.save_hf_checkpoint(tmp_path, cfg, state, tokenizer_dir=TOKENIZER_DIR)
    shipped = sorted(p.name for p in Path(TOKENIZER_DIR).iterdir() if p.name in hf.PASSTHROUGH_FILES)
    assert shipped
    for name in shipped:
        assert (tmp_path / name).read_bytes() == (Path(TOKENIZER_DIR) / name).read_bytes()


# ------------------------------------------------------------------ layouts and dtypes


def test_stacked_and_per_layer_params_round_trip():
    cfg = model_config.get("tiny")
    _, state = nnx.split(model_lib.Transformer(cfg, rngs=nnx.Rngs(0)))
    stacked = hf.state_to_params(state)
    per_layer = hf.stacked_to_layers(cfg, stacked)
    router = stacked[("stacks", 1, "layer", "mlp", "router")]  # [layers 1..2, D, E]
    assert router.shape == (2, cfg.embed_dim, cfg.num_experts)
    np.testing.assert_array_equal(per_layer[("layers", 2, "mlp", "router")], router[1])
    assert {k[1] for k in per_layer if k[0] == "layers"} == {0, 1, 2}
    back = hf.layers_to_stacked(cfg, per_layer)
    assert back.keys() == stacked.keys()
    for k in stacked:
        np.testing.assert_array_equal(back[k], stacked[k])
    del per_layer[("layers", 1, "mlp", "up_proj")]
    with pytest.raises(ValueError, match=r"no \('mlp', 'up_proj'\) for layers \[1\]"):
        hf.layers_to_stacked(cfg, per_layer)


def test_bf16_fused_layout_from_transformers():
    """transformers wrote the same weights in bf16 with fused experts.gate_up_proj / down_proj."""
    names = read_tensors(FIXTURES / "qwen3_moe_tiny_bf16_fused").keys()
    assert "model.layers.0.mlp.experts.gate_up_proj" in names and "model.layers.0.mlp.experts.down_proj" in names
    cfg, graphdef, state = load("qwen3_moe_tiny_bf16_fused")
    assert cfg.param_dtype == "bfloat16" and cfg.dtype == "bfloat16"
    got = params(state)
    want = {k: v.astype(jnp.bfloat16) for k, v in params(load("qwen3_moe_tiny")[2]).items()}
    assert_bitwise_equal(got, want)  # torch and ml_dtypes both round to nearest even
    logits, _ = forward(graphdef, state, expected("qwen3_moe_tiny")["input_ids"])
    assert logits.dtype == jnp.float32 and np.isfinite(np.asarray(logits)).all()
    upcast = params(hf.load_hf_checkpoint(FIXTURES / "qwen3_moe_tiny_bf16_fused", dtype="float32")[2])
    assert all(v.dtype == np.float32 and np.array_equal(v, got[k].astype(np.float32)) for k, v in upcast.items())


def test_fused_layout_float32(tmp_path):
    """Fusing the per-expert fixture in numpy the way transformers v5 does loads the same params."""
    tensors = read_tensors(FIXTURES / "qwen3_moe_tiny")
    for i in range(2):
        p = f"model.layers.{i}.mlp.experts"
        gate, up, down = (
            np.stack([tensors.pop(f"{p}.{j}.{n}.weight") for j in range(8)])
            for n in ("gate_proj", "up_proj", "down_proj")
        )
        tensors[f"{p}.gate_up_proj"] = np.concatenate([gate, up], axis=1)  # [E, 2M, D]
        tensors[f"{p}.down_proj"] = down  # [E, D, M]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(FIXTURES / "qwen3_moe_tiny" / "config.json", tmp_path)
    assert_bitwise_equal(params(hf.load_hf_checkpoint(tmp_path)[2]), params(load("qwen3_moe_tiny")[2]))


def test_loader_rejects_missing_and_unused_tensors():
    cfg = load("qwen3_moe_tiny")[0]
    tensors = read_tensors(FIXTURES / "qwen3_moe_tiny")
    missing = {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.experts.5.up_proj.weight"}
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight'"):
        hf.hf_to_params(missing, cfg, "qwen3_moe")
    extra = dict(tensors, **{"model.layers.0.self_attn.q_proj.bias": np.zeros(32, np.float32)})
    with pytest.raises(ValueError, match=r"not used.*q_proj\.bias"):
        hf.hf_to_params(extra, cfg, "qwen3_moe")
    wrong = dict(tensors, **{"model.norm.weight": np.zeros(31, np.float32)})
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*shape"):
        hf.hf_to_params(wrong, cfg, "qwen3_moe")


def test_sharded_index_is_read(tmp_path):
    """A checkpoint split by the index (as transformers shards big models) loads the same."""
    cfg, _, state = load("mixtral_tiny")
    hf.save_hf_checkpoint(tmp_path, cfg, state, "mixtral", max_shard_bytes=20_000)
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 2
    assert_bitwise_equal(params(hf.load_hf_checkpoint(tmp_path)[2]), params(state))
    hf.save_hf_checkpoint(tmp_path, cfg, state, "mixtral")  # re-export in one file clears the old shards
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]


def test_convert_script_roundtrip(tmp_path):
    """scripts/convert_hf.py: HF -> orbax JAX dir -> HF gives back the same tensors and config."""
    spec = importlib.util.spec_from_file_location(
        "convert_hf", Path(__file__).parent.parent / "scripts" / "convert_hf.py"
    )
    convert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert)
    src = FIXTURES / "mixtral_tiny"
    convert.main(["--in", str(src), "--out", str(tmp_path / "jax"), "--direction", "hf2jax"])
    convert.main(["--in", str(tmp_path / "jax"), "--out", str(tmp_path / "hf"), "--direction", "jax2hf"])
    assert_bitwise_equal(read_tensors(tmp_path / "hf"), read_tensors(src))
    assert hf_config.config_from_hf(tmp_path / "hf") == hf_config.config_from_hf(src)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["bos_token_id"] == 1  # passed through
    assert (tmp_path / "hf" / "generation_config.json").read_bytes() == (src / "generation_config.json").read_bytes()


def test_load_onto_mesh():
    """With a mesh, each parameter lands in its logical-axis sharding, values unchanged."""
    mesh = sharding.make_mesh(data=2, expert=2, tensor=2)
    cfg, _, state = hf.load_hf_checkpoint(FIXTURES / "qwen3_moe_tiny", mesh=mesh)
    want = sharding.param_shardings(mesh, model_lib.abstract_model(cfg)[1])
    assert [x.sharding for x in jax.tree.leaves(state)] == jax.tree.leaves(want)
    gate = state["stacks"][0]["layer"]["mlp"]["gate_proj"][...]  # [L=2, E=8, D=32, M=16] over expert=2, tensor=2
    assert gate.sharding == want["stacks"][0]["layer"]["mlp"]["gate_proj"].get_value()
    assert gate.addressable_shards[0].data.shape == (2, 4, 32, 8)
    assert_bitwise_equal(params(state), params(load("qwen3_moe_tiny")[2]))

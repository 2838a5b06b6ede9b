"""LoRA adapters in Hugging Face PEFT's format (gspo_jax/hf_lora.py, `scripts/convert_hf.py --direction
run2peft`): PEFT's own update rules applied to the exported tensors give our merged weights; PEFT itself
(its logits recorded in tests/fixtures/qwen3_moe_tiny_peft by scripts/make_peft_fixture.py, and live where
peft is installed) loads the export onto transformers' model with our logits; a LoRA run started from a
Hugging Face checkpoint exports its adapters from the CLI."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from gspo_jax import hf, hf_lora, lora, model_config
from gspo_jax import model as model_lib
from gspo_jax.lora import LoraConfig

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
ALL = ("attention", "mlp", "experts", "router")


def random_state(cfg: model_config.ModelConfig, seed: int = 1) -> nnx.State:
    """A state of `cfg`'s shapes drawn by NumPy, B included (so the adapters change the policy)."""
    _, abstract = model_lib.abstract_model(cfg)
    rng = np.random.default_rng(seed)

    def draw(path, v):
        shape, dtype = v.get_value().shape, v.get_value().dtype
        std = 1.0 if path[-1] in ("scale", "embed_tokens") else 0.1
        return v.replace(jnp.asarray(std * rng.standard_normal(shape) + (path[-1] == "scale"), dtype))

    return nnx.from_flat_state([(path, draw(path, v)) for path, v in nnx.to_flat_state(abstract)])


def fused_hf(cfg: model_config.ModelConfig, state: nnx.State) -> dict[str, np.ndarray]:
    """HF tensors as transformers v5 holds them in memory: experts fused ([E, 2M, D] gate rows first,
    [E, D, M]), the router `mlp.gate.weight`."""
    t = hf.params_to_hf(hf.stacked_to_layers(cfg, hf.state_to_params(state)), cfg, "qwen3_moe")
    for i in range(cfg.num_layers):
        q = f"model.layers.{i}.mlp"
        if not cfg.is_moe_layer(i):
            continue
        per = lambda name, q=q: np.stack([t.pop(f"{q}.experts.{j}.{name}.weight") for j in range(cfg.num_experts)])
        t[f"{q}.experts.gate_up_proj"] = np.concatenate([per("gate_proj"), per("up_proj")], axis=1)
        t[f"{q}.experts.down_proj"] = per("down_proj")
    return t


# Where PEFT saves each targeted parameter's pair: a module's own, or (a parameter of transformers' experts,
# which hold two) the wrapper's; the wrapper of the other nests inside it, as `base_layer`.
SAVED_AS = {
    ".mlp.gate": ".mlp.gate.weight",
    ".experts.base_layer": ".experts.gate_up_proj",
    ".experts": ".experts.down_proj",
}


def apply_peft(weights: dict, tensors: dict, config: dict) -> dict[str, np.ndarray]:
    """PEFT's (0.21) LoRA update, written from its rules: an `nn.Linear` or a 2-D parameter gets
    s·lora_B @ lora_A; a 3-D parameter [E, out, in] (`lora.ParamWrapper`) gets, per expert e,
    s·Σ_k lora_B[:, k·E+e] ⊗ lora_A[e·r+k, :], lora_A's rows expert-major and lora_B's columns
    rank-major; r and α from `rank_pattern` / `alpha_pattern` where a key matches (PEFT's regex rule)."""
    out = dict(weights)

    def pattern(patterns: dict, key: str, default):
        return next((v for k, v in patterns.items() if re.match(rf"(.*\.)?({k})$", key)), default)

    for module in sorted({k.removeprefix(hf_lora.PREFIX).rsplit(".lora_", 1)[0] for k in tensors}):
        a = tensors[f"{hf_lora.PREFIX}{module}.lora_A.weight"]
        b = tensors[f"{hf_lora.PREFIX}{module}.lora_B.weight"]
        suffix = next((s for s in SAVED_AS if module.endswith(s)), "")
        param = module.removesuffix(suffix) + SAVED_AS[suffix] if suffix else f"{module}.weight"
        key = param.removesuffix(".weight") if suffix else module
        r = pattern(config["rank_pattern"], key, config["r"])
        s = pattern(config["alpha_pattern"], key, config["lora_alpha"]) / r
        w = out[param]
        if w.ndim == 3:
            E = w.shape[0]
            delta = np.einsum("ore,eri->eoi", b.reshape(b.shape[0], r, E), a.reshape(E, r, a.shape[-1]))
        else:
            delta = b @ a
        assert delta.shape == w.shape, (module, delta.shape, w.shape)
        out[param] = w + s * delta
    return out


@pytest.mark.parametrize(
    "targets", [ALL, ("attention", "experts"), ("mlp", "router")], ids=["all", "att+exp", "mlp+router"]
)
def test_peft_update_rules_on_the_export_give_our_merged_weights(targets):
    """Exported with rank 3 and α 5 (scale 5/3), every adapted weight of the tiny MoE (layer 0 dense)
    updated by PEFT's rules equals our merged W + (α/r)·A·B in transformers' layout; others untouched."""
    cfg = dataclasses.replace(model_config.get("tiny", dispatch="dense"), lora=LoraConfig(3, 5.0, targets))
    state = random_state(cfg)
    adapters, base = lora.split(state)
    base_cfg = dataclasses.replace(cfg, lora=LoraConfig())
    tensors = hf_lora.to_peft(hf.stacked_to_layers(cfg, hf.state_to_params(adapters)), cfg, "qwen3_moe")
    config = hf_lora.peft_config(cfg, "qwen3_moe")
    assert all(x.dtype == np.float32 for x in tensors.values())
    got = apply_peft(fused_hf(base_cfg, base), tensors, config)
    want = fused_hf(*lora.merged(cfg, state))
    assert got.keys() == want.keys()
    changed = 0
    for k, w in want.items():
        np.testing.assert_allclose(got[k], w, rtol=1e-5, atol=1e-6, err_msg=k)
        changed += not np.array_equal(w, fused_hf(base_cfg, base)[k])
    per_layer = {"attention": 4 * 3, "mlp": 3, "experts": 2 * 2, "router": 2}  # layer 0 dense, 1-2 MoE
    assert changed == sum(per_layer[t] for t in targets)


def test_the_config_names_transformers_modules_and_parameters():
    cfg = dataclasses.replace(model_config.get("tiny"), lora=LoraConfig(8, 16.0, ALL))
    c = hf_lora.peft_config(cfg, "qwen3_moe", "Qwen/Qwen3-30B-A3B")
    assert (c["peft_type"], c["r"], c["lora_alpha"], c["base_model_name_or_path"]) == (
        "LORA",
        8,
        16.0,
        "Qwen/Qwen3-30B-A3B",
    )
    assert c["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    dense = ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]  # tiny's layer 0
    assert c["target_parameters"] == [*dense, "mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert c["rank_pattern"] == {"gate_up_proj": 16} and c["alpha_pattern"] == {"gate_up_proj": 32.0}
    with pytest.raises(ValueError, match="lora.rank=0"):
        hf_lora.peft_config(model_config.get("tiny"), "qwen3_moe")
    with pytest.raises(ValueError, match=r"allowed: \('qwen3_moe', 'mixtral'\)"):
        hf_lora.peft_config(cfg, "llama")


def _fixture_script():
    """scripts/make_peft_fixture.py as a module (torch and peft are imported only where it calls them)."""
    spec = importlib.util.spec_from_file_location("make_peft_fixture", ROOT / "scripts" / "make_peft_fixture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("source", ["qwen3_moe_tiny", "qwen3_moe_tiny_dense0", "mixtral_tiny"])
def test_peft_loaded_our_export_with_our_logits(source, tmp_path):
    """PEFT (recorded by scripts/make_peft_fixture.py) loaded the export of the fixture's adapters onto
    transformers' model with our logits to 1e-4; today's export of the same adapters is that export,
    bitwise, so the record still speaks for it."""
    script = _fixture_script()
    recorded = FIXTURES / f"{source}_peft"
    cfg, graphdef, state, _ = script.adapted_state(source, dict(np.load(recorded / "adapters.npz")))
    model_type = script.SOURCES[source]
    hf_lora.save_peft_adapter(tmp_path, cfg, lora.split(state)[0], model_type, base_model_name_or_path=source)
    for name in (hf_lora.ADAPTER_CONFIG,):
        assert json.loads((tmp_path / name).read_text()) == json.loads((recorded / name).read_text())
    got, want = load_file(tmp_path / hf_lora.ADAPTER_WEIGHTS), load_file(recorded / hf_lora.ADAPTER_WEIGHTS)
    assert got.keys() == want.keys() and all(got[k].tobytes() == want[k].tobytes() for k in want)
    expected = np.load(recorded / "expected.npz")
    ours = script.our_logits(graphdef, state, expected["input_ids"])
    np.testing.assert_allclose(ours, expected["logits"], atol=script.TOLERANCE, rtol=0)
    base = np.load(FIXTURES / source / "expected.npz")["logits"]
    assert np.abs(expected["logits"] - base).max() > 0.1  # the adapters matter


@pytest.mark.skipif(
    importlib.util.find_spec("peft") is None, reason="peft and torch: installed by .ci/run on the lowest end"
)
def test_peft_itself_loads_the_export_with_our_logits(tmp_path):
    """Live: today's peft loads today's export onto transformers' model with our logits (≤ 1e-4)."""
    script = _fixture_script()
    source = "qwen3_moe_tiny_dense0"
    cfg, graphdef, state, _ = script.adapted_state(source)
    hf_lora.save_peft_adapter(tmp_path, cfg, lora.split(state)[0], "qwen3_moe")
    input_ids = np.load(FIXTURES / source / "expected.npz")["input_ids"]
    theirs = script.peft_logits(FIXTURES / source, tmp_path, input_ids)
    np.testing.assert_allclose(theirs, script.our_logits(graphdef, state, input_ids), atol=script.TOLERANCE, rtol=0)


def _convert_script():
    spec = importlib.util.spec_from_file_location("convert_hf", ROOT / "scripts" / "convert_hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_lora_rl_from_a_hugging_face_checkpoint_exports_its_adapters(tmp_path, capsys):
    """`hf_checkpoint` plus `lora.rank` trains adapters on the checkpoint's frozen weights; `convert_hf.py
    --direction run2peft` exports a step's adapters (base_model_name_or_path: the checkpoint), and PEFT's
    rules on the checkpoint's own weights then give that step's policy. A whole-policy export of the
    run, or run2peft of a run without adapters, is refused in one line, exit code 2."""
    from gspo_jax import built as built_lib
    from gspo_jax import run as run_lib
    from gspo_jax import snapshots
    from gspo_jax.config import as_json, base_config

    source = FIXTURES / "qwen3_moe_tiny"
    c = base_config("gspo", "tiny")
    c.hf_checkpoint, c.warm_start.steps = str(source), 0
    c.lora.update(rank=4, targets=ALL)
    c.train.update(num_iterations=2, checkpoint_every=1, eval_every=10, eval_batches=1, drift_metrics=False)
    workdir, out = tmp_path / "run", tmp_path / "peft"
    with pytest.MonkeyPatch.context() as m:
        m.setattr(run_lib.plots, "plot_run", lambda workdir: None)
        run_lib.train_and_evaluate(built_lib.build(c), workdir, progress=False)
    convert = _convert_script()
    convert.main(["--direction", "run2peft", "--in", str(workdir), "--out", str(out), "--step", "2"])
    assert f"run2peft: {workdir} step 2 -> {out}" in capsys.readouterr().out

    config = json.loads((out / hf_lora.ADAPTER_CONFIG).read_text())
    assert (config["base_model_name_or_path"], config["r"]) == (str(source), 4)
    run = snapshots.open_run(workdir, adapters=True)
    adapters = snapshots.load_params(run, 2)
    assert any(np.abs(np.asarray(v.get_value())).max() > 0 for p, v in adapters.flat_state() if p[-1] == "b")
    cfg, _, base = hf.load_hf_checkpoint(source)
    got = apply_peft(fused_hf(cfg, base), load_file(out / hf_lora.ADAPTER_WEIGHTS), config)
    want = fused_hf(*lora.merged(run.model, lora.union(base, adapters)))
    for k, w in want.items():
        np.testing.assert_allclose(got[k], w, rtol=1e-5, atol=1e-6, err_msg=k)

    full = tmp_path / "full"  # a run without adapters: its config is all run2peft reads before refusing
    full.mkdir()
    (full / snapshots.CONFIG_FILE).write_text(as_json(base_config("gspo", "tiny")))
    for argv, match in [
        (["--direction", "run2hf", "--in", str(workdir), "--out", str(tmp_path / "hf")], "run2peft exports"),
        (["--direction", "run2peft", "--in", str(workdir), "--out", str(out)], "is not empty"),
        (["--direction", "run2peft", "--in", str(full), "--out", str(tmp_path / "p2")], "is not a LoRA run"),
    ]:
        with pytest.raises(SystemExit) as e:
            convert.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and match in err and err.count("\n") == 1, err

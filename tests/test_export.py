"""`scripts/convert_hf.py --direction run2hf`: a run's checkpoint exported as a Hugging Face checkpoint
reloads with the run's own logits, its config and tokenizer load in `transformers`, the run's workdir
is left byte-for-byte as it was, and what cannot be exported is refused before anything is written.

One tiny run (two iterations, no warm start: most of the module's half a minute or more on CPU) serves the
tests marked slow."""

import dataclasses
import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_hf import MIXTRAL_8X7B
from transformers import AutoConfig, AutoTokenizer

from gspo_jax import built as built_lib
from gspo_jax import config as config_lib
from gspo_jax import hf, hf_config, model_config, snapshots
from gspo_jax import model as model_lib
from gspo_jax import run as run_lib
from gspo_jax import workdir as workdir_lib
from gspo_jax.checkpoint import Checkpointer
from gspo_jax.config import base_config
from gspo_jax.tasks import BOS_ID, EOS_ID, PAD_ID, load_tokenizer, prompt_iterator
from gspo_jax.validation import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def _load_script():
    spec = importlib.util.spec_from_file_location("convert_hf", ROOT / "scripts" / "convert_hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


convert = _load_script()


def digest(path: Path) -> dict[str, str]:
    """Every file under `path` with the sha256 of its bytes: 'unchanged' means equal digests."""
    files = (p for p in path.rglob("*") if p.is_file())
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(workdir, its digest right after training): a tiny GSPO run with checkpoints at steps 1 and 2."""
    workdir = tmp_path_factory.mktemp("run")
    c = base_config("gspo", "tiny")
    c.warm_start.steps = 0
    c.train.update(num_iterations=2, checkpoint_every=1, eval_every=10, eval_batches=1, drift_metrics=False)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(run_lib.plots, "plot_run", lambda workdir: None)  # plots are seconds, and not what is tested
        run_lib.train_and_evaluate(built_lib.build(c), workdir, progress=False)
    assert snapshots.steps(workdir) == [1, 2]
    return workdir, digest(workdir)


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    """The HF directory of the run's newest checkpoint (step 2), written by the CLI."""
    out = tmp_path_factory.mktemp("export") / "hf"
    convert.main(["--direction", "run2hf", "--in", str(run[0]), "--out", str(out)])
    return out


@pytest.mark.slow
def test_export_reloads_with_the_runs_own_logits(run, exported):
    snapshot = snapshots.open_run(run[0])
    params = snapshots.load_params(snapshot, 2)
    before = hf.state_to_params(snapshots.load_params(snapshot, 1))
    assert any(not np.array_equal(x, before[k]) for k, x in hf.state_to_params(params).items())  # it trained

    cfg, graphdef, state = hf.load_hf_checkpoint(exported, dispatch=snapshot.model.dispatch)
    runs = {f: getattr(snapshot.model, f) for f in hf_config.RUN_FIELDS}
    assert dataclasses.replace(cfg, **runs) == snapshot.model
    got, want = hf.state_to_params(state), hf.state_to_params(params)
    assert got.keys() == want.keys()
    assert all(got[k].dtype == want[k].dtype and got[k].tobytes() == want[k].tobytes() for k in want)

    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (3, 20), dtype=np.int32)
    positions = jnp.broadcast_to(jnp.arange(20, dtype=jnp.int32), ids.shape)
    logits_run = jax.jit(model_lib.apply, static_argnums=0)(snapshot.graphdef, params, ids, positions)[0]
    logits_export = jax.jit(model_lib.apply, static_argnums=0)(graphdef, state, ids, positions)[0]
    np.testing.assert_allclose(np.asarray(logits_export), np.asarray(logits_run), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_transformers_loads_the_config_and_tokenizer(run, exported):
    hf_cfg = AutoConfig.from_pretrained(exported)
    assert hf_cfg.model_type == "qwen3_moe" and hf_cfg.num_hidden_layers == 3 and list(hf_cfg.mlp_only_layers) == [0]
    assert (hf_cfg.bos_token_id, hf_cfg.eos_token_id, hf_cfg.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    tokenizer, ours = AutoTokenizer.from_pretrained(exported), load_tokenizer()
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    task = built_lib.build(snapshots.open_run(run[0]).config).task
    for example in prompt_iterator(task, seed=0).next_batch(4):
        ids = tokenizer.encode(example.prompt, add_special_tokens=False)
        assert ids == ours.encode(example.prompt, add_special_tokens=False) and len(ids) > 1
        assert tokenizer.decode(ids) == example.prompt


@pytest.mark.slow
def test_overwrite_rewrites_the_same_files_and_clears_stale_ones(run, exported, tmp_path):
    out = tmp_path / "hf"
    shutil.copytree(exported, out)
    (out / "vocab.json").write_text("{}")  # an earlier export's tokenizer file
    (out / "model-00001-of-00002.safetensors").write_bytes(b"stale")
    convert.main(["--direction", "run2hf", "--in", str(run[0]), "--out", str(out), "--step", "2", "--overwrite"])
    assert digest(out) == digest(exported)


@pytest.mark.slow
@pytest.mark.parametrize(
    "change, match",
    [
        (dict(step=7), r"--step 7 is not a finished checkpoint .*steps: \[1, 2\]"),
        (dict(model_type="mixtral"), r"cannot be exported as mixtral.*ModelConfig\.qk_norm must be False"),
        (dict(out="full"), r"is not empty; pass --overwrite"),
        (dict(out="inside"), r"inside the run's workdir"),
        (dict(workdir="empty"), r"not a run's workdir: it has no config\.json"),
    ],
    ids=["no_such_step", "model_type", "out_not_empty", "out_in_workdir", "not_a_workdir"],
)
def test_what_cannot_be_exported_is_refused_before_writing(run, exported, tmp_path, change, match):
    workdir = tmp_path if change.get("workdir") == "empty" else run[0]
    out = {"full": exported, "inside": run[0] / "hf"}.get(change.get("out"), tmp_path / "hf")
    before = digest(out) if out.exists() else None
    with pytest.raises(ConfigError, match=match):
        convert.run_to_hf(workdir, out, step=change.get("step"), model_type=change.get("model_type"))
    assert (digest(out) if out.exists() else None) == before


@pytest.mark.slow
def test_cli_refuses_in_one_line_with_exit_code_2(run, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        convert.main(["--direction", "run2hf", "--in", str(run[0]), "--out", str(tmp_path / "hf"), "--step", "0"])
    assert e.value.code == 2 and not (tmp_path / "hf").exists()
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.endswith(f": error: --step 0 is not a finished checkpoint of {run[0]}; steps: [1, 2]")


@pytest.mark.slow
def test_the_runs_workdir_is_unchanged(run, exported):
    """Last: after every export and refusal above, the workdir holds the same files with the same bytes."""
    assert digest(run[0]) == run[1]


def test_a_run_started_from_a_mixtral_checkpoint_exports_as_mixtral(tmp_path):
    """Model type and max length default to those of the run's config.hf_checkpoint. The workdir is
    written by the trainer's own pieces (config record, Checkpointer), holding the checkpoint's weights."""
    source = ROOT / "tests" / "fixtures" / "mixtral_tiny"
    c = base_config("gspo", "tiny")
    c.hf_checkpoint, c.warm_start.steps = str(source), 0
    workdir = tmp_path / "run"
    workdir.mkdir()
    workdir_lib.record_config(workdir, config_lib.as_json(c), [])
    _, _, state = hf.load_hf_checkpoint(source)
    with Checkpointer(workdir / "checkpoints", async_save=False) as ckpt:
        ckpt.save(3, {"step": np.int32(0), "params": state}, {}, force=True)
    out, before = tmp_path / "hf", digest(workdir)
    assert convert.run_to_hf(workdir, out)[1] == 3
    assert digest(workdir) == before
    hf_cfg = json.loads((out / "config.json").read_text())
    assert hf_cfg["model_type"] == "mixtral" and hf_cfg["max_position_embeddings"] == 131072
    assert (hf_cfg["bos_token_id"], hf_cfg["eos_token_id"], hf_cfg["pad_token_id"]) == (BOS_ID, EOS_ID, PAD_ID)
    got, want = hf.state_to_params(hf.load_hf_checkpoint(out)[2]), hf.state_to_params(state)
    assert got.keys() == want.keys() and all(got[k].tobytes() == want[k].tobytes() for k in want)


@pytest.mark.parametrize(
    "cfg, model_type",
    [
        (model_config.get("tiny"), "qwen3_moe"),
        (model_config.ModelConfig(num_experts=0, mlp_dim=96, dispatch="dense", z_loss_coef=0.1), "qwen3_moe"),
        (dataclasses.replace(MIXTRAL_8X7B, mlp_dim=7), "mixtral"),  # mlp_dim: no dense layer uses it
    ],
    ids=["tiny", "all_dense", "mixtral"],
)
def test_exportable_config_accepts_what_reloads_as_the_same_model(cfg, model_type):
    assert hf_config.exportable_config(cfg, model_type) == hf_config.config_to_hf(cfg, model_type)

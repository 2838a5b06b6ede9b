"""Trackers (gspo_jax/trackers.py), with the real packages and no account or server: a tiny run logged to
W&B offline and to MLflow on a local SQLite file, stopped and resumed, then read back (W&B's offline run
files, MLflow's client): one run in each, continued by the resume, with the config, every metric row at
its step (equal to metrics.jsonl's), the sample tables, and a sweep's group, arm and seed; bad keys and a
missing package refused at build in one line; the sweep runner names its runs' group and arm."""

import glob
import json
import struct
from pathlib import Path

import pytest
from test_train import _metrics, _sigterm_after

from gspo_jax import run as run_lib
from gspo_jax import trackers
from gspo_jax import workdir as workdir_lib
from gspo_jax.built import build
from gspo_jax.config import as_json, base_config
from gspo_jax.study import sweeps
from gspo_jax.validation import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def wandb_records(path: str):
    """The protobuf records of a W&B run file (`run-<id>.wandb`: a LevelDB-style log of 32 KiB blocks,
    each record a 7-byte header — checksum, length, kind — and its bytes, split across blocks)."""
    from wandb.proto import wandb_internal_pb2

    data, block, header = Path(path).read_bytes(), 32768, 7
    assert struct.unpack("<4sHB", data[:7])[:2] == (b":W&B", 0xBEE1), "not a W&B run file"
    pos, pending = 7, b""
    while pos + header <= len(data):
        if block - pos % block < header:  # the rest of a block too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + header])
        body, pos = data[pos + header : pos + header + length], pos + header + length
        if kind == 0:
            continue
        pending = body if kind in (1, 2) else pending + body  # full / first, or middle / last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def tracked_config(tmp_path):
    c = base_config("gspo", "tiny")
    c.train.update(num_iterations=3, eval_every=2)
    c.logging.update(group="tiny_sweep", arm="gspo-lr=0.01", tags="mine, again")
    c.logging.wandb.update(project="gspo_jax_tests", mode="offline")
    c.logging.mlflow.update(tracking_uri=str(tmp_path / "mlflow.db"), experiment="tests")
    return c


@pytest.mark.slow
def test_a_run_logs_to_wandb_offline_and_mlflow_and_its_resume_continues_the_same_runs(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the trackers extra: pip install -e '.[trackers]'")
    from mlflow.tracking import MlflowClient

    c, workdir = tracked_config(tmp_path), tmp_path / "run"
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # started from another directory than the store's
    with monkeypatch.context() as m, pytest.raises(run_lib.StoppedEarly):
        _sigterm_after(m, 0)
        run_lib.train_and_evaluate(build(c), workdir, progress=False)
    ids = json.loads((workdir / trackers.IDS_FILE).read_text())
    run_lib.train_and_evaluate(build(c), workdir, progress=False)
    assert json.loads((workdir / trackers.IDS_FILE).read_text()) == ids  # the resume kept both runs
    rows = {r["step"]: r for r in _metrics(workdir)}
    assert sorted(rows) == [0, 1, 2, 3]

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert [r.info.run_id for r in runs] == [ids["mlflow"]] and runs[0].info.status == "FINISHED"
    run = runs[0].data
    assert {k: run.tags[k] for k in ("group", "arm", "seed")} == {
        "group": "tiny_sweep",
        "arm": "gspo-lr=0.01",
        "seed": "0",
    }
    assert "mine" in run.tags and "again" in run.tags
    assert run.params["algorithm"] == "gspo" and run.params["rollout.group_size"] == str(c.rollout.group_size)
    for key in ("reward_mean", "loss", "eval_accuracy"):
        history = {m.step: m.value for m in client.get_metric_history(ids["mlflow"], key)}
        assert history == {s: r[key] for s, r in rows.items() if key in r}, key  # each step once, as in JSONL

    def artifact(name: str):
        return json.loads(Path(client.download_artifacts(ids["mlflow"], name, str(tmp_path))).read_text())

    samples = artifact("samples/step_2.json")
    assert samples["columns"][:3] == ["prompt", "completion", "reward"] and len(samples["data"]) >= 1
    assert artifact("config.json") == json.loads((workdir / "config.json").read_text())
    assert (tmp_path / "mlartifacts").is_dir() and not (tmp_path / "elsewhere" / "mlruns").exists()

    files = sorted(glob.glob(str(workdir / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(files) == 2 and all(f.endswith(f"run-{ids['wandb']}.wandb") for f in files)  # one run, two attempts
    steps, tables, seen_config = {}, set(), False
    for path in files:
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                r = record.run
                updates = {u.key: json.loads(u.value_json) for u in r.config.update}
                seen_config |= updates.get("algorithm") == "gspo"
                assert (r.run_id, r.project, r.run_group) == (ids["wandb"], "gspo_jax_tests", "tiny_sweep")
                assert list(r.tags) == ["arm:gspo-lr=0.01", "seed:0", "mine", "again"]
            elif kind == "config":
                seen_config |= any(
                    u.key == "algorithm" and json.loads(u.value_json) == "gspo" for u in record.config.update
                )
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                steps.setdefault(items["_step"], {}).update(items)
                if items.get("samples/_type") == "table-file":
                    tables.add(items["_step"])
    assert seen_config and sorted(steps) == [0, 1, 2, 3] and tables == {0, 2, 3}
    assert all(steps[s]["reward_mean"] == rows[s]["reward_mean"] for s in (1, 2, 3))


@pytest.mark.parametrize(
    "key, value, words",
    [
        (
            "wandb.mode",
            "cloud",
            "config.logging.wandb.mode='cloud' is not allowed; choose one of ('online', 'offline')",
        ),
        ("tags", 3, "config.logging.tags=3 is not allowed; a string"),
    ],
)
def test_bad_logging_keys_are_refused_at_build_in_one_line(key, value, words):
    c = base_config("gspo", "tiny")
    with c.ignore_type():
        section, _, name = key.rpartition(".")
        (c.logging[section] if section else c.logging)[name] = value
    with pytest.raises(ConfigError) as e:
        build(c)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("key, package", [("wandb.project", "wandb"), ("mlflow.tracking_uri", "mlflow")])
def test_a_tracker_without_its_package_names_the_extra(monkeypatch, key, package):
    real = trackers.importlib.util.find_spec
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name: None if name == package else real(name))
    c = base_config("gspo", "tiny")
    section, name = key.split(".")
    c.logging[section][name] = "x"
    with pytest.raises(ConfigError) as e:
        build(c)
    assert str(e.value) == f"config.logging.{key}='x' needs the {package} package: pip install -e '.[trackers]'"


def test_a_sweeps_runs_carry_its_name_and_their_arm_and_resume_when_only_logging_changes(tmp_path):
    sweep = sweeps.load_sweep(ROOT / "configs" / "sweeps" / "tiny.py", ROOT)
    run = sweep.runs[0]
    args = run.train_args(tmp_path / "runs" / run.name)
    assert f"--config.logging.group={sweep.name}" in args and f"--config.logging.arm={run.arm}" in args
    c = base_config("gspo", "tiny")
    recorded = json.loads(as_json(c))
    c.logging.update(group="another", arm="x")
    c.logging.mlflow.tracking_uri = "sqlite:///elsewhere.db"
    assert workdir_lib.config_changes(recorded, json.loads(as_json(c))) == []

"""The trackers researchers keep their runs in, beside JSONL and TensorBoard (`writers.MetricWriter`):
Weights & Biases (`logging.wandb.project`; `mode="offline"` needs no account) and MLflow
(`logging.mlflow.tracking_uri`; a local SQLite file needs no server), optional extras
(`pip install -e '.[trackers]'`). Each logs the config once, every metric row, and at each evaluation
the held-out completions as a table. A resumed run continues the same tracker run: its id is kept in
`<workdir>/trackers.json`. A sweep's runs carry the sweep's name as their group and the arm and seed as
tags (`logging.group`, `logging.arm`; `study/runner.py` sets them), so a tracker groups them as the
sweep report does."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gspo_jax.validation import ConfigError, check, check_choice

IDS_FILE = "trackers.json"  # {"wandb": run id, "mlflow": run id}: what a resumed run continues
WANDB_MODES = ("online", "offline")
EXTRA = "pip install -e '.[trackers]'"


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """`config.logging`: where a run is tracked besides its workdir ("" turns a tracker off)."""

    group: str = ""  # a sweep's name: W&B's group, an MLflow tag
    arm: str = ""  # a sweep's arm: a tag of both
    tags: str = ""  # comma-separated tags of your own
    wandb_project: str = ""
    wandb_entity: str = ""
    wandb_name: str = ""  # "" : the workdir's name
    wandb_mode: str = "online"
    mlflow_tracking_uri: str = ""  # a server's URL, an sqlite:/// URI, or a local path (an SQLite file)
    mlflow_experiment: str = "gspo_jax"
    mlflow_run_name: str = ""  # "" : the workdir's name

    def tag_list(self, seed: int) -> list[str]:
        """The run's tags: the arm and seed of a sweep's run, then `tags`."""
        own = [t.strip() for t in self.tags.split(",") if t.strip()]
        return ([f"arm:{self.arm}", f"seed:{seed}"] if self.arm else []) + own


def logging_config(section: Mapping[str, Any]) -> LoggingConfig:
    """`config.logging` typed and checked (a one-line `ConfigError` naming the key): a tracker that is on
    needs its package, named with the extra that installs it."""
    section = dict(section)
    wandb, mlflow = dict(section.pop("wandb", {})), dict(section.pop("mlflow", {}))
    values = {**section, **{f"wandb_{k}": v for k, v in wandb.items()}, **{f"mlflow_{k}": v for k, v in mlflow.items()}}
    known = {f.name for f in dataclasses.fields(LoggingConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"config.logging: unknown keys {unknown}")
    for k, v in values.items():
        check(
            isinstance(v, str),
            "config",
            "logging." + k.replace("wandb_", "wandb.").replace("mlflow_", "mlflow."),
            v,
            "a string",
        )
    cfg = LoggingConfig(**values)
    check_choice("config", "logging.wandb.mode", cfg.wandb_mode, WANDB_MODES)
    for key, on, package in (
        ("logging.wandb.project", cfg.wandb_project, "wandb"),
        ("logging.mlflow.tracking_uri", cfg.mlflow_tracking_uri, "mlflow"),
    ):
        if on and importlib.util.find_spec(package) is None:
            raise ConfigError(f"config.{key}={on!r} needs the {package} package: {EXTRA}")
    return cfg


class Tracker:
    """What `MetricWriter` forwards to: a run's config once, its metric rows and its sample tables."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None: ...

    def close(self, finished: bool) -> None: ...


def open_trackers(cfg: LoggingConfig, workdir: Path, config_json: str, seed: int) -> list[Tracker]:
    """The trackers `cfg` turns on, each continuing the workdir's run of it when there is one (its id in
    `IDS_FILE`), else starting one and recording its id there."""
    ids_path = Path(workdir) / IDS_FILE
    ids = json.loads(ids_path.read_text()) if ids_path.exists() else {}
    config = json.loads(config_json)
    out: list[Tracker] = []
    if cfg.wandb_project:
        out.append(WandbTracker(cfg, Path(workdir), config, seed, ids))
    if cfg.mlflow_tracking_uri:
        out.append(MlflowTracker(cfg, Path(workdir), config, seed, ids))
    if out:
        tmp = ids_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(ids, indent=2))
        os.replace(tmp, ids_path)
    return out


def _finite(metrics: Mapping[str, float]) -> dict[str, float]:
    """A row's values for a tracker: an undefined one (NaN) is a gap, as in TensorBoard."""
    return {k: float(v) for k, v in metrics.items() if not math.isnan(float(v))}


class WandbTracker(Tracker):
    """A W&B run in `<workdir>/wandb` (offline: its files stay there until `wandb sync`)."""

    def __init__(self, cfg: LoggingConfig, workdir: Path, config: dict, seed: int, ids: dict):
        import wandb

        ids.setdefault("wandb", uuid.uuid4().hex[:12])  # W&B run ids: lowercase letters and digits
        self.run = wandb.init(
            project=cfg.wandb_project,
            entity=cfg.wandb_entity or None,
            name=cfg.wandb_name or workdir.name,
            group=cfg.group or None,
            tags=cfg.tag_list(seed),
            config=config,
            dir=str(workdir),
            mode=cfg.wandb_mode,
            id=ids["wandb"],
            resume="allow",
            settings=wandb.Settings(console="off", quiet=True),
        )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(_finite(metrics), step=step)

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        import wandb

        columns = list(samples[0])
        table = wandb.Table(columns=columns, data=[[s.get(c) for c in columns] for s in samples])
        self.run.log({"samples": table}, step=step)

    def close(self, finished: bool) -> None:
        self.run.finish(exit_code=0 if finished else 1)


class MlflowTracker(Tracker):
    """An MLflow run on `tracking_uri` (a server, or a local SQLite file): the config as
    flat params and as `config.json`, metrics by step, samples as `samples/step_<n>.json` tables."""

    def __init__(self, cfg: LoggingConfig, workdir: Path, config: dict, seed: int, ids: dict):
        from mlflow.tracking import MlflowClient

        uri = cfg.mlflow_tracking_uri
        if ":" not in uri:  # a local path: an SQLite store in that file (MLflow 3 retired the file store)
            uri = f"sqlite:///{Path(uri).absolute()}"
        # A local store's artifacts beside its file (MLflow would put them in ./mlruns, under whatever
        # directory the run was started from); a server keeps its own.
        artifacts = None
        if uri.startswith("sqlite:///"):
            artifacts = (Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts").absolute().as_uri()
        self.client = client = MlflowClient(tracking_uri=uri)
        experiment = client.get_experiment_by_name(cfg.mlflow_experiment)
        experiment_id = (
            experiment.experiment_id
            if experiment
            else client.create_experiment(cfg.mlflow_experiment, artifact_location=artifacts)
        )
        if "mlflow" in ids:  # resumed: the same run, running again
            self.run_id = ids["mlflow"]
            client.update_run(self.run_id, status="RUNNING")
            return
        tags = {"workdir": str(workdir.absolute()), "seed": str(seed)}
        tags.update({"group": cfg.group} if cfg.group else {})
        tags.update({"arm": cfg.arm} if cfg.arm else {})
        tags.update({t: "" for t in cfg.tag_list(seed)[2 if cfg.arm else 0 :]})
        run = client.create_run(experiment_id, run_name=cfg.mlflow_run_name or workdir.name, tags=tags)
        self.run_id = ids["mlflow"] = run.info.run_id
        from mlflow.entities import Param

        params = [Param(k, str(v)[:6000]) for k, v in _flat(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            client.log_batch(self.run_id, params=params[i : i + 100])
        client.log_dict(self.run_id, config, "config.json")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [Metric(k, v, now, step) for k, v in _finite(metrics).items()]
        for i in range(0, len(rows), 1000):  # MLflow takes at most 1000 metrics a batch
            self.client.log_batch(self.run_id, metrics=rows[i : i + 1000])

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        # `log_table`'s JSON (pandas' "split" layout) without pandas: the columns, then a list per row
        columns = list(samples[0])
        table = {"columns": columns, "data": [[s.get(c) for c in columns] for s in samples]}
        self.client.log_dict(self.run_id, table, f"samples/step_{step}.json")

    def close(self, finished: bool) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if finished else "KILLED")


def _flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, Mapping) else {f"{prefix}{k}": v})
    return out

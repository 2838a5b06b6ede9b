"""MetricWriter JSONL/TensorBoard output, read_metrics resume handling, and the PNG plots."""

import io
import json
import math
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax import plots
from gspo_jax.progress import Progress
from gspo_jax.writers import MetricWriter, read_metrics

REPO = Path(__file__).resolve().parent.parent


def test_jsonl_values_and_types(tmp_path):
    with MetricWriter(tmp_path) as w:
        w.write(
            1,
            {
                "py": 0.5,
                "np32": np.float32(0.25),
                "np_int": np.int64(3),
                "jax": jnp.float32(1.5),
                "jax_int": jnp.int32(7),
                "flag": True,
            },
        )
        w.write(2, {"nan": float("nan"), "inf": np.float32(np.inf), "ninf": jnp.float32(-jnp.inf)})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)  # strict JSON: no bare NaN/Infinity
    assert first["step"] == 1 and isinstance(first["time"], float)
    assert {k: first[k] for k in ("py", "np32", "np_int", "jax", "jax_int", "flag")} == {
        "py": 0.5,
        "np32": 0.25,
        "np_int": 3,
        "jax": 1.5,
        "jax_int": 7,
        "flag": 1,
    }
    assert (second["nan"], second["inf"], second["ninf"]) == ("nan", "inf", "-inf")
    for line in lines:
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    (rec1, rec2) = read_metrics(tmp_path)
    assert rec1["np32"] == 0.25
    assert math.isnan(rec2["nan"]) and rec2["inf"] == math.inf and rec2["ninf"] == -math.inf


def test_rejects_non_scalars_and_reserved_names(tmp_path):
    with MetricWriter(tmp_path, tensorboard=False) as w:
        with pytest.raises(TypeError):
            w.write(1, {"vec": np.ones(3)})
        with pytest.raises(TypeError):
            w.write(1, {"s": "text"})
        with pytest.raises(ValueError):
            w.write(1, {"step": 3.0})


def test_undefined_metrics_stay_in_the_jsonl_and_out_of_tensorboard(tmp_path):
    """A NaN metric (undefined, e.g. the flipped tokens' clip fraction when none flipped) is kept as
    "nan" in metrics.jsonl and left out of TensorBoard (tensorboardX warned once per value); an
    infinity, a real blow-up, is charted."""
    scalars = []
    with MetricWriter(tmp_path) as w:
        w._tb.add_scalar = lambda k, v, step: scalars.append((k, v, step))
        w.write(2, {"a": 1.5, "clip_frac_flipped": math.nan, "b": math.inf})
    assert scalars == [("a", 1.5, 2), ("b", math.inf, 2)]
    (row,) = read_metrics(tmp_path)
    assert row["a"] == 1.5 and math.isnan(row["clip_frac_flipped"]) and row["b"] == math.inf


def test_disabled_writer_writes_nothing(tmp_path):
    w = MetricWriter(tmp_path / "run", enabled=False)
    w.write(1, {"a": 1.0})
    w.write_samples(1, [{"completion": "hello"}])
    w.close()
    assert not (tmp_path / "run").exists()


def test_tensorboard_and_samples(tmp_path):
    with MetricWriter(tmp_path) as w:
        w.write(3, {"reward_mean": 0.5})
        w.write_samples(3, [{"prompt": "2+2?", "completion": "#### 4", "reward": 1.0}, {"completion": "5"}])
        w.write_samples(4, [])
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    first, second = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert first.pop("time") == second.pop("time")
    assert first == {"step": 3, "prompt": "2+2?", "completion": "#### 4", "reward": 1.0}
    assert second == {"step": 3, "completion": "5"}


def test_resume_appends_and_read_metrics_dedups(tmp_path):
    with MetricWriter(tmp_path, tensorboard=False) as w:
        for step in range(1, 6):
            w.write(step, {"loss": float(step)})
        w.write(5, {"eval_accuracy": 0.5})  # same step, separate write: merged
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "loss": 6.')  # the crash cut this line short
    with MetricWriter(tmp_path, tensorboard=False) as w:  # resumed from a step-3 checkpoint
        for step in range(4, 6):
            w.write(step, {"loss": 10.0 * step})
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in records] == [1.0, 2.0, 3.0, 40.0, 50.0]
    assert "eval_accuracy" not in records[-1]  # stale value from the abandoned run is gone
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 9  # appended, not rewritten


def test_read_metrics_missing_file(tmp_path):
    assert read_metrics(tmp_path) == []


def _fake_run(workdir, clip_scale=1.0, steps=20):
    with MetricWriter(workdir, tensorboard=False) as w:
        for s in range(steps):
            w.write(
                s,
                {
                    "reward_mean": s / steps,
                    "accuracy": s / (2 * steps),
                    "clip_frac": clip_scale * 1e-4 * (1 + s),
                    "seq_clip_frac": 0.2,
                    "approx_kl": 1e-3 * s,
                },
            )


def test_plot_run_writes_pngs_and_skips_missing(tmp_path):
    _fake_run(tmp_path)
    paths = plots.plot_run(tmp_path)
    assert sorted(p.name for p in paths) == [
        "accuracy.png",
        "clip_fraction.png",
        "kl.png",
        "reward.png",
    ]  # no drift keys -> no drift plot
    for p in paths:
        assert p.parent == tmp_path / "plots"
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 1000


def test_plot_run_no_data(tmp_path):
    assert plots.plot_run(tmp_path, tmp_path / "out") == []
    assert not (tmp_path / "out").exists()


def test_plot_comparison(tmp_path):
    for name, scale in (("grpo", 1.0), ("gspo", 100.0)):
        _fake_run(tmp_path / name, scale)
    out = plots.plot_comparison(
        {"grpo": tmp_path / "grpo", "gspo": tmp_path / "gspo"}, "reward_mean", tmp_path / "cmp" / "reward.png"
    )
    assert out.exists() and out.stat().st_size > 1000
    assert plots.plot_comparison({"grpo": tmp_path / "grpo"}, "nope", tmp_path / "x.png") is None
    assert not (tmp_path / "x.png").exists()


def test_plot_cli(tmp_path):
    _fake_run(tmp_path / "gspo")
    _fake_run(tmp_path / "grpo")
    out = tmp_path / "readme.png"
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "plot.py"),
            str(tmp_path / "gspo"),
            "--compare",
            f"grpo={tmp_path / 'grpo'}",
            "--key",
            "reward_mean",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert out.stat().st_size > 1000
    assert (tmp_path / "gspo" / "plots" / "reward.png").exists()


def test_missing_tensorboardx_falls_back_to_jsonl(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # makes the import raise ImportError
    with MetricWriter(tmp_path) as w:
        w.write(1, {"a": 1.0})
    assert read_metrics(tmp_path)[0]["a"] == 1.0
    assert not (tmp_path / "tb").exists()
    assert any("tensorboardX" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------ progress in log files


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_plain_lines_in_a_log_file_and_a_bar_on_a_terminal():
    metrics = {"reward_mean": 0.5, "accuracy": 0.25}
    log_file = io.StringIO()
    with Progress(5, 0, "gspo", every=2, stream=log_file) as progress:
        for _ in range(5):
            progress.update(metrics)
    lines = log_file.getvalue().splitlines()
    assert [x.split()[1] for x in lines] == ["2/5", "4/5", "5/5"]  # every 2nd, and the last
    assert all("reward_mean=0.5000 accuracy=0.2500" in x for x in lines) and "\r" not in log_file.getvalue()

    resumed = io.StringIO()
    with Progress(5, 3, "gspo", every=10, stream=resumed) as progress:
        progress.update(metrics)
    assert resumed.getvalue() == ""  # 4/5: neither a multiple of 10 nor the last

    terminal = _Terminal()
    with Progress(5, 0, "gspo", every=2, stream=terminal) as progress:
        progress.update(metrics)
    assert "\r" in terminal.getvalue() and "1/5" in terminal.getvalue()  # tqdm's bar

    quiet = _Terminal()
    with Progress(5, 0, "gspo", enabled=False, stream=quiet) as progress:
        for _ in range(5):
            progress.update(metrics)
    assert quiet.getvalue() == ""

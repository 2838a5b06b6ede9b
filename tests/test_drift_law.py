"""The drift law's fit (gspo_jax.study.drift_law) on runs made to follow a known power law: the slopes and
the extrapolation come back, by hand on exact data and within their intervals on noisy data; and the
command writes its figure and docs section from a workroot of such runs."""

import json
import math

import numpy as np
import pytest

from gspo_jax.study import drift_law as dl
from gspo_jax.study import report, sweeps
from gspo_jax.study.sweeps import STATE_FILE

ROOT = sweeps.Path(__file__).resolve().parents[1]
SWEEP = ROOT / "configs" / "sweeps" / "drift_scaling.py"
TRUE = dict(moe_layers=0.8, experts=0.3, top_k=0.5, length=0.4)  # slopes on the log-odds / log scale
LENGTHS = {
    "operands=2-digits=1-working=0.0": 5.0,
    "working=1.0-max_new_tokens=16": 12.0,
    "digits=1-working=1.0-max_new_tokens=72": 55.0,
}


def length_of(arm: str) -> float:
    for key, n in LENGTHS.items():
        if key in arm:
            return n
    return 100.0 if "digits=3" in arm else 36.0


def truth(dials: dict, metric: str) -> float:
    """The metric's value at `dials`: a separable power law through the center (36 tokens) at 0.2 (or 0.05 nats)."""
    scale = dl.METRICS[metric][0]
    base = {**{d: float(v) for d, v in dl.CENTER.items()}, "length": 36.0}
    y = float(dl.forward(0.2 if scale == "logit" else 0.05, scale))
    y += sum(TRUE[d] * (math.log(dials[d]) - math.log(base[d])) for d in dl.DIALS)
    return float(dl.inverse(y, scale))


def write_workroot(root, noise: float, seed: int = 0):
    """Every run of the sweep finished, its metrics the law's values times seed noise (log-normal)."""
    rng = np.random.default_rng(seed)
    sweep = sweeps.load_sweep(SWEEP, ROOT)
    for run in sweep.runs:
        d = sweeps.workdir(root, run)
        d.mkdir(parents=True)
        dials = {**dl.dials_of(run.overrides), "length": length_of(run.arm)}
        rows = [{"step": 0, "eval_accuracy": 0.5}]
        for step in range(1, 11):
            row = {"step": step, dl.LENGTH_KEY: dials["length"]}
            for m in dl.METRICS:
                v = truth(dials, m) * math.exp(noise * rng.normal())
                row[m] = min(v, 0.999) if dl.METRICS[m][0] == "logit" else v
            rows.append(row)
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (d / STATE_FILE).write_text(json.dumps(dict(status="done", attempts=[], tail=[])))
    return sweep


def test_a_line_by_hand_and_one_dial_per_arm():
    f = dl.fit_line([0.0, 1.0, 2.0], [1.0, 3.0, 5.0])
    assert (f.slope, f.intercept, f.lo, f.hi, f.n) == pytest.approx((2.0, 1.0, 2.0, 2.0, 3))
    noisy = dl.fit_line([0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 1.0, 2.0])  # slope 0.6, residuals ±0.1, ±0.3: SSR 0.2
    half = 4.303 * math.sqrt(0.2 / 2 / 5.0)  # t(2) · sqrt(SSR / (n - 2) / Sxx)
    assert (noisy.slope, noisy.lo, noisy.hi) == pytest.approx((0.6, 0.6 - half, 0.6 + half))
    assert dl.moved_dial({"model.num_experts": 8}) == "experts"
    assert dl.moved_dial({"task.arithmetic.operands": 8, "max_new_tokens": 72}) == "length"
    assert dl.moved_dial({}) is None
    with pytest.raises(ValueError, match="one dial at a time"):
        dl.moved_dial({"model.num_experts": 8, "model.top_k": 4})


def test_exact_runs_give_back_the_slopes_and_the_extrapolation(tmp_path):
    sweep = write_workroot(tmp_path, noise=0.0)
    pts = dl.points(report.collect(sweep, tmp_path))
    assert len(pts) == len(sweep.runs) == 51
    for metric in ("drift_slot_change_rate", "abs_log_ratio_p99_flipped"):
        w = dl.law(pts, metric, boot=20)
        for dial, f in w.fits.items():
            assert f.slope == pytest.approx(TRUE[dial], abs=1e-9) and f.lo == pytest.approx(f.hi, abs=1e-6)
        want = truth(dl.QWEN3, metric)
        assert (w.qwen3, w.qwen3_lo, w.qwen3_hi) == pytest.approx((want, want, want), rel=1e-9)
        assert w.center == pytest.approx(truth({**dl.CENTER, "length": 36.0}, metric))


def test_noisy_runs_cover_the_true_slopes_and_the_command_writes_its_section(tmp_path):
    sweep = write_workroot(tmp_path, noise=0.05, seed=1)
    pts = dl.points(report.collect(sweep, tmp_path))
    w = dl.law(pts, "drift_token_any_flip", boot=100)
    assert all(f.lo < TRUE[d] < f.hi for d, f in w.fits.items())
    assert w.qwen3_lo < truth(dl.QWEN3, "drift_token_any_flip") < w.qwen3_hi
    from scripts.drift_law import main

    doc = tmp_path / "RESULTS.md"
    doc.write_text("# Results\n\nbefore\n")
    assert main(["--workroot", str(tmp_path), "--write", "--doc", str(doc), "--boot", "20"]) == 0
    text = doc.read_text()
    assert text.startswith("# Results\n\nbefore\n") and text.count(dl.BEGIN) == 1
    assert "`drift_slot_change_rate`" in text and (tmp_path / "report" / "drift_law.png").stat().st_size > 0
    assert main(["--workroot", str(tmp_path), "--write", "--doc", str(doc), "--boot", "20"]) == 0
    assert doc.read_text() == text  # regenerated in place, not appended again


def test_without_every_dials_cells_there_is_no_law(tmp_path):
    sweep = write_workroot(tmp_path, noise=0.0)
    pts = [p for p in dl.points(report.collect(sweep, tmp_path)) if p.moves != "top_k"]
    assert dl.law(pts, "drift_slot_change_rate") is None
    assert dl.missing(pts) == ["top_k"]  # the center alone is one cell: no line
    assert dl.missing([p for p in pts if p.moves == "experts"]) == ["the center cell", "moe_layers", "top_k", "length"]
    assert dl.missing(dl.points(report.collect(sweep, tmp_path))) == []

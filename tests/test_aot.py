"""Deviceless ahead-of-time compilation for a TPU slice (gspo_jax/aot.py, scripts/aot_compile.py).
Needs libtpu, which `.ci/run` installs with the `tpu` extra; no TPU is attached."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gspo_jax import aot, flops
from gspo_jax.config import base_config, build
from gspo_jax.validation import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def tiny_on_four_chips():
    c = base_config("gspo", "tiny")
    c.mesh.update(fsdp=2, expert=2)
    return c


@pytest.mark.slow
def test_every_program_compiles_for_a_slice_and_fits():
    c = tiny_on_four_chips()
    rows = aot.compile_report(c, "v5p:2x2x1")
    assert [r.program for r in rows] == list(aot.PROGRAMS)
    cfg, B = build(c, device_count=4).model, c.rollout.num_groups * c.rollout.group_size
    T, hbm, peak = c.prompt_len + c.max_new_tokens, 95.74 * aot.GIB, aot.CHIPS["v5p"][1]
    want_flops = {
        "train_step": flops.train_flops(cfg, B // c.train.minibatches, T),
        "score": flops.forward_flops(cfg, B, T),
        "sample": flops.sample_flops(cfg, B, c.prompt_len, c.max_new_tokens),
    }
    for r in rows:
        assert r.argument_bytes > 0 and r.temp_bytes > 0 and r.compile_seconds > 0
        assert r.hbm_bytes == int(hbm) and r.fits and 0 < r.hbm_fraction < 0.01
        assert r.flops == want_flops[r.program]
        assert r.seconds_at_mfu == pytest.approx(r.flops / (0.4 * peak * 4))
    train_step = rows[0]
    assert train_step.alias_bytes > 0  # the donated train state is updated in place
    table = aot.format_report(rows, "v5p:2x2x1", 1, "none").splitlines()
    assert len(table) == 2 + len(rows) and all("| v5p:2x2x1 | fsdp=2×expert=2 |" in line for line in table[2:])


def test_row_arithmetic_by_hand():
    r = aot.Row("score", "fsdp=2", "1 × 1", 10, 6, 4, 100, 110, 1.0, 8e12, 0.1)
    assert r.total_bytes == 10 + 6 - 4 + 100 and not r.fits  # 112 bytes do not fit in 110
    assert r.hbm_fraction == pytest.approx(112 / 110)
    assert aot.Row("score", "fsdp=2", "", 10, 6, 4, 98, 110, 1.0, 0.0, 0.0).fits  # exactly 110
    assert not aot.Row("score", "fsdp=2", "", 10, 0, 0, 1, 110, 1.0, 0.0, 0.0, refused="XLA: out of HBM").fits


@pytest.mark.parametrize(
    "topology, match",
    [("v9z:2x2", r"topology: 'v9z:2x2' is not '<chip>:<shape>'"), ("v5p", "is not '<chip>:<shape>'")],
)
def test_bad_topology_named(topology, match):
    with pytest.raises(ConfigError, match=match):
        aot.compile_report(tiny_on_four_chips(), topology)


def test_mesh_checked_against_the_slice_not_this_machine():
    c = tiny_on_four_chips()
    c.mesh.update(fsdp=4, expert=2)  # 8 devices on a 4-chip slice
    with pytest.raises(ConfigError, match=r"config\.mesh=.*there are 4 devices"):
        aot.compile_report(c, "v5p:2x2x1", ("score",))
    with pytest.raises(ConfigError, match=r"programs: \['decode'\]"):
        aot.compile_report(tiny_on_four_chips(), "v5p:2x2x1", ("decode",))


@pytest.mark.slow
def test_script_prints_the_table_and_writes_json(tmp_path):
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "scripts/aot_compile.py", "--config", "configs/grpo.py:tiny", "--topology", "v5p:2x2x1"]
    cmd += ["--config.mesh.fsdp=4", "--programs", "score", "--json", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [line for line in p.stdout.splitlines() if line.startswith("| v5p:2x2x1 |")]
    assert len(rows) == 1 and "| fsdp=4 | score |" in rows[0] and "| yes |" in rows[0]
    (row,) = json.loads(out.read_text())
    assert row["program"] == "score" and row["fits"] and row["total_bytes"] > 0
    bad = subprocess.run(cmd[:5] + ["--topology", "v5p"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and bad.stderr.startswith("error: topology:")

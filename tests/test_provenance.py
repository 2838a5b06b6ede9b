"""What ran a run: one record per start of a workdir, read back; labels by hand."""

import json
import re
import subprocess
from pathlib import Path

import jax

from gspo_jax import provenance

ROOT = Path(__file__).resolve().parents[1]


def test_each_start_appends_a_record_of_this_process_and_a_cut_off_line_is_skipped(tmp_path):
    first = provenance.record(tmp_path)
    with open(tmp_path / provenance.PROVENANCE_FILE, "a") as f:
        f.write('{"time": "2026-')  # a crash in the middle of a write
    second = provenance.record(tmp_path)
    assert provenance.read(tmp_path) == [first, second]
    assert (first["platform"], first["devices"], first["processes"]) == ("cpu", jax.device_count(), 1)
    assert first["device_kind"] == jax.devices()[0].device_kind and first["cores"] >= 1 and first["cpu"]
    assert first["versions"]["jax"] == jax.__version__ and first["versions"]["flax"]
    assert provenance.read(tmp_path / "never_started") == []
    assert provenance.device_slug() == "cpu"  # a result file's name: "nvidia-h100-80gb-hbm3" on that GPU


def test_the_commit_is_this_checkouts():
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    if not head:  # not a git checkout: nothing to name
        assert provenance.commit() == ""
        return
    assert re.fullmatch(r"[0-9a-f]{40}( \+ changes)?", provenance.commit())
    assert provenance.commit().split()[0] == head


def test_labels_name_the_accelerator_or_the_cpu_and_a_run_that_moved_names_both(tmp_path):
    cpu = dict(platform="cpu", cpu="AMD EPYC", cores=2, device_kind="cpu", devices=8)
    h200 = dict(platform="gpu", device_kind="NVIDIA H200", devices=1)
    pod = dict(platform="tpu", device_kind="TPU v5p", devices=32)
    assert provenance.label(cpu) == "CPU: AMD EPYC, 2 cores"
    assert provenance.label(h200) == "NVIDIA H200" and provenance.label(pod) == "TPU v5p × 32"
    (tmp_path / provenance.PROVENANCE_FILE).write_text("".join(json.dumps(r) + "\n" for r in (cpu, cpu, h200, cpu)))
    assert provenance.devices_of(tmp_path) == "CPU: AMD EPYC, 2 cores then NVIDIA H200"
    assert provenance.devices_of(tmp_path / "none") == ""

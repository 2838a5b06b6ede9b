"""scripts/evaluate.py: a run's checkpoint (its latest or a named one) or a Hugging Face checkpoint scored
with greedy accuracy, avg@n, pass@k, maj@k, completion length and truncation, printed and written as JSON;
the same seed gives the same numbers; bad arguments are refused in one line. The run is made without
training (`test_drift_script.make_run`)."""

import contextlib
import importlib.util
import io
import json
from pathlib import Path

import pytest
from test_drift_script import STEPS, make_run

from gspo_jax import workdir as workdir_lib
from gspo_jax.config import as_json, base_config

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("evaluate_script", ROOT / "scripts" / "evaluate.py")
evaluate_script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(evaluate_script)

SMALL = ("--samples", 4, "--num_prompts", 6, "--batch_prompts", 4, "--no_progress")  # a padded last batch


def call(*argv) -> tuple[int, str, str]:
    """The script's main in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = evaluate_script.main([str(a) for a in argv])
        except SystemExit as e:  # argparse
            code = e.code
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("evaluate") / "run", base_config("gspo", "tiny"))


@pytest.mark.slow
def test_a_runs_latest_checkpoint_is_scored_written_and_reproducible(run, tmp_path):
    code, stdout, stderr = call("--workdir", run.workdir, *SMALL)
    assert code == 0, stderr
    out = run.workdir / "eval" / f"{STEPS[-1]}-arithmetic-eval-n4.json"
    report = json.loads(out.read_text())
    assert f"wrote {out}" in stdout and "pass@4" in stdout
    assert (report["step"], report["samples"], report["num_prompts"], report["temperature"]) == (STEPS[-1], 4, 6, 1.0)
    rates = ["greedy_accuracy", "avg@4", "truncation_rate", *(f"{m}@{k}" for m in ("pass", "maj") for k in (1, 2, 4))]
    assert all(0.0 <= report[k] <= 1.0 for k in rates) and report["mean_completion_length"] > 0
    assert report["pass@1"] == pytest.approx(report["avg@4"])  # unbiased pass@1 is the mean accuracy
    assert report["pass@1"] <= report["pass@2"] <= report["pass@4"]
    code, _, _ = call("--workdir", run.workdir, *SMALL, "--out", tmp_path / "again.json")
    assert code == 0 and json.loads((tmp_path / "again.json").read_text()) == report  # the seed fixes every draw
    code, _, stderr = call(
        "--workdir", run.workdir, *SMALL, "--step", STEPS[0], "--temperature", 0.5, "--out", tmp_path
    )
    assert code == 2 and "is a directory" in stderr  # --out names the file; nothing was written
    step_1 = ("--step", STEPS[0], "--temperature", 0.5, "--max_new_tokens", 4)
    code, _, stderr = call("--workdir", run.workdir, *SMALL, *step_1, "--out", tmp_path / "n")
    named = json.loads((tmp_path / "n").read_text())
    assert code == 0 and (named["step"], named["temperature"], named["max_new_tokens"]) == (STEPS[0], 0.5, 4)
    assert named["mean_completion_length"] <= 4


@pytest.mark.slow
def test_a_hugging_face_checkpoint_is_scored():
    code, stdout, stderr = call(
        "--hf_checkpoint", ROOT / "tests/fixtures/qwen3_moe_tiny", *SMALL[:2], "--num_prompts", 2, "--out", "/dev/null"
    )
    assert code == 0, stderr
    assert "source                  qwen3_moe_tiny" in stdout and "pass@4" in stdout


@pytest.mark.parametrize(
    "args, words",
    [
        (("--samples", 0), "--samples=0: must be >= 1"),
        (("--max_new_tokens", 0), "--max_new_tokens=0: must be >= 1"),
        (("--temperature", 0), "--temperature=0.0: must be > 0"),
        (("--top_p", 1.5), "--top_p=1.5: must be in (0, 1]"),
        (("--step", 1, "--hf_checkpoint", "x"), "not allowed with argument"),
        (("--task", "nope"), "--task='nope' is not one of ['arithmetic', 'countdown', 'gsm8k']"),
        (("--step", 99), "--step=99 is not a finished checkpoint"),
        (("--task", "gsm8k"), "the prompt bucket must hold the longest prompt of task 'gsm8k'"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(run, args, words):
    code, stdout, stderr = call("--workdir", run.workdir, *args)
    last = stderr.strip().splitlines()[-1]  # argparse prints its usage first
    assert code == 2 and words in last and "error: " in last and not stdout, stderr


def test_a_workdir_without_a_checkpoint_is_named(tmp_path):
    code, _, stderr = call("--workdir", tmp_path)
    assert code == 2 and stderr == f"error: {tmp_path} is not a run's workdir: it has no config.json\n"
    workdir_lib.record_config(tmp_path, as_json(base_config("gspo", "tiny")), [])
    code, _, stderr = call("--workdir", tmp_path)
    assert code == 2 and stderr == f"error: {tmp_path} has no finished checkpoint to evaluate\n"


def test_more_prompts_than_a_datasets_split_holds_are_refused(tmp_path):
    c = base_config("gspo", "tiny")
    c.task.name, c.prompt_len = "gsm8k", 128
    r = make_run(tmp_path / "run", c)
    code, _, stderr = call("--workdir", r.workdir, "--num_prompts", 10**6)
    assert (
        code == 2 and stderr.startswith("error: --num_prompts=1000000: the eval split has ") and stderr.count("\n") == 1
    )

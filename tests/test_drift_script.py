"""scripts/drift.py and the snapshot library under it: a run's checkpoints read as the trainer resumes
them, one probe set routed by each, pairwise drift that is zero on the diagonal and symmetric where the
metric is, a run left byte-for-byte as it was (an in-flight save skipped), and bad input refused in one
line.

The run is made without training (a real tiny run takes ~45 s here, mostly compiling `train_step`):
the trainer's own `TrainState`, `Checkpointer` and `config.json`, with the parameters moved further
from the initial ones at each step so that routing drifts."""

import contextlib
import hashlib
import importlib.util
import io
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from gspo_jax import checkpoint, sharding, snapshots
from gspo_jax import model as model_lib
from gspo_jax import programs as programs_lib
from gspo_jax import workdir as workdir_lib
from gspo_jax.built import build
from gspo_jax.checkpoint import _COMMIT_MARKER, Checkpointer
from gspo_jax.config import as_json, base_config
from gspo_jax.tasks import prompt_iterator

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("drift_script", ROOT / "scripts" / "drift.py")
drift_script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(drift_script)

STEPS = (1, 2, 3)
IN_FLIGHT = 4  # a save still being written: a copy of step 3 without its commit marker
SYMMETRIC = ("slot_change_rate", "router_flip_rate", "token_any_flip", "flips_per_token", "jaccard", "router_tv")


def hashes(path: Path) -> dict[str, str]:
    """sha256 of every file under `path`: 'unchanged' means equal dicts."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def call(*argv) -> tuple[int, str, str]:
    """scripts/drift.py's main in this process (compiled programs are shared): (code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = drift_script.main([str(a) for a in argv])
        except SystemExit as e:  # argparse
            code = e.code
    return code, out.getvalue(), err.getvalue()


def make_run(workdir: Path, config) -> SimpleNamespace:
    """A workdir as training leaves it, steps `STEPS` checkpointed; the parameters of step s are the
    initial ones plus s × 0.05 × fixed noise."""
    workdir.mkdir(parents=True)
    workdir_lib.record_config(workdir, as_json(config), [])
    built = build(config)
    mesh = sharding.mesh_from_config(**config.mesh)
    # Random parameters drawn by numpy: `model.init` would compile for seconds to draw the same kind.
    graphdef, abstract = model_lib.abstract_model(built.model)
    rng = np.random.default_rng(0)
    draw = lambda a: (rng.standard_normal(a.shape) * a.shape[-1] ** -0.5).astype(a.dtype)
    params = jax.device_put(jax.tree.map(draw, abstract), jax.devices()[0])
    noise = jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(a.dtype), abstract)
    programs = programs_lib.compile_programs(built, graphdef, params, mesh)
    state = programs_lib.init_train_state(programs, params, config.seed)
    prompts = prompt_iterator(built.task, seed=config.seed, split="train")
    with Checkpointer(workdir / "checkpoints", max_to_keep=None) as ckpt:
        for s in STEPS:
            moved = jax.tree.map(lambda p, n, s=s: p + 0.05 * s * n, state.params, noise)
            prompts.next_batch(2)
            meta = dict(iteration=s - 1, prompts=prompts.state())
            ckpt.save(s, state.replace(step=state.step + s, params=moved), meta, force=True)
    return SimpleNamespace(workdir=workdir, config=config, programs=programs, params=params)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("drift") / "run", base_config("gspo", "tiny"))


@pytest.fixture(scope="module")
def result(run):
    """The script on the run, with an in-flight save present: its exit code, output, and the run's
    files before and after."""
    ckpts = run.workdir / "checkpoints"
    shutil.copytree(ckpts / str(STEPS[-1]), ckpts / str(IN_FLIGHT))
    (ckpts / str(IN_FLIGHT) / _COMMIT_MARKER).unlink()
    out = run.workdir.parent / "out"
    before = hashes(run.workdir)
    # 6 prompts in batches of 4: the last batch is padded, and padding must not count.
    code, stdout, stderr = call(run.workdir, "--out", out, "--num_prompts", 6, "--batch_size", 4)
    after = hashes(run.workdir)
    report = json.loads((out / "drift.json").read_text()) if code == 0 else None
    return SimpleNamespace(code=code, stdout=stdout, stderr=stderr, before=before, after=after, out=out, report=report)


def test_load_params_equals_the_params_training_resumes_with(run, tmp_path):
    # On a copy: Checkpointer records missing checksums and moves unrestorable steps aside.
    copy = tmp_path / "run"
    finished = lambda d, names: [n for n in names if n.isdigit() and not (Path(d) / n / _COMMIT_MARKER).exists()]
    shutil.copytree(run.workdir, copy, ignore=finished)
    opened = snapshots.open_run(copy)
    abstract = programs_lib.abstract_train_state(run.programs, run.params)
    built = build(run.config)
    with Checkpointer(copy / "checkpoints") as ckpt:
        for s in STEPS:
            restored, _ = ckpt.restore(s, abstract)
            loaded = snapshots.load_params(opened, s)
            assert jax.tree.structure(loaded) == jax.tree.structure(restored.params)
            jax.tree.map(np.testing.assert_array_equal, loaded, restored.params)
        start, state = checkpoint.resume(ckpt, abstract, prompt_iterator(built.task, seed=0, split="train"))
    assert start == STEPS[-1]
    jax.tree.map(np.testing.assert_array_equal, snapshots.load_params(opened, STEPS[-1]), state.params)
    first, last = (jax.tree.leaves(snapshots.load_params(opened, s))[0] for s in (STEPS[0], STEPS[-1]))
    assert not np.array_equal(first, last)  # the steps differ: the comparison above is not vacuous


def test_the_run_is_left_byte_for_byte_as_it_was_and_an_in_flight_save_is_skipped(result):
    assert result.code == 0, result.stderr
    assert result.before == result.after
    assert any(f.startswith(f"checkpoints/{IN_FLIGHT}/") for f in result.before)  # it was there
    assert [s["step"] for s in result.report["snapshots"]] == list(STEPS)


def test_writes_the_report_the_plots_and_the_probe_and_prints_a_table(result, run):
    for name in ("drift.json", "drift_heatmap.png", "drift_curve.png", "probe.npz", "routings.npz"):
        assert (result.out / name).is_file(), name
    for name in ("drift_heatmap.png", "drift_curve.png"):
        assert (result.out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = [line.split() for line in result.stdout.splitlines()]
    assert [r[0] for r in rows if r and r[0].isdigit()] == [str(s) for s in STEPS]
    probe = snapshots.Probe.load(result.out / "probe.npz")
    assert probe.tokens_BT.shape == (6, run.config.prompt_len + run.config.max_new_tokens)
    assert result.report["probe"]["num_tokens"] == probe.num_tokens > 0
    assert result.report["probe"]["step"] == STEPS[0] and result.report["moe_layers"] == [1, 2]
    assert not list(run.workdir.glob("*drift*")) and not (run.workdir / "probe.npz").exists()


def test_a_snapshot_against_itself_is_zero_drift_and_pairs_are_symmetric_where_the_metric_is(result):
    pairs, S = result.report["pairs"], len(STEPS)
    m = {k: np.array(v) for k, v in pairs.items()}
    for i in range(S):
        for k in (*SYMMETRIC, "router_kl"):
            assert m[k][i, i] == (1.0 if k == "jaccard" else 0.0), k
        assert not m["flip_rate_per_layer"][i, i].any()
    for k in (*SYMMETRIC, "flip_rate_per_layer"):
        np.testing.assert_array_equal(m[k], m[k].swapaxes(0, 1), err_msg=k)
    assert m["router_flip_rate"][0, -1] > 0 and m["router_kl"][0, -1] > 0  # the steps do drift
    for k, v in m.items():
        np.testing.assert_array_equal(np.array(result.report["from_first"][k]), v[0], err_msg=k)
        prev = result.report["from_previous"][k]
        assert prev[0] is None
        np.testing.assert_array_equal(np.array(prev[1:]), np.array([v[i - 1, i] for i in range(1, S)]), err_msg=k)


def test_flip_rate_slot_change_and_jaccard_recomputed_by_hand_from_the_stored_top_k(result):
    z = np.load(result.out / "routings.npz")
    topk_SLNK = z["topk_SLNK"]
    assert list(z["labels"]) == [str(s) for s in STEPS]
    assert topk_SLNK.shape[2] == result.report["probe"]["num_tokens"]
    old_LNK, new_LNK = topk_SLNK[0], topk_SLNK[-1]
    _, _, K = old_LNK.shape
    inter_LN = np.array([[len(set(a) & set(b)) for a, b in zip(o, n)] for o, n in zip(old_LNK, new_LNK)])
    pairs = result.report["pairs"]
    per_layer_L = (inter_LN < K).mean(axis=1)
    np.testing.assert_allclose(pairs["flip_rate_per_layer"][0][-1], per_layer_L, rtol=1e-6)
    np.testing.assert_allclose(pairs["router_flip_rate"][0][-1], per_layer_L.mean(), rtol=1e-6)
    np.testing.assert_allclose(pairs["token_any_flip"][0][-1], (inter_LN < K).any(axis=0).mean(), rtol=1e-6)
    np.testing.assert_allclose(pairs["slot_change_rate"][0][-1], 1 - inter_LN.mean() / K, rtol=1e-5)
    np.testing.assert_allclose(pairs["jaccard"][0][-1], (inter_LN / (2 * K - inter_LN)).mean(), rtol=1e-5)


def test_routing_another_snapshot_compiles_nothing_and_reproduces_the_stored_routing(result, run, compile_counter):
    opened = snapshots.open_run(run.workdir)
    probe = snapshots.Probe.load(result.out / "probe.npz")
    params = snapshots.load_params(opened, STEPS[1])
    compile_counter.reset()
    routing = snapshots.route(opened, params, probe, batch_size=4)
    assert compile_counter.count == 0
    np.testing.assert_array_equal(routing.topk_LNK, np.load(result.out / "routings.npz")["topk_SLNK"][1])


def test_a_reused_probe_and_two_checkpoints_give_the_same_pairs(result, run):
    pairs = result.report["pairs"]
    probe = result.out / "probe.npz"
    before = hashes(run.workdir)
    code, _, err = call(run.workdir, "--probe", probe, "--steps", "1,3", "--batch_size", 4)  # default --out
    assert code == 0, err
    beside = run.workdir.parent / "run-drift"
    again = json.loads((beside / "drift.json").read_text())["pairs"]
    assert again["router_kl"][0][1] == pairs["router_kl"][0][2]
    assert again["flip_rate_per_layer"][1][0] == pairs["flip_rate_per_layer"][2][0]

    a, b = f"{run.workdir}:1", run.workdir / "checkpoints" / "3"
    code, _, err = call("--a", a, "--b", b, "--probe", probe, "--out", beside / "ab", "--batch_size", 4)
    assert code == 0, err
    ab = json.loads((beside / "ab" / "drift.json").read_text())
    assert [s["label"] for s in ab["snapshots"]] == ["run:1", "run:3"]
    assert ab["pairs"]["slot_change_rate"][0][1] == pairs["slot_change_rate"][0][2]
    assert hashes(run.workdir) == before


def _variant(run, tmp_path, name, **model) -> Path:
    """A workdir whose config differs from the run's in `model` fields, with the run's checkpoints."""
    c = base_config("gspo", "tiny")
    c.model.update(model)
    d = tmp_path / name
    shutil.copytree(run.workdir / "checkpoints", d / "checkpoints", ignore=shutil.ignore_patterns(str(IN_FLIGHT)))
    workdir_lib.record_config(d, as_json(c), [])
    return d


@pytest.mark.parametrize(
    "make_args, words",
    [
        (lambda run, tmp: [tmp], "has no config.json"),
        (lambda run, tmp: [run.workdir, "--steps", "1"], "at least 2 finished checkpoints"),
        (lambda run, tmp: [run.workdir, "--steps", "1,9"], "[9] are not finished"),
        (lambda run, tmp: [run.workdir, "--steps", f"1,{IN_FLIGHT}"], f"[{IN_FLIGHT}] are not finished"),
        (lambda run, tmp: [run.workdir, "--steps", "1,x"], "comma-separated step numbers"),
        (lambda run, tmp: [run.workdir, "--probe_step", 9], "[9] are not finished"),
        (lambda run, tmp: [_variant(run, tmp, "dense", num_experts=0)], "no MoE layers"),
        (
            lambda run, tmp: ["--a", f"{run.workdir}:1", "--b", f"{_variant(run, tmp, 'w', embed_dim=32)}:2"],
            "embed_dim",
        ),
        (lambda run, tmp: ["--a", run.workdir, "--b", f"{run.workdir}:1"], "not a checkpoint"),
        (lambda run, tmp: [run.workdir, "--probe", run.workdir / "config.json"], "not a probe file"),
        (lambda run, tmp: [run.workdir, "--probe", "x.npz", "--seed", 1], "--seed would not be used"),
    ],
)
def test_bad_input_is_refused_in_one_line(run, result, tmp_path, make_args, words):
    before = hashes(run.workdir)
    code, _, err = call(*make_args(run, tmp_path))
    assert code == drift_script.EXIT_REFUSED
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and words in err, err
    assert hashes(run.workdir) == before


def test_workdir_or_a_pair_is_required(tmp_path):
    assert call()[0] == 2 and call(tmp_path, "--a", f"{tmp_path}:1", "--b", f"{tmp_path}:2")[0] == 2
    assert call("--a", f"{tmp_path}:1")[0] == 2


def test_a_run_recorded_by_older_code_or_on_a_bigger_mesh_opens(run, tmp_path):
    recorded = json.loads((run.workdir / "config.json").read_text())
    del recorded["train"]["drift_metrics"]  # a key added after the run started: it takes its default
    recorded["mesh"] = dict(data=64, fsdp=1, expert=1, tensor=1)  # more devices than this machine has
    (tmp_path / "config.json").write_text(json.dumps(recorded))
    opened = snapshots.open_run(tmp_path)
    assert opened.config.mesh.data == 64 and opened.config.train.drift_metrics is True
    assert opened.model == snapshots.open_run(run.workdir).model

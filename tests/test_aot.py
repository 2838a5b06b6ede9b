"""Deviceless ahead-of-time compilation for a TPU slice (gspo_jax/aot.py, scripts/aot_compile.py).
Needs libtpu, which `.ci/run` installs with the `tpu` extra; no TPU is attached. libtpu carries its own
compiler and is loaded only in the script's own process, never in the test process (loaded beside the
CPU backend's compiler, later CPU compiles in the same process crashed)."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gspo_jax import aot, flops
from gspo_jax import sharding as sharding_lib
from gspo_jax.built import build
from gspo_jax.config import base_config
from gspo_jax.validation import ConfigError

ROOT = Path(__file__).resolve().parents[1]
# The tiny preset with one stack of two MoE layers instead of its dense + MoE stacks: the same grouped
# expert kernels on every mesh, about 15% less for each TPU compile (a train step 41.6 -> 35.6 s, contended).
ONE_STACK = dict(num_layers=2, dense_layers=())
TINY = ["--config", "configs/gspo.py:tiny", "--topology", "v5p:2x2x1", "--config.mesh.fsdp=2", "--config.mesh.expert=2"]
TINY += [f"--config.model.{k}={v}" for k, v in ONE_STACK.items()]
# Every kind of mesh a 4-chip slice can take, as `--mesh` layouts: the grouped expert kernels (megablox)
# must run per device on each (a Mosaic kernel's call cannot be partitioned by XLA).
LAYOUTS = ("data=4", "fsdp=4", "data=2,fsdp=2", "data=2,tensor=2", "fsdp=2,expert=2", "data=2,expert=2")


def mesh_name(layout: str) -> str:
    """How a report names a `--mesh` layout: "data=2,fsdp=2" -> "data=2×fsdp=2"."""
    return layout.replace(",", "×")


def aot_compile(*args, tmp_path=None):
    """Runs scripts/aot_compile.py; (completed process, its JSON rows or None)."""
    out = None if tmp_path is None else tmp_path / "rows.json"
    cmd = [sys.executable, "scripts/aot_compile.py", *args] + ([] if out is None else ["--json", str(out)])
    env = {**os.environ, "JAX_DISABLE_MOST_OPTIMIZATIONS": "0"}  # a slice's programs as a real run compiles them
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    return p, (json.loads(out.read_text()) if out is not None and out.exists() else None)


@pytest.fixture(scope="module")
def tiny_slice(tmp_path_factory):
    """Every program of the tiny config compiled for a v5p:2x2x1 slice on every layout of `LAYOUTS`, in one
    process, once for the tests that read it."""
    meshes = [f"--mesh={m}" for m in LAYOUTS]
    return aot_compile(*TINY, *meshes, tmp_path=tmp_path_factory.mktemp("tiny_slice"))


def rows_of(rows, layout):
    return [r for r in rows if r["mesh"] == mesh_name(layout)]


@pytest.mark.slow
def test_every_mesh_layout_compiles_for_a_slice(tiny_slice):
    """Data, FSDP, tensor and expert parallelism and their mixes: with or without an expert axis, every
    program compiles (before, only meshes with expert parallelism put the grouped kernels in a
    shard_map, and every other one failed: "Mosaic kernels cannot be automatically partitioned")."""
    p, rows = tiny_slice
    assert p.returncode == 0, p.stderr[-3000:]
    assert [r["mesh"] for r in rows] == [mesh_name(m) for m in LAYOUTS for _ in aot.PROGRAMS]
    assert all(r["fits"] and r["temp_bytes"] > 0 for r in rows)
    for m in LAYOUTS:
        assert [r["program"] for r in rows_of(rows, m)] == list(aot.PROGRAMS)
    table = [line for line in p.stdout.splitlines() if line.startswith("| v5p:2x2x1 |")]
    assert len(table) == len(rows) and all("| yes |" in line for line in table)
    assert p.stdout.count("| topology |") == 1  # one table, one header


@pytest.mark.slow
def test_every_program_compiles_for_a_slice_and_fits(tiny_slice):
    p, rows = tiny_slice
    assert p.returncode == 0, p.stderr[-3000:]
    rows = rows_of(rows, "fsdp=2,expert=2")
    assert [r["program"] for r in rows] == list(aot.PROGRAMS)
    c = base_config("gspo", "tiny")
    c.mesh.update(fsdp=2, expert=2)
    c.model.update(**ONE_STACK)
    cfg, B = build(c, device_count=4).model, c.rollout.num_groups * c.rollout.group_size
    T, peak = c.prompt_len + c.max_new_tokens, aot.CHIPS["v5p"][1]
    want_flops = {
        "train_step": flops.train_flops(cfg, B // c.train.minibatches, T),
        "score": flops.forward_flops(cfg, B, T),
        "sample": flops.sample_flops(cfg, B, c.prompt_len, c.max_new_tokens),
    }
    for r in rows:
        assert r["argument_bytes"] > 0 and r["temp_bytes"] > 0 and r["compile_seconds"] > 0
        assert r["hbm_bytes"] == int(95.74 * aot.GIB) and r["fits"] and r["total_bytes"] < 0.01 * r["hbm_bytes"]
        assert r["mesh"] == "fsdp=2×expert=2" and not r["refused"]
        assert r["flops"] == want_flops[r["program"]]
        assert r["seconds_at_mfu"] == pytest.approx(r["flops"] / (0.4 * peak * 4))
        assert r["chips"] == 4 and r["xla_flops_per_chip"] > 0
    assert rows[0]["alias_bytes"] > 0  # the donated train state is updated in place
    table = [line for line in p.stdout.splitlines() if line.startswith("| v5p:2x2x1 | fsdp=2×expert=2 |")]
    assert len(table) == 3 and all("| yes |" in line for line in table)


# The flagship (`qwen3_30b_a3b`) with only its sizes shrunk: its layers scanned, rematerialised, the LM
# head chunked, scoring and prefill in batch chunks, bf16, its MoE dispatch, expert parallelism, the
# prompt bucket shorter than the cache. Every structural key is read from the flagship's own config.
FLAGSHIP_DIMS = dict(
    vocab_size=256, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
    num_experts=8, top_k=2, moe_mlp_dim=32, logprob_chunk=64,
)  # fmt: skip
FLAGSHIP_SHAPE = {"prompt_len": 128, "max_new_tokens": 32, "rollout.num_groups": 2, "rollout.group_size": 8}


def flagship_in_miniature() -> list[str]:
    """Its size's plan on 4 chips (fsdp × expert=2), then an FSDP-only one (fsdp=4 × expert=1)."""
    flags = ["--config", "configs/gspo.py:qwen3_30b_a3b", "--topology", "v5p:2x2x1"]
    flags += ["--mesh=fsdp=2,expert=2", "--mesh=fsdp=4"]
    flags += [f"--config.model.{k}={v}" for k, v in FLAGSHIP_DIMS.items()]
    return flags + [f"--config.{k}={v}" for k, v in FLAGSHIP_SHAPE.items()]


@pytest.mark.slow
def test_the_flagships_structure_compiles_for_a_slice(tmp_path):
    """The class of break that stopped the flagship's sampler compiling (an XLA RET_CHECK in the batch-
    chunked prefill's loop, libtpu 0.0.42) at a size CI compiles in seconds, on its size's kind of plan
    and on an FSDP-only one, where the grouped kernels run without expert parallelism."""
    flagship = base_config("gspo", "qwen3_30b_a3b")
    m, P, C = flagship.model, FLAGSHIP_SHAPE["prompt_len"], FLAGSHIP_SHAPE["max_new_tokens"]
    assert m.scan_layers and m.remat != "none" and m.batch_chunks > 1 and flagship.mesh.expert > 1
    assert 0 < FLAGSHIP_DIMS["logprob_chunk"] < P + C and P < P + C  # chunked head; prompt shorter than cache
    p, rows = aot_compile(*flagship_in_miniature(), tmp_path=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert [r["program"] for r in rows] == list(aot.PROGRAMS) * 2 and all(r["fits"] for r in rows)
    assert [r["mesh"] for r in rows] == ["fsdp=2×expert=2"] * 3 + ["fsdp=4"] * 3
    assert rows[2]["shape"] == rows[5]["shape"] == f"16 × {P}+{C}"


def test_row_arithmetic_by_hand():
    r = aot.Row("score", "fsdp=2", "1 × 1", 10, 6, 4, 100, 110, 1.0, 8e12, 0.1)
    assert r.total_bytes == 10 + 6 - 4 + 100 and not r.fits  # 112 bytes do not fit in 110
    assert r.hbm_fraction == pytest.approx(112 / 110)
    assert aot.Row("score", "fsdp=2", "", 10, 6, 4, 98, 110, 1.0, 0.0, 0.0).fits  # exactly 110
    assert not aot.Row("score", "fsdp=2", "", 10, 0, 0, 1, 110, 1.0, 0.0, 0.0, refused="XLA: out of HBM").fits
    table = aot.format_report([r], "v5p:2x2x1", 4, "full").splitlines()
    assert len(table) == 3 and table[2].startswith("| v5p:2x2x1 | fsdp=2 | score | 1 × 1 | - | full |")
    assert table[2].endswith("| - |")  # no XLA count, no ratio
    r = dataclasses.replace(r, xla_flops_per_chip=3e12, chips=4)  # 12e12 on the slice for 8e12 of work
    assert aot.format_report([r], "v5p:2x2x1", 4, "full").splitlines()[2].endswith("| 1.50 |")


@pytest.mark.parametrize(
    "topology, match",
    [("v9z:2x2", r"topology: 'v9z:2x2' is not '<chip>:<shape>'"), ("v5p", "is not '<chip>:<shape>'")],
)
def test_bad_topology_named(topology, match):  # refused before libtpu is loaded
    with pytest.raises(ConfigError, match=match):
        aot.compile_report(base_config("gspo", "tiny"), topology)


@pytest.mark.slow
def test_script_refuses_in_one_line_and_checks_the_mesh_against_the_slice():
    p, _ = aot_compile(*TINY, "--topology", "v5p")
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].startswith("error: topology: 'v5p'")
    p, _ = aot_compile(*TINY, "--config.mesh.fsdp=4", "--programs", "score")  # 8 devices on a 4-chip slice
    assert p.returncode == 2 and "there are 4 devices" in p.stderr.strip().splitlines()[-1]
    # The script's other refusals are these errors, raised before libtpu loads (here, in this process).
    with pytest.raises(ConfigError, match=r"^programs: \['decode'\] not in"):
        aot.compile_report(base_config("gspo", "tiny"), "v5p:2x2x1", ("decode",))
    with pytest.raises(ConfigError, match=r"^mesh: 'data=2,model=2' is not"):
        aot.with_mesh(base_config("gspo", "tiny"), "data=2,model=2")


def test_mesh_layouts_name_their_axes_and_leave_the_rest_at_one():
    assert aot.parse_mesh("data=2, tensor=2") == dict(data=2, fsdp=1, expert=1, tensor=2)
    assert aot.parse_mesh("fsdp=-1,expert=8") == dict(data=1, fsdp=-1, expert=8, tensor=1)
    flagship = base_config("gspo", "qwen3_30b_a3b")
    laid = aot.with_mesh(flagship, "fsdp=4").mesh
    assert {k: laid[k] for k in sharding_lib.MESH_AXES} == dict(data=1, fsdp=4, expert=1, tensor=1)
    assert (flagship.mesh.fsdp, flagship.mesh.expert) == (-1, 8)  # a copy: the config itself is unchanged
    for bad in ("data=0", "data=two", "data", "expert=2,model=2"):
        with pytest.raises(ConfigError, match=r"mesh: .* is not 'axis=size,...' with axes in \('data'"):
            aot.parse_mesh(bad)


@pytest.mark.slow
def test_ppo_train_step_compiles_for_a_slice_with_its_critic(tiny_slice, tmp_path):
    """PPO's step carries the critic's update: its state in the arguments, its work in the analytic FLOPs."""
    p, rows = tiny_slice
    rows = rows_of(rows, "fsdp=2,expert=2")  # rows[0]: the critic-free train step of the same config and mesh
    assert p.returncode == 0 and rows[0]["program"] == "train_step", p.stderr[-3000:]
    ppo = [*TINY[:1], "configs/ppo.py:tiny", *TINY[2:]]
    p2, rows2 = aot_compile(*ppo, "--programs", "train_step", tmp_path=tmp_path)
    assert p2.returncode == 0, p2.stderr[-3000:]
    c = base_config("ppo", "tiny")
    c.mesh.update(fsdp=2, expert=2)
    c.model.update(**ONE_STACK)
    built = build(c, device_count=4)
    mb, T = c.rollout.num_groups * c.rollout.group_size // c.train.minibatches, c.prompt_len + c.max_new_tokens
    assert rows2[0]["flops"] == flops.train_flops(built.model, mb, T) + flops.critic_train_flops(
        built.critic.model, mb, T
    )
    assert rows2[0]["fits"] and rows2[0]["argument_bytes"] > 1.8 * rows[0]["argument_bytes"]  # a second model + moments


def test_critic_flops_are_the_trunk_without_the_lm_head():
    cfg = build(base_config("ppo", "tiny")).model
    B, T, V, D = 4, 32, cfg.vocab_size, cfg.embed_dim
    assert flops.critic_train_flops(cfg, B, T) == flops.train_flops(cfg, B, T) - 6 * (V * D - D) * B * T

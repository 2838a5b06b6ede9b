"""MoE dispatch paths (dense, ragged, sparse, and expert-parallel on two devices) against each other,
forward + backward."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks.run.timing import best_time
from gspo_jax import dispatch, expert_parallel
from gspo_jax.sharding import make_mesh, under_mesh


def _dispatch_loss(fn, topk, gates, x, *w):
    return jnp.sum(fn(x, topk, gates, *w) ** 2)


def moe_dispatch(tiny: bool, repeats: int) -> dict:
    tokens = (128,) if tiny else (256, 1024, 4096)  # tiny: every path on two rows (the smoke test)
    experts = (4, 8) if tiny else (4, 8, 16)
    D = F = 64 if tiny else 256
    out = []
    for N in tokens:
        for E in experts:
            keys = jax.random.split(jax.random.key(N * 31 + E), 5)
            x = jax.random.normal(keys[0], (1, N, D))
            w = [jax.random.normal(k, s) * s[-2] ** -0.5 for k, s in zip(keys[1:4], [(E, D, F), (E, D, F), (E, F, D)])]
            topk = jax.random.randint(keys[4], (1, N, 2), 0, E)
            topk = topk.at[..., 1].set((topk[..., 0] + 1 + topk[..., 1] % (E - 1)) % E)  # distinct experts
            gates = jnp.full((1, N, 2), 0.5)
            row = dict(tokens=N, experts=E, top_k=2)
            for name, fn in (
                ("dense", dispatch.dense_experts),
                ("ragged", dispatch.ragged_experts),
                ("sparse", dispatch.sparse_experts),
            ):
                loss = functools.partial(_dispatch_loss, fn, topk, gates)
                f = jax.jit(jax.value_and_grad(loss))
                row[f"{name}_seconds"] = best_time(functools.partial(f, x, *w), repeats)
            if jax.device_count() >= 2:  # the all-to-all path, experts split over two devices, sparse on each
                mesh = make_mesh(expert=2)
                ep = functools.partial(expert_parallel.expert_parallel, dispatch.sparse_experts, mesh.abstract_mesh)
                loss = functools.partial(_dispatch_loss, ep, topk, gates)
                rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
                f = jax.jit(under_mesh(jax.value_and_grad(loss), mesh), in_shardings=rep, out_shardings=rep)
                row["expert_parallel_seconds"] = best_time(functools.partial(f, x, *w), repeats)
            row["useful_flops"] = 3 * 2 * N * 2 * 3 * D * F  # fwd + bwd, k=2 experts, 3 matmuls
            out.append(row)
    return {"rows": out}


def moe_expert_parallel(tiny: bool, repeats: int) -> list[dict]:
    """The MoE rows again in a child process with two fake CPU devices (`XLA_FLAGS` must be set before
    JAX starts), where the expert-parallel path runs beside the others: its ratios come from that one
    process. On two cores the two devices share the machine: what it shows is the exchange's overhead."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "moe.json"
        env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.run",
            "--only",
            "moe",
            "--size",
            "tiny" if tiny else "full",
            "--out",
            str(out),
        ]
        cmd += ["--repeats", str(repeats)]
        subprocess.run(cmd, check=True, env=env, cwd=Path(__file__).parents[2], stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())["moe"]["rows"]

"""Qwen3-30B-A3B whole on one accelerator: its 48 layers (random weights, the base frozen in bfloat16,
LoRA rank 32 on attention and every expert) through RL iterations of 64 prompts' samples × (512 + 1,024)
tokens. Does an iteration run, how long does each phase take, at what peak device memory; where it does
not fit, the largest batch that does (issue 68, point 3).

    python -m benchmarks.whole_model                   # on a GPU: batches 64, 32, 16, 8 until one runs
    python -m benchmarks.whole_model --batches 64 --iterations 2
    python -m benchmarks.whole_model --size tiny       # seconds on a CPU: the smoke test

Each batch is tried in a child process of its own, the largest first (an out-of-memory failure leaves
nothing behind in the next), under `--limit` seconds. A try builds the run as `run.py` builds it
(`benchmarks.run.loop.Loop`: no warm start, evaluation or checkpoints) and runs `--iterations` RL
iterations, the first compiling. Writes benchmarks/whole_model-<device>.json after every try (device,
versions, command, commit)."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks.run import accelerator
from benchmarks.run.loop import SPLIT, Loop
from benchmarks.run.machine import accelerator_versions, refuse_unoptimised
from benchmarks.run.shapes import shape_config
from gspo_jax.built import build
from gspo_jax.provenance import commit, device_slug, machine

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LAYERS, RANK, TARGETS = 48, 32, ("attention", "experts")
SEQUENCES_PER_MINIBATCH = 16  # the preset's: 64 sequences in 4 minibatches


def whole_config(tiny: bool, batch: int, iterations: int):
    """The run a try makes: the real dims at 48 layers (the tiny shape at `tiny`) with LoRA, `batch`
    sequences an iteration in groups of the preset's size, minibatches of 16 sequences (fewer when the
    batch is smaller), evaluation and saves out of the way."""
    c = shape_config("tiny") if tiny else accelerator.real_dims_config(layers=LAYERS)
    c.lora.update(rank=4 if tiny else RANK, targets=TARGETS, base_dtype="bfloat16")
    group = c.rollout.group_size
    if batch < group or batch % group:
        raise ValueError(f"--batches: {batch} is not a positive multiple of the group size {group}")
    minibatches = max(1, batch // SEQUENCES_PER_MINIBATCH)
    c.rollout.num_groups = batch // group
    c.train.update(minibatches=minibatches, num_iterations=iterations, eval_every=10**6, checkpoint_every=10**6)
    return c


def _bytes(tree) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def attempt(tiny: bool, batch: int, iterations: int) -> dict:
    """One try, in this process: the run's phases per iteration, the median of the warm ones, and the
    device's peak memory where it reports one."""
    built = build(whole_config(tiny, batch, iterations))
    loop = Loop(built)
    adapters, base = loop.state.params, loop.state.frozen
    out = dict(
        batch=batch,
        tokens=[built.sampler.prompt_len, built.sampler.max_new_tokens],
        layers=built.model.num_layers,
        lora_rank=built.model.lora.rank,
        minibatches=built.train.minibatches,
        base_bytes=_bytes(base),
        adapter_bytes=_bytes(adapters),
        seconds_to_state=time.perf_counter() - loop.started,
    )
    for _ in range(iterations):
        loop.iterate()
    out["iterations"] = loop.rows
    warm = loop.rows[1:] or loop.rows
    out["warm"] = {k: float(np.median([r[k] for r in warm])) for k in (*SPLIT, "sampler_seconds", "decode_steps")}
    stats = jax.devices()[0].memory_stats() or {}
    out.update({k: int(stats[k]) for k in ("peak_bytes_in_use", "bytes_limit") if k in stats})
    return out


def _try(args, batch: int) -> dict:
    """`attempt` in a child process, under the time limit: its result, or how it failed."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "attempt.json"
        cmd = [sys.executable, "-m", "benchmarks.whole_model", "--attempt", str(batch), "--out", str(out)]
        cmd += ["--size", args.size, "--iterations", str(args.iterations)]
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.limit)
        except subprocess.TimeoutExpired:
            return dict(batch=batch, ok=False, error=f"timed out after {args.limit} s")
        seconds = time.perf_counter() - t0
        if p.returncode or not out.exists():
            return dict(batch=batch, ok=False, seconds=seconds, **failure(p.stderr))
        return dict(ok=True, seconds=seconds, **json.loads(out.read_text()))


def failure(stderr: str) -> dict:
    """A failed try's record: whether it ran out of device memory, its last error line, its stderr's end."""
    lines = [x for x in stderr.splitlines() if x.strip()]
    oom = any("RESOURCE_EXHAUSTED" in x or "out of memory" in x.lower() for x in lines)
    why = next((x for x in reversed(lines) if "Error" in x or "error:" in x), lines[-1] if lines else "no output")
    return dict(out_of_memory=oom, error=why[:500], stderr_tail="\n".join(lines[-40:]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="full", choices=("full", "tiny"), help="tiny: seconds on a CPU, the smoke test")
    ap.add_argument("--batches", default="", help="sequences an iteration, tried largest first (default 64,32,16,8)")
    ap.add_argument("--iterations", type=int, default=3, help="RL iterations a try runs; the first compiles")
    ap.add_argument("--limit", type=int, default=420, help="seconds a try may take")
    ap.add_argument("--out", default="", help="the JSON to write (default benchmarks/whole_model-<device>.json)")
    ap.add_argument("--attempt", type=int, default=0, help=argparse.SUPPRESS)  # a child's one try
    args = ap.parse_args()
    tiny = args.size == "tiny"
    if args.attempt:
        Path(args.out).write_text(json.dumps(attempt(tiny, args.attempt, args.iterations), indent=2))
        return
    if not tiny:
        refuse_unoptimised(ap, "--size tiny")
    if args.iterations < 1 or args.limit < 1:
        ap.error(f"--iterations={args.iterations}, --limit={args.limit}: each at least 1")
    try:
        batches = sorted({int(b) for b in (args.batches or ("8,4" if tiny else "64,32,16,8")).split(",")}, reverse=True)
    except ValueError:
        ap.error(f"--batches={args.batches!r}: comma-separated sequence counts, e.g. 64,32")
    for batch in batches:
        try:
            whole_config(tiny, batch, args.iterations)
        except ValueError as e:
            ap.error(str(e))
    path = Path(args.out or HERE / f"whole_model-{device_slug()}.json")
    results = dict(machine=machine(), jax=jax.__version__, git=commit(), **accelerator_versions())
    results["command"] = shlex.join(["python", "-m", "benchmarks.whole_model", *sys.argv[1:]])
    results["model"] = f"qwen3_30b_a3b at {LAYERS} layers, random weights" if not tiny else "tiny shape"
    results["lora"] = dict(rank=4 if tiny else RANK, targets=list(TARGETS), base_dtype="bfloat16")
    results["tries"] = []
    for batch in batches:
        r = _try(args, batch)
        results["tries"].append(r)
        path.write_text(json.dumps(results, indent=2))
        print(_line(r), flush=True)
        if r["ok"]:
            results["largest_batch_that_runs"] = batch
            break
    path.write_text(json.dumps(results, indent=2))
    print(f"wrote {path}")


def _line(r: dict) -> str:
    """One try, as a line: its phases' warm medians and peak memory, or why it failed."""
    if not r["ok"]:
        return f"batch {r['batch']}: failed{' (out of memory)' if r.get('out_of_memory') else ''}: {r['error']}"
    w, gib = r["warm"], 2**30
    share = lambda k: f" ({w[k] / w['iteration_seconds']:.0%})" if k != "iteration_seconds" else ""
    phases = ", ".join(f"{k.removesuffix('_seconds')} {w[k]:.2f} s{share(k)}" for k in SPLIT)
    peak = ""
    if "bytes_limit" in r:
        peak = f"; peak {r['peak_bytes_in_use'] / gib:.1f} of {r['bytes_limit'] / gib:.1f} GiB"
    return f"batch {r['batch']} × {'+'.join(map(str, r['tokens']))} tokens: {phases}{peak}"


if __name__ == "__main__":
    main()

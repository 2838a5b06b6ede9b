"""Where a compiled program's time goes on this CPU, per XLA op: the tool behind docs/BENCHMARKS.md's
profiling notes, so a change can be profiled before and after the same way.

    python -m benchmarks.profile                                  # the train step, `iteration` shape
    python -m benchmarks.profile --program sampler --shape iteration
    python -m benchmarks.profile --program train_step --shape bench --calls 2 --out /tmp/p.json
    python -m benchmarks.profile --shape configs/study/deep_moe.py:grpo   # the study's headline cell

It runs the program once to warm up, traces `--calls` more calls with `jax.profiler`, reads the trace
back (`jax.profiler.ProfileData`) and matches each op to the compiled HLO (`Compiled.as_text()`):
- wall time per call and how busy the threads running XLA ops were (the share of the traced window
  with 0, 1 or 2+ of them running an op): XLA:CPU runs one op per thread, so time with one thread
  busy is time the second core waited on a chain of dependent ops. Those threads are every one
  whose trace holds the program's ops, by name: XLA's worker pool, and the PjRt client thread that
  starts each call and runs ops itself until it hands off (which thread runs what varies from
  machine to machine and run to run: in one CI run none of a sampler's matmuls ran on the pool);
- exclusive time by op kind (the HLO name without its number: `ynn_fusion` is a matmul fused by
  YNNPACK, `wrapped_broadcast` a materialised broadcast such as a scan's zero-filled output stack);
- the share spent in ops that are not matmuls and write at least `--big-mib` MiB: passes over
  memory (optimizer updates, non-finite checks, copies and stacks of per-layer buffers);
- the slowest ops with their shapes and JAX source op names.

Shapes: `tiny` (the CI smoke test), `default`, `bench` (`benchmarks.run.shapes.shape_config`),
`iteration` (`benchmarks.run.shapes.iteration_config`), or any config file as scripts/train.py takes it
(`--shape configs/study/deep_moe.py:grpo`), with its warm start off. Timing is wall clock on a shared machine: compare
runs made back to back, as everywhere in `benchmarks/`.
"""

from __future__ import annotations

if __name__ == "__main__":  # before JAX is imported: glibc reads its tunables only when a process starts
    from gspo_jax.host_memory import reexec_with_huge_pages

    reexec_with_huge_pages()  # as scripts/train.py runs: XLA's big per-call buffers on huge pages

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.run import accelerator  # noqa: E402
from benchmarks.run.machine import refuse_unoptimised  # noqa: E402
from benchmarks.run.shapes import SHAPES, iteration_config, pieces, random_batch, shape_config  # noqa: E402
from gspo_jax import compiles  # noqa: E402
from gspo_jax import programs as programs_lib  # noqa: E402
from gspo_jax import sharding as sharding_lib  # noqa: E402
from gspo_jax.config_files import load_config  # noqa: E402
from gspo_jax.sampler import Sampler, SamplerOptions, left_pad  # noqa: E402
from gspo_jax.sharding import mesh_from_config  # noqa: E402

PROGRAMS = ("train_step", "sampler")
BOOKKEEPING = ("ThunkExecutor::", "SlinkyThreadPool::", "end: ")  # executor waits, not ops


def _config(shape: str):
    if shape == "real":
        return accelerator.real_dims_config()
    if ".py" in shape:  # a config file, as scripts/train.py takes it ("configs/study/deep_moe.py:grpo")
        c = load_config(shape)
        c.warm_start.steps = 0  # random weights: what is timed is the program, not what it learned
        return c
    return iteration_config(shape) if shape == "iteration" else shape_config(shape)


def train_step_program(shape: str):
    """(call, compiled HLO text) for one train step of `shape` on a random, well-formed minibatch."""
    c = _config(shape)
    built, _, params, programs = pieces(c)
    B = built.batch_size // built.train.minibatches
    batch = jax.device_put(random_batch(programs, params, B, c.prompt_len, c.max_new_tokens), programs.batch_shardings)
    state = [programs_lib.init_train_state(programs, params, 0)]
    step = programs.train_step.compile(state[0], batch)

    def call():
        state[0], metrics, _ = step(state[0], batch)  # the same minibatch every call, as benchmarks.run times it
        return metrics

    return call, step.executable.as_text()


def sampler_program(shape: str, max_new_tokens: int = 0):
    """(call, compiled HLO text) for one rollout batch of `shape`: prefill and the decode loop (of
    `max_new_tokens` steps where given, else the config's)."""
    c = _config(shape)
    c.max_new_tokens = max_new_tokens or c.max_new_tokens
    built, graphdef, params, _ = pieces(c)
    B = built.rollout.num_groups * built.rollout.group_size
    P, C = c.prompt_len, c.max_new_tokens
    options = SamplerOptions(compiler_options=compiles.step_options(c.cpu_fast_compile))  # as the trainer compiles it
    sampler = Sampler(graphdef, built.model, B, P, C, mesh=mesh_from_config(**c.mesh), state=params, options=options)
    rng = np.random.default_rng(0)
    prompts, mask = left_pad([rng.integers(4, built.model.vocab_size, P) for _ in range(B)], P)
    t, k, p = jnp.float32(1.0), jnp.int32(0), jnp.float32(1.0)
    key = jax.random.key(0)

    def call():
        return sampler(params, prompts, mask, key, temperature=t, top_k=k, top_p=p).tokens

    abstract = sharding_lib.abstract(params)
    return call, sampler.lower(abstract).compile().as_text()


def _hlo_index(hlo: str) -> dict[str, tuple[str, str]]:
    """{instruction name: (result shape, JAX op name)} from compiled HLO text."""
    out = {}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\w+\[[^\]]*\]|\()", line)
        if m:
            source = re.search(r'op_name="([^"]*)"', line)
            out[m.group(1)] = ("tuple" if m.group(2) == "(" else m.group(2), source.group(1) if source else "")
    return out


def _nbytes(shape: str) -> int:
    total = 0
    for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape):
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        width = 1 if dtype == "pred" else int(re.sub(r"\D", "", dtype) or 32) // 8
        total += n * max(width, 1)
    return total


def _kind(name: str) -> str:
    return re.sub(r"\.\d+$", "", name)


def _is_matmul(name: str) -> bool:
    return name.startswith(("ynn_fusion", "dot", "xnn_fusion", "onednn")) or "dot" in _kind(name).split("_")


def analyse(trace_dir: str, hlo: str, calls: int, big_mib: float, top: int = 15) -> dict:
    """The report for the trace in `trace_dir` of `calls` calls of the program compiled to `hlo`."""
    files = sorted(Path(trace_dir).rglob("*.xplane.pb"))
    if not files:
        raise RuntimeError(f"no trace written under {trace_dir}")
    data = jax.profiler.ProfileData.from_file(str(files[-1]))
    index = _hlo_index(hlo)
    workers = []
    for plane in data.planes:
        for line in plane.lines:
            events = list(line.events)
            if any(e.name in index for e in events):  # a thread that ran the program's ops, whatever its name
                ops = [
                    (e.start_ns, e.start_ns + e.duration_ns, e.name)
                    for e in events
                    if not e.name.startswith(BOOKKEEPING)
                ]
                workers.append(sorted(ops))
    if not any(workers):
        raise RuntimeError("no XLA:CPU op events in the trace (this tool reads CPU traces only)")
    exclusive, by_op = collections.Counter(), collections.Counter()
    edges = []
    for ops in workers:
        stack: list[list] = []  # [end, name, exclusive ns]: ops nest (a while op holds its body's ops)
        done = []
        for start, end, name in ops:
            while stack and stack[-1][0] <= start:
                done.append(stack.pop())
            if stack:
                stack[-1][2] -= end - start
            stack.append([end, name, end - start])
        done += stack
        for _, name, ns in done:
            exclusive[_kind(name)] += ns / 1e9
            by_op[name] += ns / 1e9
        # busy intervals of this thread: the outermost ops
        cur = None
        for start, end, _ in ops:
            if end <= start:
                continue
            if cur and start < cur[1]:
                cur[1] = max(cur[1], end)
                continue
            if cur:
                edges += [(cur[0], 1), (cur[1], -1)]
            cur = [start, end]
        if cur:
            edges += [(cur[0], 1), (cur[1], -1)]
    edges.sort(key=lambda e: (e[0], -e[1]))  # at a tie, starts first: the level never dips below 0
    window = edges[-1][0] - edges[0][0]
    busy = collections.Counter()
    level, last = 0, edges[0][0]
    for t, d in edges:
        busy[min(level, 2)] += t - last
        level, last = level + d, t
    busy_s = sum(exclusive.values())
    big = 0.0
    for name, s in by_op.items():
        shape = index.get(name, ("", ""))[0]
        if not _is_matmul(name) and not name.startswith("while") and _nbytes(shape) >= big_mib * 2**20:
            big += s
    matmul = sum(s for name, s in by_op.items() if _is_matmul(name))
    slowest = []
    for name, s in by_op.most_common(top):
        shape, source = index.get(name, ("?", ""))
        slowest.append(dict(op=name, seconds_per_call=s / calls, shape=shape, source=source))
    return dict(
        window_seconds_per_call=window / 1e9 / calls,
        threads=len(workers),
        busy_share={str(k) + ("+" if k == 2 else ""): v / window for k, v in sorted(busy.items())},
        thread_seconds_per_call=busy_s / calls,
        matmul_share=matmul / busy_s,
        memory_pass_share=big / busy_s,
        by_kind={k: v / calls for k, v in exclusive.most_common(top)},
        slowest=slowest,
    )


def analyse_gpu(trace_dir: str, hlo: str, calls: int, top: int = 15) -> dict:
    """A GPU trace's report: kernel time and count per call (the device's stream lines), and time per
    HLO op (its "XLA Ops" line) by kind and for the slowest ops."""
    files = sorted(Path(trace_dir).rglob("*.xplane.pb"))
    data = jax.profiler.ProfileData.from_file(str(files[-1]))
    index = _hlo_index(hlo)
    by_op, kernels, n_kernels, span = collections.Counter(), collections.Counter(), 0, [float("inf"), 0.0]
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        lines = list(plane.lines)
        has_ops_line = any(line.name == "XLA Ops" for line in lines)
        for line in lines:
            events = list(line.events)
            if line.name == "XLA Ops":
                for e in events:
                    by_op[e.name] += e.duration_ns / 1e9
            elif line.name.startswith("Stream"):
                for e in events:
                    kernels[e.name[:80]] += e.duration_ns / 1e9
                    n_kernels += 1
                    if not has_ops_line:  # jax 0.11's traces: the kernel's HLO op is one of its stats
                        op = dict(e.stats).get("hlo_op")
                        if op:
                            by_op[str(op)] += e.duration_ns / 1e9
                    span = [min(span[0], e.start_ns), max(span[1], e.start_ns + e.duration_ns)]
    if not kernels:
        raise RuntimeError("no GPU kernel events in the trace")
    by_kind = collections.Counter()
    for name, sec in by_op.items():
        by_kind[_kind(name)] += sec
    slowest = [
        dict(op=n, seconds_per_call=sec / calls, shape=index.get(n, ("?", ""))[0], source=index.get(n, ("", ""))[1])
        for n, sec in by_op.most_common(top)
    ]
    return dict(
        window_seconds_per_call=(span[1] - span[0]) / 1e9 / calls,
        kernel_seconds_per_call=sum(kernels.values()) / calls,
        kernels_per_call=n_kernels / calls,
        by_kind={k: v / calls for k, v in by_kind.most_common(top)},
        top_kernels={k: v / calls for k, v in kernels.most_common(top)},
        slowest=slowest,
    )


def profile(program: str, shape: str, calls: int, big_mib: float, top: int = 15, max_new_tokens: int = 0) -> dict:
    if program == "train_step":
        call, hlo = train_step_program(shape)
    else:
        call, hlo = sampler_program(shape, max_new_tokens)
    jax.block_until_ready(call())
    t0 = time.perf_counter()
    jax.block_until_ready(call())
    untraced = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        for _ in range(calls):
            jax.block_until_ready(call())
        jax.profiler.stop_trace()
        if jax.default_backend() == "gpu":
            report = analyse_gpu(trace_dir, hlo, calls, top)
        else:
            report = analyse(trace_dir, hlo, calls, big_mib, top)
    return dict(program=program, shape=shape, calls=calls, untraced_seconds=untraced, **report)


def print_report(r: dict) -> None:
    if "kernels_per_call" in r:  # a GPU trace
        print(
            f"{r['program']} on `{r['shape']}`: {r['untraced_seconds'] * 1e3:.1f} ms untraced, "
            f"{r['window_seconds_per_call'] * 1e3:.1f} ms per traced call, kernels busy "
            f"{r['kernel_seconds_per_call'] * 1e3:.1f} ms, {r['kernels_per_call']:.0f} kernels per call"
        )
        for title, rows in (("HLO op kinds", r["by_kind"]), ("kernels", r["top_kernels"])):
            print(f"  {title} (ms per call):")
            for k, v in rows.items():
                print(f"    {v * 1e3:9.2f}  {k}")
        print("  slowest ops (ms per call, result shape, JAX op):")
        for o in r["slowest"]:
            print(f"    {o['seconds_per_call'] * 1e3:9.2f}  {o['op']}  {o['shape'][:48]}  {o['source'][-70:]}")
        return
    print(
        f"{r['program']} on `{r['shape']}`: {r['untraced_seconds'] * 1e3:.1f} ms untraced, "
        f"{r['window_seconds_per_call'] * 1e3:.1f} ms per traced call, {r['threads']} threads ran ops, "
        f"busy {r['thread_seconds_per_call'] * 1e3:.1f} thread-ms per call"
    )
    share = ", ".join(f"{k} busy {v:.0%}" for k, v in r["busy_share"].items())
    print(f"  time with 0 / 1 / 2+ threads running an op: {share}")
    print(
        f"  matmuls {r['matmul_share']:.0%} of thread time; "
        f"non-matmul ops writing big buffers {r['memory_pass_share']:.0%}"
    )
    print("  exclusive thread time by op kind (ms per call):")
    for k, v in r["by_kind"].items():
        print(f"    {v * 1e3:9.2f}  {k}")
    print("  slowest ops (ms per call, result shape, JAX op):")
    for o in r["slowest"]:
        print(f"    {o['seconds_per_call'] * 1e3:9.2f}  {o['op']}  {o['shape'][:48]}  {o['source'][-70:]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--program", choices=PROGRAMS, default="train_step")
    ap.add_argument(
        "--shape",
        default="iteration",
        help=f"one of {(*SHAPES, 'real')} (real: issue 40's, accelerators) or a config file, e.g. "
        "configs/study/deep_moe.py:grpo (its warm start off)",
    )
    ap.add_argument("--max_new_tokens", type=int, default=0, help="the sampler's decode steps (0: the config's)")
    ap.add_argument("--calls", type=int, default=3, help="traced calls (after one warm-up)")
    ap.add_argument("--big-mib", type=float, default=8.0, help="a memory pass writes at least this many MiB")
    ap.add_argument("--top", type=int, default=15, help="op kinds and single ops listed")
    ap.add_argument("--out", help="also write the report here as JSON")
    args = ap.parse_args()
    if args.calls < 1:
        ap.error(f"--calls {args.calls}: must be at least 1")
    if args.shape not in (*SHAPES, "real") and not Path(args.shape.partition(":")[0]).is_file():
        ap.error(f"--shape {args.shape!r}: not one of {(*SHAPES, 'real')} nor a config file")
    if args.shape != "tiny":
        refuse_unoptimised(ap, "--shape tiny")
    r = profile(args.program, args.shape, args.calls, args.big_mib, args.top, args.max_new_tokens)
    print_report(r)
    if args.out:
        Path(args.out).write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    sys.exit(main())

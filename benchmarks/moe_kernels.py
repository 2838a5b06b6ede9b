"""The MoE dispatch paths (`gspo_jax.dispatch`) at a real model's expert dimensions, on whatever backend
runs it: compiled temporary memory (XLA's `memory_analysis`) and time of one training pass (forward +
backward) and of one decode step (forward of a small batch), with the analytic FLOPs and bytes.

    python -m benchmarks.moe_kernels                     # Qwen3-30B-A3B's expert dims, one layer
    python -m benchmarks.moe_kernels --compile_only      # memory only (e.g. on a CPU)
    python -m benchmarks.moe_kernels --dims small        # seconds, anywhere

`ragged_triton` is `ragged` with JAX's Pallas-Triton lowering of `ragged_dot` on GPU
(`jax_ragged_dot_use_gpu_pallas_triton_lowering`, where this JAX has the option). Useful FLOPs count
only routed work: 2 x 3 matmuls x rows x D x F forward, 3x that forward + backward. A decode step
must read every expert's weights once (a batch x top-k of 512 touches nearly all 128 experts): its
floor is those bytes at the device's copy bandwidth, measured here too.

It imports only `gspo_jax.dispatch` and `gspo_jax.grouped` (JAX), not `benchmarks.run`, whose imports
(the trainer, transformers, ml_collections) a bare accelerator image lacks: hence its own small timer
and peak.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp

from gspo_jax import dispatch, grouped

DIMS = {
    # Qwen3-30B-A3B: width 2048, 128 experts top-8, expert width 768. Train: 16 sequences x 1536
    # tokens (one minibatch of the 2-layer GPU shape, 64 x 1536 in 4). Decode: batch 64.
    "qwen3_30b_a3b": dict(D=2048, F=768, E=128, K=8, train_tokens=16 * 1536, decode_tokens=64),
    "small": dict(D=128, F=64, E=16, K=2, train_tokens=512, decode_tokens=16),
}
TRITON_FLAG = "jax_ragged_dot_use_gpu_pallas_triton_lowering"


def blocked_experts(x_BTD, topk_BTK, gates_BTK, w_gate_EDF, w_up_EDF, w_down_EFD, *, block: int):
    """A candidate for accelerators: the sparse path's block-padded expert-sorted rows
    (`dispatch.block_layout`) as one batched matmul over blocks, each block's expert weights gathered
    ([NB, D, F]); autodiff's weight gradient is a batched matmul and a scatter-add over blocks: memory
    grows with the tokens (NB = (A + E(b-1))/b blocks), never with experts x tokens. Unused blocks
    compute on zero rows."""
    B, T, D = x_BTD.shape
    K, E = topk_BTK.shape[-1], w_gate_EDF.shape[0]
    N, dtype = B * T, x_BTD.dtype
    layout = dispatch.block_layout(topk_BTK.reshape(N, K).astype(jnp.int32), E, block)
    x_RD = jnp.concatenate([x_BTD.reshape(N, D), jnp.zeros((1, D), dtype)])[layout.token_R]
    x_nbD = x_RD.reshape(-1, block, D)
    e_n = layout.expert_NB
    g = jnp.einsum("nbd,ndf->nbf", x_nbD, w_gate_EDF[e_n].astype(dtype))
    u = jnp.einsum("nbd,ndf->nbf", x_nbD, w_up_EDF[e_n].astype(dtype))
    y_RD = jnp.einsum("nbf,nfd->nbd", jax.nn.silu(g) * u, w_down_EFD[e_n].astype(dtype)).reshape(-1, D)
    y_ND = jnp.einsum("nkd,nk->nd", y_RD[layout.row_NK], gates_BTK.reshape(N, K), preferred_element_type=jnp.float32)
    return y_ND.reshape(B, T, D).astype(dtype)


def _inputs(N: int, D: int, F: int, E: int, K: int, dtype, seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(k[0], (1, N, D), dtype)
    w = [(jax.random.normal(kk, s, jnp.float32) * s[-2] ** -0.5).astype(dtype) for kk, s in
         zip(k[1:4], [(E, D, F), (E, D, F), (E, F, D)])]  # fmt: skip
    topk = jax.lax.top_k(jax.random.uniform(k[4], (1, N, E)), K)[1].astype(jnp.int32)  # K distinct experts
    gates = jax.nn.softmax(jax.random.normal(k[5], (1, N, K)), axis=-1).astype(jnp.float32)
    return x, topk, gates, w


def _loss(fn, x, topk, gates, *w):
    return jnp.sum(fn(x, topk, gates, *w).astype(jnp.float32) ** 2)


def program(experts, phase: str):
    """A training pass (loss value and gradients in x, gates and the three weights) or a decode forward."""
    if phase == "train":
        return jax.value_and_grad(functools.partial(_loss, experts), argnums=(0, 2, 3, 4, 5))
    return experts


def max_rel_err(fn, ref, args) -> float:
    """The largest of max|a - b| / max|b| over the outputs' leaves (values, then each gradient)."""
    got, want = jax.jit(fn)(*args), jax.jit(ref)(*args)
    errs = [
        float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))
    ]
    return max(errs)


def _time(compiled, args, repeats: int) -> float:
    jax.block_until_ready(compiled(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def measure(name: str, fn, args, flops: float, repeats: int, compile_only: bool, flag: bool = False) -> dict:
    """Compiles `fn(*args)`; its memory and (unless compile_only) best time over `repeats` calls."""
    row = dict(path=name, useful_flops=flops)
    before = jax.config.values.get(TRITON_FLAG)
    if flag:
        jax.config.update(TRITON_FLAG, True)
    try:
        t0 = time.perf_counter()
        compiled = jax.jit(fn).lower(*args).compile()
        row["compile_seconds"] = time.perf_counter() - t0
        m = compiled.memory_analysis()
        row["temp_bytes"] = int(m.temp_size_in_bytes) if m is not None else None
        if not compile_only:
            row["seconds"] = _time(compiled, args, repeats)
            row["tflops_per_s"] = flops / row["seconds"] / 1e12
    except Exception as e:  # out of memory, or a lowering this backend lacks: a row, not a crash
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    finally:
        if flag:
            jax.config.update(TRITON_FLAG, before)
    return row


def peak_bf16(repeats: int) -> float:
    n = 8192 if jax.default_backend() != "cpu" else 1024
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)  # random data: constant data runs faster
    f = jax.jit(lambda a, b: a @ b).lower(a, a).compile()
    return 2 * n**3 / _time(f, (a, a), repeats)


def copy_bandwidth(repeats: int) -> float:
    """Bytes read + written per second by a device copy of a 1 GiB (CPU: 64 MiB) array."""
    n = (1 << 30 if jax.default_backend() != "cpu" else 1 << 26) // 4
    a = jnp.ones((n,), jnp.float32)
    f = jax.jit(lambda a: a * 2).lower(a).compile()
    return 2 * 4 * n / _time(f, (a,), repeats)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="qwen3_30b_a3b", choices=tuple(DIMS))
    ap.add_argument("--paths", default="ragged,ragged_triton,sparse,dense", help="comma-separated")
    ap.add_argument("--compile_only", action="store_true", help="memory only, nothing run")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="", help="also write the results as JSON here")
    ap.add_argument(
        "--tiles",
        default="",
        help="GPU: also the grouped path's train pass with these Mosaic GPU tiles, ';'-separated "
        "block_m,block_n,block_k,max_concurrent_steps,grid_block_n (e.g. 64,128,64,4,1;128,128,64,6,1)",
    )
    args = ap.parse_args()
    d = DIMS[args.dims]
    D, F, E, K = d["D"], d["F"], d["E"], d["K"]
    dtype = jnp.bfloat16
    fns = {
        "ragged": dispatch.ragged_experts,
        "ragged_triton": dispatch.ragged_experts,
        "sparse": dispatch.sparse_experts,
    }
    fns["dense"] = dispatch.dense_experts
    fns["grouped"] = dispatch.experts_fn("grouped", jax.default_backend())
    for b in (8, 32, 256, 512, 1024):
        fns[f"blocked{b}"] = functools.partial(blocked_experts, block=b)
        fns[f"sparse{b}"] = functools.partial(dispatch.sparse_experts, block=b)
    paths = [p for p in args.paths.split(",") if p]
    unknown = set(paths) - set(fns)
    if unknown:
        ap.error(f"--paths: {sorted(unknown)} not in {sorted(fns)}")
    has_flag = TRITON_FLAG in jax.config.values
    dev = jax.devices()[0]
    out = dict(device=getattr(dev, "device_kind", str(dev)), backend=jax.default_backend(), jax=jax.__version__)
    out.update(dims=args.dims, triton_flag_known=has_flag, train=[], decode=[])
    if not args.compile_only:
        out["peak_bf16_flops"] = peak_bf16(args.repeats)
        out["copy_bytes_per_s"] = copy_bandwidth(args.repeats)
        print(json.dumps({k: out[k] for k in ("device", "jax", "peak_bf16_flops", "copy_bytes_per_s")}), flush=True)
    weight_bytes = 3 * E * D * F * jnp.dtype(dtype).itemsize
    for phase, N in (("train", d["train_tokens"]), ("decode", d["decode_tokens"])):
        x, topk, gates, w = _inputs(N, D, F, E, K, dtype)
        fwd_flops = 2 * 3 * N * K * D * F
        for p in paths:
            if p == "ragged_triton" and not (has_flag and jax.default_backend() == "gpu"):
                continue
            if p == "dense" and phase == "train" and E > 32:
                continue  # E/K = 16x the routed work: not a candidate for training at this width
            size = p.removeprefix("blocked").removeprefix("sparse")
            if size.isdigit() and (int(size) < 64) != (phase == "decode"):
                continue  # small blocks for decoding, large ones for training
            fn, call_args = program(fns[p], phase), (x, topk, gates, *w)
            flops = 3 * fwd_flops if phase == "train" else fwd_flops
            row = measure(p, fn, call_args, flops, args.repeats, args.compile_only, flag=p == "ragged_triton")
            row["tokens"] = N
            if p == "grouped" and not args.compile_only and "error" not in row:
                row["max_rel_err_vs_sparse"] = max_rel_err(fn, program(fns["sparse"], phase), call_args)
            if phase == "decode" and "seconds" in row:
                row["weight_bytes"] = weight_bytes
                row["floor_seconds"] = weight_bytes / out["copy_bytes_per_s"]  # each weight read once
            out[phase].append(row)
            print(json.dumps(dict(phase=phase, **row)), flush=True)
        for t in (t for t in args.tiles.split(";") if t and phase == "train" and not args.compile_only):
            names = ("block_m", "block_n", "block_k", "max_concurrent_steps", "grid_block_n")
            saved = dict(grouped.GPU_TILES)
            grouped.GPU_TILES.update(zip(names, (int(v) for v in t.split(","))))
            try:
                fn = program(dispatch.experts_fn("grouped", jax.default_backend()), phase)
                row = measure(f"grouped[{t}]", fn, (x, topk, gates, *w), 3 * fwd_flops, args.repeats, False)
            finally:
                grouped.GPU_TILES.clear()
                grouped.GPU_TILES.update(saved)
            out[phase].append(row)
            print(json.dumps(dict(phase=phase, **row)), flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

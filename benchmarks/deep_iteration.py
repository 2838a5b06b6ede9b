"""The study's headline cell, one RL iteration before and after the expert-loop changes of issue 65, in
one process: the baseline program against today's on the same warm-started policy and the same
iterations (the same keys and prompts), in alternating rounds so that a busy machine slows both alike.

    python -m benchmarks.deep_iteration        # configs/study/deep_moe.py:grpo; writes benchmarks/deep_iteration.json
    python -m benchmarks.deep_iteration --config configs/study/deep_moe.py:gspo --iterations 4 --rounds 3
    python -m benchmarks.deep_iteration --config configs/grpo.py:tiny --iterations 1 --rounds 1 --smoke

Baseline: padding tokens run the experts as any token (`moe.SKIP_PADDING = False`) and the sparse
dispatch runs no chunks (`dispatch.MAX_CHUNK_ROWS = 0`: past 16 experts one loop over the used blocks,
each reading its expert's weights and adding its weight gradients into the [E, ...] stacks): the
program before the change. Candidate: today's defaults (padding tokens skip the experts; each expert's
weights read once, its blocks in chunks of up to 256 rows, its weight gradients summed in a loop
carry). Each round builds both runs' programs afresh (`jax.clear_caches`, then `context.set_up`): the
switches are read when a program is traced.

Figures: each variant's median iteration seconds and parts (rollout, log-probs, updates, drift) over
its timed iterations (the first of each round compiles and is left out), their ratio, and the largest
relative difference of the first iteration's metrics between the two (the same rollout, scored and
updated in another order of float32 sums: rounding, not a change of method), with the machine and its
float32 matmul peak.
"""

from __future__ import annotations

if __name__ == "__main__":  # before JAX is imported: glibc reads its tunables only when a process starts
    from gspo_jax.host_memory import reexec_with_huge_pages

    reexec_with_huge_pages()  # as scripts/train.py runs

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.run.machine import peak, refuse_unoptimised  # noqa: E402
from gspo_jax import context, dispatch, moe  # noqa: E402
from gspo_jax import iteration as iteration_lib  # noqa: E402
from gspo_jax.built import build  # noqa: E402
from gspo_jax.config_files import load_config  # noqa: E402
from gspo_jax.provenance import machine  # noqa: E402
from gspo_jax.warm_start import warm_start  # noqa: E402

OUT = Path(__file__).with_name("deep_iteration.json")
PARTS = ("iteration_seconds", "rollout_seconds", "logprob_seconds", "update_seconds", "drift_seconds")
VARIANTS = {  # the module switches each variant's programs are traced with
    "baseline": {(moe, "SKIP_PADDING"): False, (dispatch, "MAX_CHUNK_ROWS"): 0},
    "candidate": {(moe, "SKIP_PADDING"): True, (dispatch, "MAX_CHUNK_ROWS"): dispatch.MAX_CHUNK_ROWS},
}


@contextlib.contextmanager
def switched(variant: str):
    """The module switches of `variant` set, and every compiled program dropped: what runs is traced anew."""
    saved = {(m, k): getattr(m, k) for m, k in VARIANTS[variant]}
    for (m, k), v in VARIANTS[variant].items():
        setattr(m, k, v)
    jax.clear_caches()
    try:
        yield
    finally:
        for (m, k), v in saved.items():
            setattr(m, k, v)


def run_round(built, params, iterations: int) -> list[dict]:
    """`iterations` + 1 RL iterations from `params` (the first compiles); each one's metrics."""
    ctx, _ = context.set_up(built)
    state = ctx.start(jax.tree.map(lambda x: x.copy(), params))
    rows = []
    for it in range(iterations + 1):
        state, metrics = iteration_lib.rl_iteration(ctx, state, it)
        rows.append({k: float(v) for k, v in metrics.items() if isinstance(v, (int, float, np.number))})
    return rows


def largest_difference(a: dict, b: dict) -> tuple[str, float]:
    """The metric (not a timer) with the largest relative difference between two iterations' rows."""
    keys = [k for k in a if k in b and not k.endswith("_seconds") and np.isfinite(a[k]) and np.isfinite(b[k])]
    rel = {k: abs(a[k] - b[k]) / max(abs(a[k]), abs(b[k]), 1e-12) for k in keys}
    worst = max(rel, key=rel.get)
    return worst, rel[worst]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/study/deep_moe.py:grpo", help="a config as scripts/train.py takes it")
    ap.add_argument("--iterations", type=int, default=4, help="timed iterations per variant and round")
    ap.add_argument("--rounds", type=int, default=2, help="rounds, each running both variants")
    ap.add_argument("--warm-start-cache", default="", help="where the warm start is cached (default: a temp dir)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--smoke", action="store_true", help="the test suite's run: no peak, unoptimised programs allowed")
    args = ap.parse_args(argv)
    if not args.smoke:
        refuse_unoptimised(ap, "--smoke")
    c = load_config(args.config)
    c.train.update(num_iterations=args.iterations + 1, eval_every=10**6, checkpoint_every=10**6)
    with tempfile.TemporaryDirectory() as tmp:
        c.warm_start.cache_dir = args.warm_start_cache or tmp
        built = build(c)
        ctx, params = context.set_up(built)
        params, _ = warm_start(built, ctx.base_graphdef, params, mesh=ctx.mesh, rollout=ctx.rollout, workdir=Path(tmp))
        del ctx
        rows = {v: [] for v in VARIANTS}
        for r in range(args.rounds):
            for v in VARIANTS if r % 2 == 0 else reversed(VARIANTS):
                with switched(v):
                    rows[v].append(run_round(built, params, args.iterations))
                    last = rows[v][-1]
                print(f"round {r} {v}: " + ", ".join(f"{row['iteration_seconds']:.2f}" for row in last[1:]) + " s")
    out = dict(config=args.config, machine=machine(), jax=jax.__version__)
    out["peak_flops_per_s"] = 0.0 if args.smoke else peak(False, 3)["flops_per_s"]
    for v in VARIANTS:
        timed = [row for rnd in rows[v] for row in rnd[1:]]
        out[v] = {k: float(np.median([row[k] for row in timed])) for k in PARTS}
    out["ratio"] = {k: out["baseline"][k] / out["candidate"][k] for k in PARTS}
    worst, rel = largest_difference(rows["baseline"][0][0], rows["candidate"][0][0])
    out["first_iteration_largest_relative_difference"] = dict(metric=worst, relative=rel)
    out["rows"] = rows
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"{args.config} on {out['machine']} (float32 matmul peak {out['peak_flops_per_s'] / 1e9:.0f} GFLOP/s):")
    for k in PARTS:
        b, n = out["baseline"][k], out["candidate"][k]
        print(f"  {k.removesuffix('_seconds'):>9}: baseline {b:.3f} s, candidate {n:.3f} s, ratio {b / n:.2f}x")
    print(f"  first iteration's metrics: largest relative difference {rel:.1e} ({worst})")
    print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()

"""LoRA against the whole model, in one process: the train step of a LoRA policy (the base frozen) against
the full fine-tune's, and the sampler with the adapters unmerged against the base's, on the same shape,
the two timed in alternation so that a busy machine slows both alike.

    python -m benchmarks.lora                 # the default size (docs/BENCHMARKS.md); writes benchmarks/lora.json
    python -m benchmarks.lora --rank 8 --targets attention,experts,mlp
    python -m benchmarks.lora --size tiny     # seconds: the smoke test

Both runs are set up as the trainer sets them up (`context.set_up`, `RunContext.start`), one minibatch of
random well-formed sequences for the step; the sampler decodes the rollout's batch to its full length
(no EOS), prefill included. Figures: best and median seconds of each, their ratios (LoRA / full) beside
the ratio of their analytic FLOPs (`gspo_jax/flops.py`: the adapters add work where the rank is a sizeable
share of the width; the frozen base's weight gradients are saved), the machine's peak for scale, and the
adapters' share of the parameters.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.run.machine import peak
from benchmarks.run.shapes import random_batch, shape_config
from gspo_jax import context, flops
from gspo_jax.built import build
from gspo_jax.provenance import machine

OUT = Path(__file__).with_name("lora.json")


def _runner(c):
    """(train step call, sampler call, parameter counts) of config `c`, set up as `run.py` does."""
    built = build(c)
    ctx, params = context.set_up(built)
    state = [ctx.start(params)]
    mb = built.batch_size // built.train.minibatches
    P, C = built.sampler.prompt_len, built.sampler.max_new_tokens
    batch = jax.device_put(random_batch(ctx.programs, state[0].policy, mb, P, C), ctx.programs.batch_shardings)

    def step():
        state[0], metrics, _ = ctx.programs.train_step(state[0], batch)
        return metrics

    rng = np.random.default_rng(0)
    prompts = jnp.asarray(rng.integers(4, built.model.vocab_size, (built.batch_size, P)), jnp.int32)
    mask = jnp.ones((built.batch_size, P), bool)
    sampler = ctx.rollout.sampler

    def sample():
        return sampler(state[0].policy, prompts, mask, jax.random.key(0)).tokens

    trained = sum(x.size for x in jax.tree.leaves(state[0].params))
    total = sum(x.size for x in jax.tree.leaves(state[0].policy))
    counts = dict(trained_params=trained, policy_params=total, minibatch=[mb, P + C])
    counts["train_flops"] = flops.train_flops(built.model, mb, P + C)  # what the step must compute
    counts["sample_flops"] = flops.sample_flops(built.model, built.batch_size, P, C)
    return step, sample, counts


def alternate(fns: dict, repeats: int) -> dict[str, list[float]]:
    """Wall times of each fn (results ready), one call of each in turn `repeats` times, after a warm-up."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[k].append(time.perf_counter() - t0)
    return times


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="default", choices=("default", "tiny"))
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--targets", default="attention,experts", help="comma-separated: attention, mlp, experts, router")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    full_c = shape_config(args.size)
    full_c.train.checkpoint_every = 1000
    lora_c = shape_config(args.size)
    lora_c.lora.update(rank=args.rank, targets=tuple(args.targets.split(",")))
    full_step, full_sample, full_n = _runner(full_c)
    lora_step, lora_sample, lora_n = _runner(lora_c)
    steps = alternate(dict(full=full_step, lora=lora_step), args.repeats)
    samples = alternate(dict(full=full_sample, lora=lora_sample), args.repeats)
    tiny = args.size == "tiny"  # the smoke test: no peak (its figures are not read)
    out = dict(machine=machine(), peak_flops_per_s=0.0 if tiny else peak(False, 3)["flops_per_s"], size=args.size)
    out.update(rank=args.rank, targets=args.targets, repeats=args.repeats, full=full_n, lora=lora_n)
    out["adapter_share"] = lora_n["trained_params"] / lora_n["policy_params"]
    for name, times in (("train_step", steps), ("sample", samples)):
        best = {k: min(v) for k, v in times.items()}
        median = {k: float(np.median(v)) for k, v in times.items()}
        out[name] = dict(best=best, median=median, ratio=best["lora"] / best["full"])
        out[name]["ratio_median"] = median["lora"] / median["full"]
        key = "train_flops" if name == "train_step" else "sample_flops"
        out[name]["flops_ratio"] = lora_n[key] / full_n[key]  # the floor the time ratio meets where matmuls dominate
        print(
            f"{name}: full {best['full'] * 1e3:.1f} ms, LoRA {best['lora'] * 1e3:.1f} ms (best of {args.repeats}): "
            f"LoRA / full {out[name]['ratio']:.3f} (medians {out[name]['ratio_median']:.3f}; "
            f"FLOPs {out[name]['flops_ratio']:.3f})"
        )
    print(
        f"rank {args.rank} on {args.targets}: {lora_n['trained_params']:,} trained parameters of "
        f"{lora_n['policy_params']:,} ({out['adapter_share']:.1%}); host {out['machine']}, "
        f"peak {out['peak_flops_per_s'] / 1e9:.0f} GFLOP/s"
    )
    Path(args.out).write_text(json.dumps(out, indent=2, default=float))
    print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()

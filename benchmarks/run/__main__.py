"""How close gspo_jax is to this machine's limit: every figure a ratio measured in this one process
(sections and usage: `benchmarks/run/__init__.py`)."""

from __future__ import annotations

if __name__ == "__main__":  # before JAX is imported: glibc reads its tunables only when a process starts
    from gspo_jax.host_memory import reexec_with_huge_pages

    reexec_with_huge_pages()  # as scripts/train.py runs: XLA's big per-call buffers on huge pages

import argparse  # noqa: E402
import atexit  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

from benchmarks.moe_kernels import copy_bandwidth, peak_bf16  # the same peak and bandwidth as moe_kernels'  # noqa: E402
from benchmarks.run import accelerator  # noqa: E402
from benchmarks.run.costs import critic_cost, diagnostics_cost  # noqa: E402
from benchmarks.run.dispatch import moe_dispatch, moe_expert_parallel  # noqa: E402
from benchmarks.run.iterations import iteration, iteration_scaling, race_iteration  # noqa: E402
from benchmarks.run.loop import loop_figures, print_loop  # noqa: E402
from benchmarks.run.machine import accelerator_versions, peak, refuse_unoptimised  # noqa: E402
from benchmarks.run.overlap import overlap_figures, print_overlap  # noqa: E402
from benchmarks.run.sampler import sampler_throughput  # noqa: E402
from benchmarks.run.shapes import iteration_config  # noqa: E402
from benchmarks.run.step import loss_share, train_mfu  # noqa: E402
from benchmarks.run.targets import print_targets  # noqa: E402
from gspo_jax import compiles  # noqa: E402
from gspo_jax.provenance import commit, device_slug, machine  # noqa: E402

RESULTS = Path(__file__).parents[1] / "results.json"


# ------------------------------------------------------------------ the sections
# Each runs its measurement, prints its own lines and returns what goes into the JSON under its name;
# `results` holds what ran before it (the machine, the peak whose FLOP/s is every MFU's denominator).


def _flops(results: dict) -> float:
    return results["peak"]["flops_per_s"]


def peak_section(tiny: bool, repeats: int, results: dict) -> dict:
    r = peak(tiny, repeats)
    print(f"peak float32 matmul: {r['flops_per_s'] / 1e9:.1f} GFLOP/s ({results['machine']})")
    return r


def train_section(tiny: bool, repeats: int, results: dict) -> dict:
    out = train_mfu(tiny, repeats, _flops(results))
    for name, r in out.items():
        print(
            f"train step [{name}]: {r['seconds'] * 1e3:.1f} ms, MFU {r['mfu']:.1%} (best of {r['calls']} calls; "
            f"median {r['median_seconds'] * 1e3:.1f} ms, {r['mfu_median']:.1%})"
        )
    return out


def loss_section(tiny: bool, repeats: int, results: dict) -> dict:
    out = loss_share(tiny, repeats)
    for name, r in out["by_objective"].items():
        print(f"loss [{name}]: {r['seconds'] * 1e3:.2f} ms, {r['share_of_train_step']:.1%} of a train step")
    return out


def moe_section(tiny: bool, repeats: int, results: dict) -> dict:
    out = moe_dispatch(tiny, repeats)
    if jax.device_count() == 1:
        out["two_devices"] = moe_expert_parallel(tiny, repeats)
    for r in out["rows"]:
        dense_ms, dense = r["dense_seconds"] * 1e3, r["dense_seconds"]
        print(
            f"moe N={r['tokens']} E={r['experts']}: dense {dense_ms:.2f} ms, ragged/dense "
            f"{r['ragged_seconds'] / dense:.2f}, sparse/dense {r['sparse_seconds'] / dense:.2f}"
        )
    for r in out.get("two_devices", out["rows"]):
        if "expert_parallel_seconds" in r:
            print(
                f"moe N={r['tokens']} E={r['experts']}, 2 devices: expert-parallel/sparse "
                f"{r['expert_parallel_seconds'] / r['sparse_seconds']:.2f}, expert-parallel/dense "
                f"{r['expert_parallel_seconds'] / r['dense_seconds']:.2f}"
            )
    return out


def sampler_section(tiny: bool, repeats: int, results: dict) -> dict:
    s = sampler_throughput(tiny, repeats, _flops(results))
    print(
        f"sampler batch {s['batch']}: {s['tokens_per_s']:,.0f} tokens/s, {s['speedup_vs_naive']:.1f}x naive, "
        f"decode MFU {s['decode_mfu']:.1%}; by batch: "
        + ", ".join(f"{r['batch']}: {r['tokens_per_s']:,.0f}" for r in s["by_batch"])
        + f"; with {s['threads']} threads (the trainer's): "
        + ", ".join(f"{r['batch']}: {r['tokens_per_s']:,.0f}" for r in s["by_batch_threaded"])
    )
    return s


def iteration_section(tiny: bool, repeats: int, results: dict) -> dict:
    it = iteration(tiny, repeats)
    cache = it.pop("compilation_cache")
    for name, r in it.items():
        parts = ", ".join(f"{k.removesuffix('_seconds')} {v:.2f}" for k, v in r["split"].items())
        print(
            f"iteration [{name}]: {r['seconds']:.2f} s ({parts}); compiles after warm-up "
            f"{r['compiles_after_warmup']}, first iteration after {r['seconds_to_first_iteration']:.1f} s"
        )
    it["compilation_cache"] = cache
    print(
        f"first iteration (drift on) with a persistent compilation cache: empty "
        f"{cache['seconds_to_first_iteration_cold']:.1f} s, filled by a previous run "
        f"{cache['seconds_to_first_iteration_warm']:.1f} s"
    )
    return it


def scaling_section(tiny: bool, repeats: int, results: dict) -> dict:
    sc = iteration_scaling(tiny, repeats)
    for r in sc["rows"]:
        parts = ", ".join(f"{k.removesuffix('_seconds')} {v:.3f}" for k, v in r["split"].items())
        print(
            f"iteration, {'tiny' if tiny else 'default'} config, group size {r['group_size']}, "
            f"up to {r['max_new_tokens']} new tokens ({r['sequences']} sequences, mean length "
            f"{r['completion_len_mean']:.1f}): {r['seconds']:.3f} s, {r['seconds_at_config_cadence']:.3f} s with "
            f"evaluation every {sc['eval_every']} and a save every {sc['checkpoint_every']} ({parts})"
        )
    return sc


def diagnostics_section(tiny: bool, repeats: int, results: dict) -> dict:
    d = diagnostics_cost(tiny, repeats)
    print(
        f"drift + routing diagnostics, {'tiny' if tiny else 'default'} config: "
        f"{d['share']:.1%} of an iteration (drift pass {d['drift_share']:.1%}, "
        f"the step's routing split {d['split_share']:.1%}: "
        f"{d['step_with_split'] * 1e3:.1f} vs {d['step_without_split'] * 1e3:.1f} ms per update); whole runs "
        f"{d['on']['seconds']:.3f} s/iteration on, {d['off']['seconds']:.3f} off"
    )
    return d


def critic_section(tiny: bool, repeats: int, results: dict) -> dict:
    r = critic_cost(tiny, repeats)
    its = r["iterations"]
    print(
        f"critic, {'tiny' if tiny else 'default'} config: {r['critic_share']:.1%} of a PPO "
        "iteration "
        f"(train step {r['step_with_critic_seconds'] * 1e3:.1f} vs {r['step_without_critic_seconds'] * 1e3:.1f} ms "
        f"without its update; values pass {r['estimate_seconds'] * 1e3:.1f} ms, the scoring forward "
        f"{r['score_seconds'] * 1e3:.1f} ms); memory: critic params {r['critic_param_bytes'] / 2**20:.2f} MiB + "
        f"moments {r['critic_opt_bytes'] / 2**20:.2f} MiB (policy {r['policy_param_bytes'] / 2**20:.2f} + "
        f"{r['policy_opt_bytes'] / 2**20:.2f}), step temporaries {r['step_with_critic_temp_bytes'] / 2**20:.1f} vs "
        f"{r['step_without_critic_temp_bytes'] / 2**20:.1f} MiB; iteration: "
        + ", ".join(f"{k} {v['seconds']:.3f} s" for k, v in its.items())
    )
    return r


def _layers(results: dict) -> int:
    return results.get("real_layers", accelerator.REAL_LAYERS)


def overlap_section(tiny: bool, repeats: int, results: dict) -> dict:
    r = overlap_figures(tiny, repeats)
    print_overlap(r)
    return r


def real_section(tiny: bool, repeats: int, results: dict) -> dict:
    """The real-dims train and decode steps at `--real-layers` layers (`accelerator`); compile-only
    memory on a CPU."""
    layers, kind = _layers(results), jax.devices()[0].device_kind
    dims = f"real dims, {layers} layers"
    if jax.default_backend() == "cpu":
        rows = [accelerator.train_step(d, repeats, 0.0, compile_only=True, layers=layers) for d in ("sparse", "ragged")]
        for r in rows:
            print(f"{dims}, train step [{r['dispatch']}], compiled: temp {r.get('temp_bytes', 0) / 2**30:.2f} GiB")
        decode = [accelerator.decode_step_bytes(d, layers=layers) for d in ("dense", "sparse")]
        for r in decode:
            print(
                f"{dims}, decode step [{r['dispatch']}], compiled: {r['bytes_accessed'] / 1e9:.2f} GB accessed, "
                f"{r['ratio']:.2f}x the {r['weight_bytes'] / 1e9:.2f} GB of weights it must read"
            )
        return dict(layers=layers, train=rows, decode=decode)
    out = dict(layers=layers, peak_bf16_flops=peak_bf16(repeats), copy_bytes_per_s=copy_bandwidth(repeats))
    spec = accelerator.spec_peak(kind)
    spec_text = f"spec {spec[1] / 1e12:.0f} TFLOP/s ({spec[0]})" if spec else f"no spec peak known for {kind!r}"
    print(
        f"bf16 peak {out['peak_bf16_flops'] / 1e12:.0f} TFLOP/s measured ({spec_text}), "
        f"copy {out['copy_bytes_per_s'] / 1e12:.2f} TB/s"
    )
    out["train"], out["decode"] = [], []
    # The default dispatch (what `auto` picks here), and the all-expert path as the decode's alternative;
    # last session's sparse (597 ms) and ragged (4.50 ms) rows: docs/BENCHMARKS.md.
    for d in ("auto",):
        try:
            r = accelerator.train_step(d, repeats, out["peak_bf16_flops"], layers=layers)
            print(
                f"{dims}, train step [{d}]: {r['seconds'] * 1e3:.0f} ms for {r['tokens']} tokens, "
                f"{r['tflops_per_s']:.0f} TFLOP/s, {accelerator.mfu_text(r, kind)}, "
                f"temp {r.get('temp_bytes', 0) / 2**30:.2f} GiB"
            )
        except Exception as e:  # out of memory, or a kernel this device lacks: a row, not a crash
            r = dict(dispatch=d, error=f"{type(e).__name__}: {str(e)[:400]}")
            print(f"{dims}, train step [{d}]: {r['error']}")
        out["train"].append(r)
    for d in ("auto", "dense"):
        try:
            r = accelerator.decode_step(d, repeats, out["copy_bytes_per_s"], layers=layers)
            print(f"{dims}, decode step [{d}]: {r['ms_per_step']:.2f} ms (floor {r['floor_ms']:.2f} ms)")
        except Exception as e:
            r = dict(dispatch=d, error=f"{type(e).__name__}: {str(e)[:400]}")
            print(f"{dims}, decode step [{d}]: {r['error']}")
        out["decode"].append(r)
    return out


def loop_section(tiny: bool, repeats: int, results: dict) -> dict:
    """The RL iteration against its parts in one process (`benchmarks/run/loop.py`)."""
    r = loop_figures(tiny, repeats, _layers(results), results.get("real", {}).get("peak_bf16_flops", 0.0))
    print_loop(r)
    return r


def race_section(tiny: bool, repeats: int, results: dict) -> dict:
    """The race shape's iteration (`benchmarks/trl_race.py` runs TRL's beside it)."""
    r = race_iteration(iteration_config("tiny" if tiny else "iteration"))
    print(f"race shape, one iteration: {r['seconds'] * 1e3:.0f} ms, split {r['split']}")
    return r


SECTIONS: dict[str, Callable[[bool, int, dict], dict]] = {  # a CPU's run order
    "peak": peak_section,  # run with every section but the accelerator's: its FLOP/s is their denominator
    "train": train_section,
    "loss": loss_section,
    "moe": moe_section,
    "sampler": sampler_section,
    "iteration": iteration_section,
    # Before the tiny runs below: the programs its start-up measurement leaves loaded are theirs too.
    "loop": loop_section,
    "scaling": scaling_section,
    "diagnostics": diagnostics_section,
    "critic": critic_section,
    "overlap": overlap_section,
    "real": real_section,
    "race": race_section,
}
ACCELERATOR_SECTIONS = ("real", "loop", "race")  # what runs by default on a GPU or TPU, and first
# Left out of a CPU's default run (`real` compiles only there; `overlap`'s fake devices share the cores, so
# it shows the split's bookkeeping, not an overlap); --only runs them.
CPU_SKIPS = ("real", "race", "overlap")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", choices=tuple(SECTIONS), help="run only these sections")
    ap.add_argument("--size", default="full", choices=("full", "tiny"), help="tiny: seconds, for the smoke test")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument(
        "--real-layers",
        type=int,
        default=accelerator.REAL_LAYERS,
        help="depth of the real-dims proxy (sections real and loop on an accelerator)",
    )
    args = ap.parse_args()
    tiny = args.size == "tiny"
    if not tiny:
        refuse_unoptimised(ap, "--size tiny")
    accel = jax.default_backend() != "cpu"
    sections = args.only or (ACCELERATOR_SECTIONS if accel else tuple(s for s in SECTIONS if s not in CPU_SKIPS))
    if accel and args.out == str(RESULTS):
        depth = "" if args.real_layers == accelerator.REAL_LAYERS else f"-{args.real_layers}layers"
        args.out = str(RESULTS.with_name(f"results-{device_slug()}{depth}.json"))
    repeats = 1 if tiny else args.repeats
    if tiny:  # the smoke test: its sections share their compiles (`timing.cold_cache_dir`)
        if not jax.config.jax_compilation_cache_dir:
            directory = tempfile.mkdtemp(prefix="gspo_jax_benchmarks_")
            atexit.register(shutil.rmtree, directory, ignore_errors=True)
            compiles.use_persistent_cache(directory)
        print("--size tiny: a smoke test; its sections share one compilation cache, so cold-start figures may be loads")
    results = dict(machine=machine(), command=shlex.join(["python", "-m", "benchmarks.run", *sys.argv[1:]]))
    results["git"] = commit()
    results["real_layers"] = args.real_layers
    results["jax"] = jax.__version__
    results["glibc_tunables"] = os.environ.get("GLIBC_TUNABLES", "")  # huge pages or not: see host_memory
    results["jax_disable_most_optimizations"] = bool(jax.config.values["jax_disable_most_optimizations"])
    if accel:
        results.update(accelerator_versions())
    # On an accelerator its sections first, then the peak and the others unless those were all; on a
    # CPU in `SECTIONS`' order.
    accelerator_only = accel and not set(sections) - set(ACCELERATOR_SECTIONS)
    rest = () if accelerator_only else tuple(s for s in SECTIONS if s not in ACCELERATOR_SECTIONS)
    results["section_seconds"] = took = {}  # each section's wall time, its compiles included
    write = lambda: Path(args.out).write_text(json.dumps(results, indent=2, default=float))
    for name in (*ACCELERATOR_SECTIONS, *rest) if accel else SECTIONS:
        if name in sections or name == "peak":
            t0 = time.perf_counter()
            results[name] = SECTIONS[name](tiny, repeats, results)
            took[name] = time.perf_counter() - t0
            write()  # after each section: a later one that fails leaves the earlier figures written
    print_targets(results)  # the rows of the sections that ran
    write()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Deviceless ahead-of-time compilation for a TPU slice: does a config's RL step fit, and what would
it cost? Lowers and compiles the train step, the scoring forward (π_old / π_ref log-probs) and the
sampler for a named topology (`jax.experimental.topologies`, with `libtpu` from the `tpu` extra) and
the config's mesh, with no TPU attached, and reads XLA's per-chip memory analysis.
`scripts/aot_compile.py` prints the report."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time

import jax
import jax.numpy as jnp

from gspo_jax import built as built_lib
from gspo_jax import flops, lora
from gspo_jax import model as model_lib
from gspo_jax import programs as programs_lib
from gspo_jax import sharding as sharding_lib
from gspo_jax.sampler import Sampler
from gspo_jax.train import TrainBatch
from gspo_jax.validation import ConfigError

GIB = 2**30
# Per chip: HBM (GiB) and peak bfloat16 matmul FLOP/s, from Google Cloud's TPU pages.
CHIPS = {
    "v4": (32.0, 275e12),
    "v5e": (16.0, 197e12),
    "v5p": (95.74, 459e12),
    "v6e": (32.0, 918e12),
}
PROGRAMS = ("train_step", "score", "sample")
MFU = 0.4  # the implied step time assumes this fraction of the slice's peak


@dataclasses.dataclass(frozen=True)
class Row:
    """One compiled program on one slice; bytes are per chip."""

    program: str
    mesh: str  # the mesh's axes larger than 1, e.g. "fsdp=4×expert=8"
    shape: str  # sequences × tokens it processes
    argument_bytes: int
    output_bytes: int
    alias_bytes: int  # outputs written in place of donated arguments
    temp_bytes: int
    hbm_bytes: int
    compile_seconds: float
    flops: float  # analytic useful FLOPs of one call, the whole slice
    seconds_at_mfu: float  # the call's time at `MFU` of the slice's peak
    # Set when XLA refused to compile for lack of HBM: then temp_bytes is what it said the temporaries
    # need, argument_bytes the arguments' shards, and outputs are not known (0).
    refused: str = ""
    # XLA's own count (`cost_analysis`) for one chip. It counts a loop body once, so it is comparable
    # with `flops / chips` only for a program without loops (scan_layers=False, one micro-batch, no
    # chunks); a ratio well above 1 there means chips repeat each other's work.
    xla_flops_per_chip: float = 0.0
    chips: int = 1
    # Parameter copies the program's chips hold beside its arguments: on a sampler mesh of its own
    # (`mesh.rollout_devices`), the lagged policies of `rollout.staleness` (k: the one sampled with is
    # an argument, the next one arrives as the oldest leaves).
    resident_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + self.resident_bytes

    @property
    def hbm_fraction(self) -> float:
        return self.total_bytes / self.hbm_bytes

    @property
    def fits(self) -> bool:
        return not self.refused and self.total_bytes <= self.hbm_bytes


def topology_devices(topology: str):
    """The devices of a named TPU topology, e.g. "v5p:2x4x4" (32 chips), without a TPU attached."""
    from jax.experimental import topologies

    # libtpu takes a machine-wide lock on load, meant for TPU hosts; with no TPU attached, several
    # processes (a test and the script it launches, two compiles) may compile at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    chip = topology.split(":", 1)[0]
    if chip not in CHIPS or ":" not in topology:
        raise ConfigError(f"topology: {topology!r} is not '<chip>:<shape>' with chip one of {tuple(CHIPS)}")
    try:
        return topologies.get_topology_desc(topology, "tpu").devices
    except Exception as e:  # libtpu missing, or a shape it does not know
        raise ConfigError(
            f"topology: {topology!r} could not be described ({type(e).__name__}: {str(e).splitlines()[0]}); "
            "deviceless compilation needs libtpu: pip install -e '.[tpu]'"
        ) from None


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50}


def _shard_bytes(args) -> int:
    """Bytes per chip of abstract arguments (ShapeDtypeStructs with shardings)."""
    leaves = [x for x in jax.tree.leaves(args) if hasattr(x, "sharding") and x.sharding is not None]
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in leaves)


def _row(program, mesh, shape, lower, args, hbm, flops_, peak, chips, resident=0) -> Row:
    t0 = time.perf_counter()
    common = dict(program=program, mesh=mesh, shape=shape, hbm_bytes=int(hbm * GIB), flops=flops_)
    common["seconds_at_mfu"] = flops_ / (MFU * peak * chips)
    common.update(chips=chips, resident_bytes=resident)
    try:
        compiled = lower(*args).compile()
        m = compiled.memory_analysis()
    except jax.errors.JaxRuntimeError as e:
        need = re.search(r"HLO temporaries \(([\d.]+)([KMGTP]?)\)", str(e))
        if "RESOURCE_EXHAUSTED" not in str(e) or need is None:
            raise
        return Row(
            argument_bytes=_shard_bytes(args),
            output_bytes=0,
            alias_bytes=0,
            temp_bytes=int(float(need.group(1)) * _UNITS[need.group(2)]),
            compile_seconds=time.perf_counter() - t0,
            refused="XLA: out of HBM",
            **common,
        )
    return Row(
        argument_bytes=m.argument_size_in_bytes,
        output_bytes=m.output_size_in_bytes,
        alias_bytes=m.alias_size_in_bytes,
        temp_bytes=m.temp_size_in_bytes,
        compile_seconds=time.perf_counter() - t0,
        xla_flops_per_chip=_xla_flops(compiled),
        **common,
    )


def _xla_flops(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float((cost or {}).get("flops", 0.0))


def parse_mesh(layout: str) -> dict[str, int]:
    """A mesh layout such as "data=2,fsdp=2" as every axis's size (axes not named are 1; -1: the devices
    left), for comparing plans in one process: `scripts/aot_compile.py --mesh`."""
    sizes = dict.fromkeys(sharding_lib.MESH_AXES, 1)
    for part in filter(None, layout.replace(" ", "").split(",")):
        axis, _, size = part.partition("=")
        if axis not in sizes or not re.fullmatch(r"-1|[1-9]\d*", size):
            raise ConfigError(
                f"mesh: {layout!r} is not 'axis=size,...' with axes in {sharding_lib.MESH_AXES} and sizes >= 1 or -1"
            )
        sizes[axis] = int(size)
    return sizes


def with_mesh(config, layout: str):
    """A copy of `config` (a base_config ConfigDict) whose mesh is `layout` (`parse_mesh`)."""
    config = config.copy_and_resolve_references()
    config.mesh.update(parse_mesh(layout))
    return config


def compile_report(config, topology: str, programs: tuple[str, ...] = PROGRAMS) -> list[Row]:
    """Compiles `programs` of `config` (a base_config ConfigDict) for `topology`; one Row each."""
    unknown = set(programs) - set(PROGRAMS)
    if unknown:
        raise ConfigError(f"programs: {sorted(unknown)} not in {PROGRAMS}")
    devices = topology_devices(topology)
    built = built_lib.build(config, device_count=len(devices))
    hbm, peak = CHIPS[topology.split(":", 1)[0]]
    # With a sampler of its own (`mesh.rollout_devices`) the trainer's programs compile for the first
    # devices and the sampler for the last, as `overlap.meshes` splits them.
    cut = len(devices) - built.rollout_devices
    chips = (peak, cut)
    mesh = sharding_lib.make_mesh(**built.mesh.axes(), devices=devices[:cut])
    mesh_s = ("trainer " if cut < len(devices) else "") + _mesh_name(mesh)
    cfg = built.model
    graphdef, abstract = model_lib.abstract_model(cfg)
    param_sh = sharding_lib.param_shardings(mesh, abstract)
    params = sharding_lib.abstract(abstract, param_sh)
    progs = programs_lib.compile_programs(built, graphdef, params, mesh)
    B, P, C = built.batch_size, built.sampler.prompt_len, built.sampler.max_new_tokens
    T = P + C
    rows = []
    if "train_step" in programs:
        mb = B // built.train.minibatches
        state = programs_lib.abstract_train_state(progs, params)
        batch = sharding_lib.abstract(TrainBatch.abstract(built, mb, T), progs.batch_shardings)
        work = flops.train_flops(cfg, mb, T)
        if built.critic:  # PPO: the step updates the critic too
            work += flops.critic_train_flops(built.critic.model, mb, T)
        rows.append(
            _row("train_step", mesh_s, f"{mb} × {T}", progs.train_step.lower, (state, batch), hbm, work, *chips)
        )
    if "score" in programs:
        b2 = progs.batch_shardings.tokens
        tokens = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=b2)
        work = flops.forward_flops(cfg, B, T)
        rows.append(_row("score", mesh_s, f"{B} × {T}", progs.score.lower, (params, tokens, tokens), hbm, work, *chips))
    if "sample" in programs:
        shape, work = f"{B} × {P}+{C}", flops.sample_flops(cfg, B, P, C)
        if built.rollout_mesh is None:
            sampler = Sampler(graphdef, cfg, B, P, C, mesh=mesh, state=params)
            rows.append(_row("sample", mesh_s, shape, sampler.lower, (params,), hbm, work, *chips))
        else:
            smesh = sharding_lib.make_mesh(**built.rollout_mesh.axes(), devices=devices[cut:])
            sparams = sharding_lib.abstract(abstract, sharding_lib.param_shardings(smesh, abstract))
            sampler = Sampler(graphdef, cfg, B, P, C, mesh=smesh, state=sparams)
            kept = lora.split(sparams)[0] if built.plan.lora else sparams  # LoRA: the lag holds adapters
            lagged = built.rollout.staleness * _shard_bytes(kept)
            args = (hbm, work, peak, built.rollout_devices, lagged)
            rows.append(_row("sample", "sampler " + _mesh_name(smesh), shape, sampler.lower, (sparams,), *args))
    return rows


def _mesh_name(mesh) -> str:
    """The mesh's axes larger than 1, e.g. "fsdp=4×expert=8" ("1" for one device)."""
    return "×".join(f"{k}={v}" for k, v in mesh.shape.items() if v != 1) or "1"


def format_report(rows: list[Row], topology: str, microbatches: int, remat: str) -> str:
    """A Markdown table, one row per program (the format of docs/BENCHMARKS.md)."""
    gib = lambda b: f"{b / GIB:.2f}"
    lines = [
        "| topology | mesh | program | shape | micro-batches | remat | args GiB | out GiB | temp GiB | total GiB "
        "| HBM | fits | compile s | TFLOP/step | s at 40% MFU | XLA FLOPs × chips / analytic |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        fits = "yes" if r.fits else f"NO ({r.refused})" if r.refused else "NO"
        lines.append(
            f"| {topology} | {r.mesh} | {r.program} | {r.shape} | {microbatches if r.program == 'train_step' else '-'} "
            f"| {remat} | {gib(r.argument_bytes)} | {gib(r.output_bytes - r.alias_bytes)} | {gib(r.temp_bytes)} "
            f"| {gib(r.total_bytes)}{f' (lag {gib(r.resident_bytes)})' if r.resident_bytes else ''} "
            f"| {r.hbm_fraction:.0%} of {gib(r.hbm_bytes)} | {fits} "
            f"| {r.compile_seconds:.1f} | {r.flops / 1e12:.3g} | {r.seconds_at_mfu:.3g} "
            f"| {f'{r.xla_flops_per_chip * r.chips / r.flops:.2f}' if r.flops and r.xla_flops_per_chip else '-'} |"
        )
    return "\n".join(lines)

"""The machine a benchmark runs on: its float32 matmul peak (the denominator of every MFU), what it
is (CPU, cores, devices), and the refusal to measure programs compiled without optimizations."""

from __future__ import annotations

import argparse
import os
import platform
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks.run.timing import best_time


def peak(tiny: bool, repeats: int) -> dict:
    """Best float32 matmul FLOP/s over square shapes (two small ones for the smoke test, `tiny`)."""
    shapes = (128, 256) if tiny else (256, 512, 1024, 2048)
    out = {}
    for n in shapes:
        a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
        f = jax.jit(lambda x: x @ x)
        out[n] = 2 * n**3 / best_time(lambda f=f, a=a: f(a), repeats)
    return {"flops_per_s": max(out.values()), "by_shape": {str(k): v for k, v in out.items()}}


def machine() -> str:
    """What ran the benchmark: the CPU's model and vector ISA and the cores this process may use (the
    figures move with them: the hosts this project is lent differ from session to session), and JAX's
    devices."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    devices = f"{jax.device_count()} {jax.devices()[0].platform} device(s)"
    return f"{model} ({platform.machine()}{', ' + isa if isa else ''}, {cores} cores), {devices}"


def refuse_unoptimised(ap: argparse.ArgumentParser, tiny_flag: str) -> None:
    """Exit with a usage error if JAX_DISABLE_MOST_OPTIMIZATIONS (the test suite's setting) is on: every
    figure of a full-size run would be of programs compiled without LLVM's optimizations."""
    if jax.config.values["jax_disable_most_optimizations"]:
        ap.error(
            "JAX_DISABLE_MOST_OPTIMIZATIONS is on (the test suite's setting): the figures are of optimised "
            f"programs; unset it, or run {tiny_flag}"
        )

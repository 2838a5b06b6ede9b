"""The machine a benchmark runs on: its float32 matmul peak (the denominator of every MFU), what it
is (CPU, cores, devices), and the refusal to measure programs compiled without optimizations."""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
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


def accelerator_versions() -> dict:
    """The device, driver, CUDA and cuDNN versions JAX reports (on a GPU), and jax/jaxlib's."""
    import jaxlib

    out = dict(device=jax.devices()[0].device_kind, backend=jax.default_backend(), jaxlib=jaxlib.__version__)
    try:
        from jax._src.lib import cuda_versions

        if cuda_versions is not None:
            out["cuda_runtime"] = cuda_versions.cuda_runtime_get_version()
            out["cuda_driver"] = cuda_versions.cuda_driver_get_version()
            out["cudnn"] = cuda_versions.cudnn_get_version()
    except Exception as e:  # another backend, or a jaxlib without these helpers: recorded, not fatal
        out["versions_error"] = f"{type(e).__name__}: {e}"
    try:  # the driver's own version string (JAX reports the CUDA API version it supports)
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        out["nvidia_driver"] = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def git_describe() -> str:
    """The commit this tree is at, "+ changes" when it has uncommitted ones; "" without git."""
    try:
        git = ["git", "--no-optional-locks"]  # reads only: no index refresh
        root = Path(__file__).resolve().parents[2]
        run = lambda *a: subprocess.run([*git, *a], capture_output=True, text=True, timeout=30, cwd=root)
        head = run("rev-parse", "HEAD").stdout.strip()
        dirty = run("status", "--porcelain", "--untracked-files=no").stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return f"{head} + changes" if head and dirty else head

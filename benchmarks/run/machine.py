"""The machine a benchmark runs on: its float32 matmul peak (the denominator of every MFU), its
accelerator's versions, and the refusal to measure programs compiled without optimizations. What it is
(CPU, cores, devices) and the code's commit: `gspo_jax.provenance`, which every run records too."""

from __future__ import annotations

import argparse
import subprocess

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

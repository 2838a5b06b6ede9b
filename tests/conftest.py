"""Test set-up: a fake 8-device CPU platform, configured before JAX is imported."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (must come after XLA_FLAGS)
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# CI explores the same examples every run (reproducible); local runs keep drawing new ones.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
    """Runs a test once with the function as is and once under `jax.jit`."""

    def wrap(fn, **jit_kwargs):
        return jax.jit(fn, **jit_kwargs) if request.param else fn

    return wrap


_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles = [0]


def _on_event(name, *args, **kwargs):
    if name == _COMPILE_EVENT:
        _compiles[0] += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


class CompileCounter:
    """Counts XLA backend compiles (jax.monitoring events) since `reset()`."""

    def reset(self):
        self._start = _compiles[0]

    @property
    def count(self) -> int:
        return _compiles[0] - self._start


@pytest.fixture
def compile_counter():
    counter = CompileCounter()
    counter.reset()
    return counter

"""The mesh's typed section (`config.mesh`) and its checks at build: axis sizes against the devices
present, the data axes against every batch they split, and the split of the devices between the trainer
and a sampler of its own (`mesh.rollout_devices`, `gspo_jax/overlap.py`)."""

from __future__ import annotations

import dataclasses
import math

import jax

from gspo_jax.validation import ConfigError, check, is_int


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """`config.mesh`: each axis's size; in the config -1 for the devices left, which `build` resolves
    against the devices (a built config's mesh has every size)."""

    data: int
    fsdp: int
    expert: int
    tensor: int

    def axes(self) -> dict[str, int]:
        """The sizes as `sharding.make_mesh`'s keyword arguments."""
        return dataclasses.asdict(self)

    @property
    def data_size(self) -> int:
        """How many devices a batch is split over: data × fsdp × expert (`sharding.DATA_AXES`)."""
        return self.data * self.fsdp * self.expert


def check_split(rollout_devices, devices: int, processes: int, staleness: int, lora: bool) -> None:
    """`mesh.rollout_devices`: a sampler mesh of its own leaves the trainer at least one device, and
    only pays when the two overlap (`rollout.staleness` >= 1)."""
    key, n = "mesh.rollout_devices", rollout_devices
    check(is_int(n) and 0 <= n < devices, "config", key, n, f"an int in [0, {devices}): the trainer keeps a device")
    if not n:
        return
    check(staleness >= 1, "config", key, n, "0 with rollout.staleness=0 (the sampler and trainer could never overlap)")
    if processes > 1:  # a split over hosts (`hosts.py`): whole processes each side, one layout
        why = "0 with LoRA on several processes (the sampler's copy of the base is made on one host only)"
        check(not lora, "config", key, n, why)
        per = devices // processes
        check(
            2 * n == devices,
            "config",
            key,
            n,
            f"{devices // 2} on {processes} processes (the two meshes share one layout)",
        )
        check(
            n % per == 0, "config", key, n, f"a multiple of the {per} devices a process holds (whole hosts each side)"
        )
        check(gloo_splits(), "config", key, n, "0 on several CPU processes before jax 0.12 (" + GLOO_HANG + ")")


# Measured (2 CPU processes × 2 devices, gloo): with jax 0.10.2 and 0.11.0 two processes running collectives
# on their own meshes at once both hang; with 0.12.0.1 they run.
GLOO_HANG = "gloo hangs two processes running collectives on disjoint meshes at once"


def gloo_splits() -> bool:
    """Whether JAX's CPU collectives let two meshes on disjoint processes run at once (jax >= 0.12; an
    accelerator's collectives are not gloo's)."""
    if jax.default_backend() != "cpu":
        return True
    return tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 12)


def check_mesh(
    mesh: MeshConfig,
    *,
    split: dict[str, int],
    sampler_threads: int = 1,
    devices: int,
    processes: int = 1,
    num_experts: dict[str, int],
    name: str = "mesh",
) -> MeshConfig:
    """Axis sizes against the devices present (on several processes the mesh must cover them all), and
    the data axes against every batch they split; returns the mesh with -1 resolved. `name`: its keys'."""
    sizes = mesh.axes()
    for k, v in sizes.items():
        check(is_int(v) and (v >= 1 or v == -1), "config", f"{name}.{k}", v, "an int >= 1, or -1 for the devices left")
    check(list(sizes.values()).count(-1) <= 1, "config", name, dict(sizes), "at most one axis may be -1")
    n = devices
    known = math.prod(v for v in sizes.values() if v != -1)
    check(
        known <= n and (-1 not in sizes.values() or n % known == 0),
        "config",
        name,
        dict(sizes),
        f"there are {n} devices" + (" for it" if name != "mesh" else ""),
    )
    sizes = {k: (n // known if v == -1 else v) for k, v in sizes.items()}
    on = math.prod(sizes.values())
    allowed = f"1 on a mesh of {on} devices (threads split the batch on one device)"
    check(sampler_threads <= 1 or on == 1, "config", "rollout.sampler_threads", sampler_threads, allowed)
    data = MeshConfig(**sizes).data_size
    for what, size in split.items():
        check(size % data == 0, "config", name, dict(sizes), f"data×fsdp×expert={data} must divide {what}={size}")
    for key, n in num_experts.items():  # expert parallelism gives each expert shard E / expert of them
        if sizes["expert"] > 1:
            check(
                n % sizes["expert"] == 0,
                "config",
                f"{name}.expert",
                sizes["expert"],
                f"a divisor of {key}.num_experts={n}",
            )
    if processes > 1 and on != devices:
        raise ConfigError(
            f"config.mesh: {mesh.axes()} covers {on} of the {devices} devices of "
            f"{processes} processes; a multi-process mesh must use them all (set one axis to -1)"
        )
    return MeshConfig(**sizes)

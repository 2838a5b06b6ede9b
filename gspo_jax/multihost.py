"""JAX's multi-controller runtime: one process per host, each holding its share of global arrays.

A batch sharded over the mesh's data axes lives on every process's devices; each process owns the
rows its devices hold (`local_rows`). Host work per row (tokenising prompts, decoding completions,
scoring them) is done by the owning process only; per-row results that every process needs (rewards,
lengths) are gathered (`gather_rows`), so every process computes the same advantages and metrics.
With one process every function here is the obvious identity.
"""

from __future__ import annotations

import functools
import logging

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

log = logging.getLogger(__name__)


def initialize(coordinator_address: str | None = None, num_processes: int | None = None, process_id: int | None = None):
    """`jax.distributed.initialize`; with no arguments JAX finds the coordinator itself (TPU VM / pod
    slice, SLURM, ...). CPU processes talk over gloo, so the same code runs as several local processes."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
    log.info("process %d of %d, %d local devices", jax.process_index(), jax.process_count(), jax.local_device_count())


def local_rows(sharding: NamedSharding | None, n: int) -> np.ndarray:
    """Sorted global indices of the rows (dim 0 of an [n, ...] array) that this process's devices hold."""
    if sharding is None or jax.process_count() == 1:
        return np.arange(n)
    rows = set()
    for index in sharding.addressable_devices_indices_map((n,)).values():
        rows.update(range(n)[index[0]])
    return np.array(sorted(rows), dtype=np.int64)


def put_rows(local: np.ndarray, rows: np.ndarray, sharding: NamedSharding | None, n: int) -> jax.Array | np.ndarray:
    """The global [n, ...] array on `sharding` whose rows `rows` are `local` (this process's share)."""
    if sharding is None:
        return local
    local = np.asarray(local)
    shape = (n, *local.shape[1:])

    def piece(index):
        wanted = np.arange(n)[index[0]]
        return local[np.searchsorted(rows, wanted)][(slice(None), *index[1:])]

    return jax.make_array_from_callback(shape, sharding, piece)


def to_local(x, rows: np.ndarray) -> np.ndarray:
    """This process's rows `rows` of a global array, as one host array in `rows`' order."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)[rows]
    out = np.empty((len(rows), *x.shape[1:]), x.dtype)
    for shard in x.addressable_shards:
        held = np.arange(x.shape[0])[shard.index[0]]
        out[np.searchsorted(rows, held)] = np.asarray(shard.data)
    return out


def gather_rows(local: np.ndarray, rows: np.ndarray, n: int, sharding: NamedSharding | None = None) -> np.ndarray:
    """The whole [n, ...] host array on every process, from each process's rows (small arrays only:
    rewards, lengths, flags). With `sharding` (the rows' own, `local_rows`') on a mesh of only some of
    the processes (a sampler's of its own, `hosts.py`), on those processes: gathered on that mesh."""
    local = np.asarray(local)
    some = sharding is not None and len({d.process_index for d in sharding.mesh.devices.flat}) < jax.process_count()
    if jax.process_count() == 1 or (some and len(rows) == n):
        out = np.empty((n, *local.shape[1:]), local.dtype)
        out[rows] = local
        return out
    if some:
        spread = put_rows(local, rows, NamedSharding(sharding.mesh, PartitionSpec(sharding.spec[0])), n)
        whole = _replicate(spread, NamedSharding(sharding.mesh, PartitionSpec()))
        return np.asarray(whole.addressable_shards[0].data)
    values = multihost_utils.process_allgather(local)  # [processes, rows per process, ...]
    indices = multihost_utils.process_allgather(np.asarray(rows))
    out = np.empty((n, *local.shape[1:]), local.dtype)
    out[indices.reshape(-1)] = values.reshape(-1, *local.shape[1:])
    return out


def _replicate(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    return _identity(sharding)(x)


@functools.cache
def _identity(sharding: NamedSharding):
    """One compiled identity per target sharding (an all-gather when it replicates)."""
    return jax.jit(lambda v: v, out_shardings=sharding)


def replicated(x, mesh) -> jax.Array:
    """`x` (the same value on every process: a host array, a PRNG key) replicated over `mesh`."""
    sharding = NamedSharding(mesh, PartitionSpec())
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        # A typed key cannot be placed on other processes' devices; its raw data can.
        data = jax.device_put(np.asarray(jax.random.key_data(x)), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    return jax.device_put(np.asarray(x), sharding)


def any_process(flag: bool) -> bool:
    """Whether `flag` is set on any process (e.g. a SIGTERM that reached only some hosts)."""
    if jax.process_count() == 1:
        return bool(flag)
    return bool(np.any(multihost_utils.process_allgather(np.asarray(flag, np.int32))))

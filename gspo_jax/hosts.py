"""A sampler mesh and a trainer mesh on disjoint hosts (`mesh.rollout_devices` on several processes).

Every process runs the same loop; each runs only the programs of the mesh its devices are in (a
process holding none of a program's devices dispatches nothing), so while the sampler's hosts draw the
next rollout the trainer's update the policy. What crosses between the two goes two ways:

- arrays (the policy to the sampler, the batch to the trainer) by `Bridge.move`: one program over both
  meshes' devices whose only op is a `ppermute` from one mesh's devices to the other's, so the two
  meshes must have one layout (the same axes, devices and shardings). Every process calls it, in the
  same order: it is where the two sides meet;
- host values (rewards, the rollout's metrics, the prompt stream's position, evaluation samples) by
  `Channel`: pickled into JAX's distributed key-value store by one process of the side that has
  them, read by the other side's processes.

With one process, `overlap.py` moves arrays with `jax.device_put` and none of this is used."""

from __future__ import annotations

import pickle
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

ROLE = "role"  # the global mesh's leading axis: 0 the trainer's devices, 1 the sampler's
TIMEOUT_MS = 30 * 60 * 1000  # how long a side waits for the other's host values (a rollout, an evaluation)


def processes(mesh: Mesh) -> list[int]:
    """The processes whose devices `mesh` holds, sorted."""
    return sorted({d.process_index for d in mesh.devices.flat})


def holds(mesh: Mesh) -> bool:
    """Whether this process holds any of `mesh`'s devices (it runs that mesh's programs)."""
    return jax.process_index() in processes(mesh)


def split(trainer: Mesh, sampler: Mesh) -> bool:
    """Whether the two meshes are on disjoint processes: a split over hosts, this module's case."""
    return not set(processes(trainer)) & set(processes(sampler))


class Bridge:
    """Moves arrays between two meshes of one layout on disjoint processes (see the module docstring):
    `move(tree, shardings)` takes each leaf, an array on one mesh (or, on the processes that do not hold
    it, its shape, dtype and sharding), to the same spec on the other. One compile per tree structure and
    direction; every process calls `move` with the same trees in the same order."""

    def __init__(self, trainer: Mesh, sampler: Mesh):
        if trainer.devices.shape != sampler.devices.shape or trainer.axis_names != sampler.axis_names:
            raise ValueError(
                f"a split over hosts needs the two meshes of one layout: trainer {dict(trainer.shape)}, "
                f"sampler {dict(sampler.shape)}"
            )
        self.meshes = (trainer, sampler)
        self.both = Mesh(np.stack([trainer.devices, sampler.devices]), (ROLE, *trainer.axis_names))
        self._programs: dict[Any, Any] = {}

    def move(self, tree, shardings):
        """`tree`'s leaves on `shardings` (a tree like it, or one sharding for all), all on the other mesh."""
        leaves, treedef = jax.tree.flatten(tree)
        dst = _broadcast(shardings, treedef, len(leaves))
        if not leaves:
            return tree
        src = self._side(leaves[0].sharding.mesh)
        if any(self._side(x.sharding.mesh) != src for x in leaves) or any(self._side(s.mesh) != 1 - src for s in dst):
            raise ValueError("Bridge.move: every leaf must go from one of the two meshes to the other")
        specs = tuple(_spec(x.sharding.spec, x.ndim) for x in leaves)
        for x, s, spec in zip(leaves, dst, specs):
            if _spec(s.spec, x.ndim) != spec:
                raise ValueError(
                    f"Bridge.move: a leaf goes from spec {spec} to {s.spec}; the two sides share one layout"
                )
        stacked = [self._stack(x, spec, src) for x, spec in zip(leaves, specs)]
        key = (src, specs, tuple((x.shape, jnp.dtype(x.dtype)) for x in leaves))
        if key not in self._programs:
            self._programs[key] = self._program(src, specs)
        # Done before anything else runs: a gloo context being set up for this program while another
        # (orbax's barrier) sets up its own timed out in a first save.
        moved = jax.block_until_ready(self._programs[key](*stacked))
        out = [self._unstack(y, s, x.dtype) for y, s, x in zip(moved, dst, leaves)]
        return jax.tree.unflatten(treedef, out)

    def mirror(self, tree):
        """`tree` (leaves on either mesh) with each leaf on both meshes, replicated over them: what every
        process can save (orbax writes the arrays each process holds; a split's are on one side each)."""
        leaves, treedef = jax.tree.flatten(tree)
        sides = [self._side(x.sharding.mesh) for x in leaves]
        other = [None] * len(leaves)
        for side in (0, 1):  # one move per side: its leaves to the other mesh, like laid out
            picked = [i for i, s in enumerate(sides) if s == side]
            to = [NamedSharding(self.meshes[1 - side], leaves[i].sharding.spec) for i in picked]
            for i, y in zip(picked, self.move([leaves[i] for i in picked], to)):
                other[i] = y
        out = [self._join(x, y) for x, y in zip(leaves, other)]
        return jax.tree.unflatten(treedef, out)

    def _join(self, x: jax.Array, y: jax.Array) -> jax.Array:
        sharding = NamedSharding(self.both, _spec(x.sharding.spec, x.ndim))
        shards = [s.data for s in x.addressable_shards] + [s.data for s in y.addressable_shards]
        return jax.make_array_from_single_device_arrays(x.shape, sharding, shards, dtype=x.dtype)

    def widen(self, abstract):
        """An abstract tree (leaves with shardings on either mesh) as `mirror` lays it out: to restore into."""
        widen = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(self.both, x.sharding.spec))
        return jax.tree.map(widen, abstract)

    def narrow(self, tree, abstract):
        """Arrays laid out by `mirror` (a restored checkpoint's) back on `abstract`'s shardings, each
        from the shards already on that mesh's devices: nothing moves."""

        def narrow(z, x):
            held = set(x.sharding.mesh.devices.flat)
            shards = [s.data for s in z.addressable_shards if s.device in held]
            return jax.make_array_from_single_device_arrays(z.shape, x.sharding, shards, dtype=z.dtype)

        return jax.tree.map(narrow, tree, abstract)

    def _side(self, mesh: Mesh) -> int:
        for i, m in enumerate(self.meshes):
            if mesh.devices.shape == m.devices.shape and np.array_equal(mesh.devices, m.devices):
                return i
        raise ValueError(f"Bridge.move: a leaf on a mesh that is neither side's: {dict(mesh.shape)}")

    def _stack(self, x, spec: PartitionSpec, src: int) -> jax.Array:
        """[2, *x.shape] on both meshes: `x`'s shards at index `src`, zeros of their shape at the other."""
        sharding = NamedSharding(self.both, PartitionSpec(ROLE, *spec))
        shape = (2, *x.shape)
        mine = {s.device: s.data for s in x.addressable_shards} if isinstance(x, jax.Array) else {}
        shards = []
        for device, index in sharding.addressable_devices_indices_map(shape).items():
            if device in mine:
                shards.append(jax.device_put(mine[device][None], device))
            else:
                piece = [1] + [len(range(*i.indices(n))) for i, n in zip(index[1:], x.shape)]
                shards.append(jax.device_put(np.zeros(piece, x.dtype), device))
        return jax.make_array_from_single_device_arrays(shape, sharding, shards, dtype=x.dtype)

    def _program(self, src: int, specs):
        specs = tuple(PartitionSpec(ROLE, *s) for s in specs)
        permute = lambda *xs: tuple(jax.lax.ppermute(x, ROLE, [(src, 1 - src)]) for x in xs)
        return jax.jit(jax.shard_map(permute, mesh=self.both, in_specs=specs, out_specs=specs))

    @staticmethod
    def _unstack(y: jax.Array, sharding: NamedSharding, dtype) -> jax.Array:
        held = set(sharding.mesh.devices.flat)
        shards = [s.data.reshape(s.data.shape[1:]) for s in y.addressable_shards if s.device in held]
        return jax.make_array_from_single_device_arrays(y.shape[1:], sharding, shards, dtype=dtype)


def _broadcast(shardings, treedef, n: int) -> list:
    if isinstance(shardings, jax.sharding.Sharding):
        return [shardings] * n
    return treedef.flatten_up_to(shardings)


def _spec(spec: PartitionSpec, ndim: int) -> PartitionSpec:
    """`spec` padded with None to `ndim` entries: the same layout written either way compares equal."""
    return PartitionSpec(*spec, *([None] * (ndim - len(spec))))


class Channel:
    """Host values from one side's lead process to the other side's processes, through JAX's distributed
    key-value store (`jax.distributed.initialize`'s coordinator). Messages are numbered in the order the
    loop sends them (the same on every process); a sender deletes its message two back, which every
    reader has taken by then (the loop meets in `Bridge.move` in between)."""

    def __init__(self, name: str):
        from jax._src import distributed  # the runtime's client: JAX has no public key-value API

        self._client, self._name, self._sent, self._read = distributed.global_state.client, name, 0, 0

    def send(self, value) -> None:
        """Publishes `value` (picklable): called by the sending side's lead process only."""
        self._client.key_value_set_bytes(self._key(self._sent), pickle.dumps(value))
        if self._sent >= 2:
            self._client.key_value_delete(self._key(self._sent - 2))
        self._sent += 1

    def skip(self) -> None:
        """Counts a message this process's side sends but this process does not (not the lead)."""
        self._sent += 1

    def recv(self):
        """The next message, waiting for it."""
        value = pickle.loads(self._client.blocking_key_value_get_bytes(self._key(self._read), TIMEOUT_MS))
        self._read += 1
        return value

    def _key(self, n: int) -> str:
        return f"gspo_jax/{self._name}/{n}"

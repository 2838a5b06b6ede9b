"""Logical-axis sharding: one rules table maps parameter and activation axis names onto a
("data", "fsdp", "expert", "tensor") mesh; helpers give `NamedSharding`s for
params, optimizer state, batches (each field by the one batch field table, `BATCH_FIELDS`) and the KV
cache, for `jax.jit` in/out shardings, and sharding constraints for activations inside a program traced
`under_mesh`.

Every parameter is an `nnx.Param` whose `out_sharding` metadata holds its logical
axis names (see `param`); nothing here knows the model's structure.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "expert", "tensor")
# The mesh axes that split a batch. Outside the MoE block the expert axis carries data too: its
# devices hold different sequences, not copies of the same attention.
DATA_AXES = ("data", "fsdp", "expert")

# Logical axis names a parameter (or activation) dimension may carry.
LOGICAL_AXES = (
    "batch",
    "embed",
    "vocab",
    "heads",
    "kv_heads",
    "head_dim",
    "mlp",
    "expert",
    "layers",
    "norm",
    "cache_seq",
    "lora",
)

# The one rules table: logical axis -> mesh axis (or tuple of mesh axes, or None).
RULES: tuple[tuple[str, Any], ...] = (
    ("batch", DATA_AXES),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("expert", "expert"),
    ("layers", None),
    ("norm", None),
    ("cache_seq", None),
    # A low-rank adapter's rank (`gspo_jax/lora.py`), split over fsdp where it divides: an adapter whose
    # other axes are not (B [E, R, F] of an expert) would otherwise sit whole on every chip, with its
    # gradient and moments (Qwen3-30B-A3B's rank-32 train step on v6e-8: 116% of HBM replicated, 87% split).
    ("lora", "fsdp"),
)


def param(
    rngs: nnx.Rngs,
    init: Callable,
    shape: Sequence[int],
    axes: Sequence[str | None],
    dtype: Any,
    kind: type[nnx.Param] = nnx.Param,
    stream: str = "params",
) -> nnx.Param:
    """An `nnx.Param` (or subclass `kind`, e.g. `nnx.LoRAParam`) initialised by `init` with a key of
    `rngs`' `stream` and annotated with logical `axes`.

    Eager sharding is off so a model can be built without a mesh; shardings are
    applied later from the annotations (`param_shardings`).
    """
    shape, axes = tuple(shape), tuple(axes)
    if len(shape) != len(axes):
        raise ValueError(f"param: {len(axes)} axis names {axes} for shape {shape}")
    unknown = [a for a in axes if a is not None and a not in LOGICAL_AXES]
    if unknown:
        raise ValueError(f"param: unknown logical axes {unknown}; allowed {LOGICAL_AXES}")
    return kind(init(getattr(rngs, stream)(), shape, dtype), out_sharding=axes, eager_sharding=False)


def mesh_from_config(
    data: int, fsdp: int, expert: int, tensor: int, devices=None, rollout_devices: int = 0, rollout=None
) -> Mesh:
    """`make_mesh` where one axis may be -1: it takes whatever devices the others leave. Given a whole
    `config.mesh` section (`**config.mesh`), the trainer's mesh: with `rollout_devices` the last ones
    are the sampler's (`overlap.meshes`; its axes, `rollout`, are not read here)."""
    del rollout
    devices = list(jax.devices() if devices is None else devices)
    devices = devices[: len(devices) - rollout_devices]
    sizes = dict(data=data, fsdp=fsdp, expert=expert, tensor=tensor)
    known = math.prod(v for v in sizes.values() if v != -1)
    sizes = {k: (len(devices) // max(known, 1) if v == -1 else v) for k, v in sizes.items()}
    return make_mesh(**sizes, devices=devices)


def warn_idle_devices(mesh: Mesh, also: Mesh | None = None) -> list:
    """Logs one warning line naming this process's devices that `mesh` (and `also`, a second mesh of
    the run's) leaves idle (a mesh smaller than the machine runs, but on part of it); returns them."""
    used = set(mesh.devices.flat) | (set() if also is None else set(also.devices.flat))
    idle = [d for d in jax.local_devices() if d not in used]
    if idle:
        names = [f"{d.platform}:{d.id}" for d in idle]
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        log.warning(
            "the mesh %s uses %d of this process's %d devices; idle: %s (set a mesh axis to -1 to use them all)",
            dict(mesh.shape),
            len(used),
            len(jax.local_devices()),
            shown,
        )
    return idle


def make_mesh(data: int = 1, fsdp: int = 1, expert: int = 1, tensor: int = 1, devices=None) -> Mesh:
    """A 4-axis ("data","fsdp","expert","tensor") mesh over the first data*fsdp*expert*tensor devices."""
    sizes = (data, fsdp, expert, tensor)
    if any(int(s) < 1 for s in sizes):
        raise ValueError(f"make_mesh: axis sizes must be >= 1, got {dict(zip(MESH_AXES, sizes))}")
    devices = list(jax.devices() if devices is None else devices)
    n = math.prod(sizes)
    if n > len(devices):
        raise ValueError(f"make_mesh: mesh {dict(zip(MESH_AXES, sizes))} needs {n} devices, have {len(devices)}")
    grid = np.asarray(devices[:n], dtype=object).reshape(sizes)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _as_tuple(axes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def logical_to_spec(
    names: Sequence[str | None],
    rules: Sequence[tuple[str, Any]] = RULES,
    shape: Sequence[int] | None = None,
    mesh: Mesh | None = None,
) -> P:
    """PartitionSpec for logical axis `names` under `rules`.

    A mesh axis already used by an earlier dimension is dropped; with `shape` and
    `mesh` given, so is one whose size does not divide what is left of the dimension.
    """
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for i, name in enumerate(names):
        kept = []
        left = None if shape is None else int(shape[i])
        for ax in _as_tuple(table.get(name) if name is not None else None):
            if ax in used:
                continue
            if mesh is not None and left is not None:
                size = mesh.shape[ax]
                if left % size:
                    continue
                left //= size
            kept.append(ax)
            used.add(ax)
        spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return P(*spec)


def is_variable(x) -> bool:
    """`is_leaf` for trees of NNX Variables (params, their shardings)."""
    return isinstance(x, nnx.Variable)


def path_key(path) -> tuple[str | int, ...]:
    """A tree key path as plain names and indices, e.g. ('layers', 0, 'mlp', 'router'); a trailing
    'value' (how some trees wrap a Variable's array) is dropped so every tree of one model agrees."""
    keys = tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)
    return keys[:-1] if keys and keys[-1] == "value" else keys


def logical_axes(state) -> Any:
    """The state's tree with each Variable's value replaced by its logical axis names."""
    return jax.tree.map(
        lambda v: v.replace(tuple(v.get_metadata().get("out_sharding") or ())),
        state,
        is_leaf=is_variable,
    )


def param_shardings(mesh: Mesh, abstract_state, rules: Sequence[tuple[str, Any]] = RULES):
    """`NamedSharding`s matching an (abstract) NNX state, from its logical annotations.

    Returns the same tree as `abstract_state` (Variables holding shardings), usable
    as `jax.jit` in/out shardings or with `jax.device_put`; an unannotated Variable
    is replicated.
    """

    def one(v):
        names = v.get_metadata().get("out_sharding") or (None,) * len(v.get_value().shape)
        return v.replace(NamedSharding(mesh, logical_to_spec(names, rules, v.get_value().shape, mesh)))

    return jax.tree.map(one, abstract_state, is_leaf=is_variable)


def _fits(s: NamedSharding, shape: tuple[int, ...]) -> bool:
    """Whether sharding `s` is valid for an array of `shape` (same rank, divisible dims)."""
    if len(s.spec) != len(shape):
        return False
    return all(d % math.prod(s.mesh.shape[a] for a in _as_tuple(ax)) == 0 for d, ax in zip(shape, s.spec))


def opt_state_shardings(mesh: Mesh, opt_state_abstract, param_shardings_tree):
    """Shardings for an optax state: a leaf whose key path ends with a parameter's path
    and a shape that sharding fits is sharded like it (moments); anything else
    (step counts, scalars, factored statistics of another rank) is replicated.

    Matching by path suffix works whether params are an `nnx.State` or a pure dict.
    """
    by_path: dict[tuple[str, ...], NamedSharding] = {}
    for path, s in jax.tree_util.tree_flatten_with_path(param_shardings_tree)[0]:
        by_path[tuple(map(str, path_key(path)))] = s
    replicated = NamedSharding(mesh, P())

    def one(path, leaf):
        keys = tuple(map(str, path_key(path)))
        shape = tuple(getattr(leaf, "shape", ()))
        for i in range(len(keys)):
            s = by_path.get(keys[i:])
            if s is not None:
                return s if _fits(s, shape) else replicated
        return replicated

    return jax.tree_util.tree_map_with_path(one, opt_state_abstract)


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Leading (batch) dimension over every data axis (`DATA_AXES`); the rest replicated.
    `built.build` checks that their product divides every batch a run splits."""
    return NamedSharding(mesh, P(DATA_AXES, *([None] * (ndim - 1))))


# Every batch array, by the one name it has from the sampler (`sampler.SampleOutput`) through the
# rollout (`rollout.RolloutBatch`) to the trainer's batch (`train.TrainBatch`) and the loss: its dtype
# and axes (the letters of `gspo_jax/__init__.py`). Each of the three places its fields by this table
# (`field_shardings`); the trainer's batch takes its shapes and placeholders from it too.
BATCH_FIELDS: dict[str, tuple[Any, str]] = dict(
    tokens=(np.int32, "BT"),
    positions=(np.int32, "BT"),  # -1 on padding
    prompt_mask=(np.bool_, "BT"),  # real prompt tokens
    completion_mask=(np.bool_, "BT"),  # generated tokens up to and including EOS
    loss_mask=(np.float32, "BT"),  # completion tokens that train (fill / filtered ones do not)
    sampler_logp=(np.float32, "BT"),  # π_sampler: what the sampler reported for its tokens
    old_logp=(np.float32, "BT"),  # π_old: the ratio's denominator (the trainer's or the sampler's, by mode)
    ref_logp=(np.float32, "BT"),  # π_ref
    values=(np.float32, "BT"),  # the critic's V(s_t) at the rollout
    returns=(np.float32, "BT"),  # GAE's returns, the value targets
    topk=(np.int32, "BLTK"),  # router choices: the sampler's, and in the trainer's batch π_old's
    gates=(np.float32, "BLTK"),  # the sampler's combine weights of its `topk` (R3W)
    old_router_logp=(np.float32, "BLTK"),  # π_old's router log-probs at `topk` (RSPO)
    lengths=(np.int32, "B"),  # completion tokens, EOS included
    truncated=(np.bool_, "B"),  # no EOS within the completion positions
    rewards=(np.float32, "B"),
    advantages=(np.float32, "B"),  # group-relative; a critic's (GAE) are per token, "BT"
    group_ids=(np.int32, "B"),  # the prompt each completion answers
)


def field_sharding(mesh: Mesh, name: str, table: Mapping[str, tuple[Any, str]] = BATCH_FIELDS) -> NamedSharding:
    """Batch field `name` on `mesh`, by its axes in `table` (`BATCH_FIELDS`, or a batch's own version of
    it): rows over the data axes (`batch_sharding`), the rest replicated."""
    return batch_sharding(mesh, len(table[name][1]))


def field_shardings(
    mesh: Mesh, names: Iterable[str], table: Mapping[str, tuple[Any, str]] = BATCH_FIELDS
) -> dict[str, NamedSharding]:
    """`field_sharding` of each of `names`, by name."""
    return {k: field_sharding(mesh, k, table) for k in names}


def abstract(tree, shardings: Any = None):
    """`tree`'s arrays (or shapes) as ShapeDtypeStructs placed by `shardings`: a tree like `tree`, one
    sharding for every leaf, or None for each array's own. What `.lower` and orbax's restore take."""
    if shardings is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), tree)
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), tree, shardings)


def data_size(mesh) -> int:
    """How many ways a batch is split: the product of the data axes' sizes."""
    return math.prod(mesh.shape[a] for a in DATA_AXES)


def constrain(x: jax.Array, names: Sequence[str | None], rules: Sequence[tuple[str, Any]] = RULES) -> jax.Array:
    """`x` constrained to the sharding of its logical axis `names` on the mesh the program is traced
    under (`under_mesh`); unchanged when there is none. Mesh axes that do not divide a dimension are
    left out, so one call serves every shape."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(names, rules, x.shape, mesh))


_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar("gspo_jax_platform", default=None)


def platform() -> str:
    """The platform the program being traced runs on: its mesh's devices' under `under_mesh` (so a
    deviceless TPU compile on a CPU host says "tpu"), else JAX's default backend."""
    return _PLATFORM.get() or jax.default_backend()


@functools.cache
def under_mesh(fn: Callable, mesh: Mesh) -> Callable:
    """`fn` traced with `mesh` as the context mesh, so `constrain` and the expert-parallel MoE see it,
    and with the mesh's platform as `platform()`. Jit the result with in/out shardings on the same
    mesh. Cached, so equal (fn, mesh) pairs give the same function and share a jit's compilations."""
    device_platform = mesh.devices.flat[0].platform

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        token = _PLATFORM.set(device_platform)
        try:
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                return fn(*args, **kwargs)
        finally:
            _PLATFORM.reset(token)

    if isinstance(fn, functools.partial):  # `wraps` finds no name on a partial: name the program by its function
        traced.__name__ = traced.__qualname__ = getattr(fn.func, "__name__", "traced")
    return traced


def cache_shardings(mesh: Mesh, cache, rules: Sequence[tuple[str, Any]] = RULES):
    """Shardings for a `model.KVCache`: batch over the data axes, kv heads over "tensor"."""
    kv = ("batch", "kv_heads", "cache_seq", "head_dim")  # each layer's

    def ns(names, x):
        return NamedSharding(mesh, logical_to_spec(names, rules, x.shape, mesh))

    return type(cache)(
        k=tuple(ns(kv, x) for x in cache.k),
        v=tuple(ns(kv, x) for x in cache.v),
        positions=ns(("batch", "cache_seq"), cache.positions),
        index=NamedSharding(mesh, P()),
    )

"""The optimizer of a run (RL updates and the supervised warm start alike): AdamW on a linear-warmup,
cosine-decay schedule, after optional global-norm clipping, with the MoE router optionally frozen; and
its state, initialised on the mesh. The schedule's numbers are arrays given to each update (`Schedule`),
not constants compiled into it: runs that differ only in learning rate or length share one program."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gspo_jax import sharding as sharding_lib
from gspo_jax.validation import check, check_int, check_number


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """Hashable (a static jit argument); `from_config` picks its fields out of a config section."""

    learning_rate: float
    warmup_steps: int = 0
    end_lr_factor: float = 0.1  # the cosine decays to end_lr_factor × learning_rate
    weight_decay: float = 0.0
    max_grad_norm: float = 0.0  # 0: no clipping
    b1: float = 0.9
    b2: float = 0.999
    # The MoE router's weights (`moe.MoE.router`) out of the update: no gradient step, no weight decay
    # (`frozen_router`). The RL setting of NeMo-RL (`freeze_moe_router`); `config.train` only.
    freeze_router: bool = False
    owner: str = dataclasses.field(default="OptimizerConfig", compare=False, repr=False)  # for error messages

    def __post_init__(self):
        own = self.owner
        check_number(own, "learning_rate", self.learning_rate, low=0.0, strict=True)
        check_int(own, "warmup_steps", self.warmup_steps, low=0)
        check_number(own, "end_lr_factor", self.end_lr_factor, low=0.0)
        check_number(own, "weight_decay", self.weight_decay, low=0.0)
        check_number(own, "max_grad_norm", self.max_grad_norm, low=0.0)
        for f in ("b1", "b2"):
            v = getattr(self, f)
            check_number(own, f, v, low=0.0)
            check(v < 1, own, f, v, "it must be in [0, 1)")
        check(isinstance(self.freeze_router, bool), own, "freeze_router", self.freeze_router, "True or False")

    @classmethod
    def from_config(cls, section: Mapping, owner: str) -> OptimizerConfig:
        names = [f.name for f in dataclasses.fields(cls) if f.name != "owner"]
        return cls(**{k: section[k] for k in names if k in section}, owner=owner)

    @property
    def rule(self) -> AdamW:
        """The update rule without the schedule: what a compiled step depends on."""
        return AdamW(self.weight_decay, self.max_grad_norm, self.b1, self.b2, self.freeze_router)

    def schedule(self, total_steps: int) -> Schedule:
        """The schedule's numbers over `total_steps` updates: linear warmup from 0 over `warmup_steps`
        (at least 1), then cosine decay to `end_lr_factor` × `learning_rate` at `total_steps` (at least
        one update past the warmup), as `optax.warmup_cosine_decay_schedule` has them."""
        warmup = max(self.warmup_steps, 1)
        decay = max(total_steps, warmup + 1) - warmup
        peak = self.learning_rate
        alpha = self.learning_rate * self.end_lr_factor / peak  # optax's end_value / peak_value
        f32, i32 = np.float32, np.int32
        inverse = lambda n: f32(1) / f32(n)  # in float32, as XLA inverts a constant divisor
        return Schedule(
            f32(peak),
            f32(0.0 - peak),
            i32(warmup),
            inverse(warmup),
            i32(decay),
            inverse(decay),
            f32(alpha),
            f32(1 - alpha),
        )


@dataclasses.dataclass(frozen=True)
class AdamW:
    """AdamW's update rule less its schedule: the static part of a step (hashable), so steps whose
    optimizers differ only in learning rate or schedule length compile once."""

    weight_decay: float = 0.0
    max_grad_norm: float = 0.0  # 0: no clipping
    b1: float = 0.9
    b2: float = 0.999
    freeze_router: bool = False


class Schedule(NamedTuple):
    """A warmup-cosine schedule's numbers, as float32 / int32 scalars (a program's argument): its peak,
    0 − peak (the warmup's start less its end), the warmup's and the decay's updates and their
    float32 inverses, and the decay's floor α as a fraction of the peak and 1 − α."""

    peak: np.ndarray
    start_less_peak: np.ndarray
    warmup: np.ndarray
    inverse_warmup: np.ndarray
    decay: np.ndarray
    inverse_decay: np.ndarray
    alpha: np.ndarray
    one_less_alpha: np.ndarray


def learning_rate(s: Schedule, count: jax.Array) -> jax.Array:
    """The learning rate at update `count` (0-based, a scalar): what XLA computes for
    `optax.warmup_cosine_decay_schedule` with the same numbers as constants. That is optax's
    arithmetic op for op, except that XLA turns its divisions by a constant number of updates into
    multiplications by the constant's float32 inverse, so these are multiplications too: bit for bit
    on an XLA that compiles the rest as written (jax 0.12's), within float32 rounding of the peak on
    one that also folds constant products (jax 0.10's)."""
    warm = s.start_less_peak * (1 - jnp.clip(count, 0, s.warmup) * s.inverse_warmup) + s.peak
    after = jnp.minimum(count - s.warmup, s.decay)
    cosine = 0.5 * (1 + jnp.cos(jnp.pi * after * s.inverse_decay))
    return jnp.where(count < s.warmup, warm, s.peak * (s.one_less_alpha * cosine + s.alpha))


def clip_by_global_norm(max_norm: float, given_norm: bool = True) -> optax.GradientTransformationExtraArgs:
    """Global-norm clipping with optax's (empty) state, as one scalar factor min(1, max_norm / ‖g‖)
    multiplied in (PyTorch's `clip_grad_norm_` form): unclipped gradients pass bit for bit, clipped
    ones within an ulp of optax's `(g / ‖g‖) · max_norm`. A per-element divide is what XLA:CPU will
    not fuse into both moments' updates, so it wrote every clipped gradient out and read it back; a
    multiply by a scalar it fuses. Takes the norm as `grad_norm=` when the caller has it already (the
    train step computes it for its metrics): no second pass over the gradients. With `given_norm`
    False it computes its own (a frozen router's gradients, zeroed before it, must not count)."""

    def update(updates, state, params=None, *, grad_norm=None, **extra_args):
        del params, extra_args
        norm = optax.tree.norm(updates) if grad_norm is None or not given_norm else grad_norm
        factor = jnp.minimum(1.0, max_norm / norm)  # exactly 1 below the bound; NaN or 0 if norm is not finite
        return jax.tree.map(lambda t: t * factor.astype(t.dtype), updates), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


ROUTER = "router"  # the MoE router's parameter name (`moe.MoE.router`)


def is_router(path) -> bool:
    """Whether a parameter tree's key path leads to an MoE router's weights (any layer, scanned or not)."""
    keys = sharding_lib.path_key(path)
    return bool(keys) and keys[-1] == ROUTER


def router_leaves(params) -> list[jax.Array]:
    """The MoE routers' weights of `params`, in tree order (empty for a dense model)."""
    return [x for path, x in jax.tree_util.tree_flatten_with_path(params)[0] if is_router(path)]


@jax.jit
def distance(a, b) -> jax.Array:
    """‖a − b‖₂ over two trees of one structure: how far an iteration moved some parameters."""
    return optax.tree.norm(jax.tree.map(jnp.subtract, a, b))


def frozen_router() -> optax.GradientTransformation:
    """Sets the routers' leaves of the updates to −0.0 (stateless): x + (−0.0) is x for every float x,
    −0.0 included, so a frozen router's weights come out of `optax.apply_updates` bit for bit."""

    def update(updates, state, params=None):
        del params
        freeze = lambda path, u: jnp.full_like(u, -0.0) if is_router(path) else u
        return jax.tree_util.tree_map_with_path(freeze, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def scheduled_adamw(rule: AdamW) -> optax.GradientTransformationExtraArgs:
    """optax's AdamW whose learning rate comes with each update (`tx.update(..., schedule=Schedule)`):
    optax's own transformation, built per update around the given numbers, so its state and its
    arithmetic are optax's."""
    make = lambda lr: optax.adamw(lr, b1=rule.b1, b2=rule.b2, weight_decay=rule.weight_decay)

    def update(updates, state, params=None, *, schedule: Schedule, **extra_args):
        del extra_args
        return make(functools.partial(learning_rate, schedule)).update(updates, state, params)

    return optax.GradientTransformationExtraArgs(make(lambda count: 0.0).init, update)


@functools.cache
def make_optimizer(rule: AdamW) -> optax.GradientTransformationExtraArgs:
    """AdamW on the schedule each update is given (`schedule=`, a `Schedule`). With `freeze_router`
    the routers' gradients are zeroed first (out of the clipping norm, their moments stay 0) and their
    updates last (AdamW's weight decay moves a weight even at gradient 0).

    Cached: equal rules give the same (stateless) transformation, so functions jitted with it as a
    static argument compile once per process."""
    adamw = scheduled_adamw(rule)
    if rule.freeze_router:
        clip = [clip_by_global_norm(rule.max_grad_norm, given_norm=False)] if rule.max_grad_norm > 0 else []
        return optax.chain(frozen_router(), *clip, adamw, frozen_router())
    if rule.max_grad_norm > 0:
        return optax.chain(clip_by_global_norm(rule.max_grad_norm), adamw)
    return adamw


def state_shardings(tx: optax.GradientTransformation, params, param_shardings, mesh):
    """Shardings of `tx`'s state: moments sharded like their parameters, counters replicated."""
    return sharding_lib.opt_state_shardings(mesh, jax.eval_shape(tx.init, params), param_shardings)


def init_state(tx: optax.GradientTransformation, params, param_shardings, shardings):
    """`tx`'s state for `params`, created directly in `shardings` (no host or single-device copy)."""
    return jax.jit(tx.init, in_shardings=(param_shardings,), out_shardings=shardings)(params)


def all_finite(*trees) -> jax.Array:
    """True iff every element of every floating-point leaf is finite. Per leaf as isfinite(sum(x · 0)):
    x · 0 is NaN exactly where x is NaN or infinite, and a sum propagates NaN on every code path (a
    max does not: XLA:CPU's vectorised max can drop it). XLA:CPU compiles that float reduction
    several times faster than an `all` over booleans."""
    leaves = [x for t in trees for x in jax.tree.leaves(t) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return functools.reduce(jnp.logical_and, [jnp.isfinite(jnp.sum(x * 0)) for x in leaves], True)


def _finite_per_parameter(params, opt_state) -> jax.Array:
    """`all_finite(params, opt_state)` as one boolean reduction per parameter over it and its moments
    (the subtrees of `opt_state` shaped like `params`): XLA fuses the update into it, so it reads each
    input once and writes one boolean per element at most (XLA:CPU splits a large leaf's reduction
    into a written mask, a reduce-window and a reduce). (A float sum here, like `all_finite`'s, becomes
    a YNNPACK fusion that first writes every broadcast scalar out as a full array: the update 3× slower
    on `bench`.)"""
    treedef = jax.tree.structure(params)
    like = lambda x: jax.tree.structure(x) == treedef
    subtrees = [t for t in jax.tree.leaves(opt_state, is_leaf=like) if like(t)]
    rest = [t for t in jax.tree.leaves(opt_state, is_leaf=like) if not like(t)]  # counters
    groups = zip(*(jax.tree.leaves(t) for t in (params, *subtrees)))
    finite = [
        functools.reduce(jnp.logical_and, map(jnp.isfinite, g))
        for g in groups
        if jnp.issubdtype(g[0].dtype, jnp.inexact)
    ]
    return functools.reduce(jnp.logical_and, map(jnp.all, finite), all_finite(rest))


def apply_if_finite(
    tx: optax.GradientTransformationExtraArgs, schedule: Schedule, grads, grad_norm, opt_state, params, ok=True
):
    """(params, opt_state, applied): `tx`'s update on `schedule` applied if `ok`, `grad_norm` and
    everything the update would write (parameters and optimizer state) are finite; else the old state,
    unchanged.

    Two passes over the state instead of about four: a read-only one computes the would-be state and
    reduces it to the check (the barrier keeps XLA from sharing those values with the update's, which
    would write them all out to read them back), then a conditional computes the update again and
    writes it in place over the (donated) old state. `grad_norm` is handed to the clipping."""

    def update(p, o, g, norm):
        updates, o = tx.update(g, o, p, grad_norm=norm, schedule=schedule)
        return optax.apply_updates(p, updates), o

    args = (params, opt_state, grads, grad_norm)
    ok = ok & jnp.isfinite(grad_norm) & _finite_per_parameter(*update(*jax.lax.optimization_barrier(args)))
    params, opt_state = jax.lax.cond(ok, lambda a: update(*a), lambda a: a[:2], args)
    return params, opt_state, ok

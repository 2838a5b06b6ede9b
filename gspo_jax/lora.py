"""Low-rank adapters (LoRA) on a frozen base: `LoraConfig` (the `config.lora` section), and the split of
a policy's parameters into its trainable adapters and its frozen base.

Each adapted weight W (a projection of attention, the dense MLP, every expert of an MoE layer, or the
router) gets a pair A [in, r], B [r, out] of float32 `nnx.LoRAParam`s, B zero-initialised, so the
adapted weight W + (α/r)·A·B equals W at step 0 and the policy starts as the base exactly. The forward
never merges them: it adds (α/r)·(x·A)·B to x·W, for routed tokens only on the experts.

A weight named `w` gets its pair as a sibling module `w_lora` (`Adapter`, holding `a` and `b`), built
with the weight's own logical axes and the replicated "lora" axis for the rank, so it is stacked over
layers and sharded like its weight. `merged` folds every pair into its weight: the reference tests hold
the unmerged forward to. Shape letters: `gspo_jax/__init__.py` (R the rank).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from gspo_jax import sharding
from gspo_jax.validation import ConfigError, check, check_int, check_number

TARGETS = ("attention", "mlp", "experts", "router")
DEFAULT_TARGETS = ("attention", "mlp", "experts")  # the router frozen (its routing is what the study measures)
BASE_DTYPES = ("", "float32", "bfloat16")  # "": the model's own param_dtype


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """`config.lora`: rank (0 = off: the full model trains, nothing changes), α, which weights get
    adapters, and the frozen base's storage dtype."""

    rank: int = 0
    alpha: float = 32.0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    base_dtype: str = ""

    def __post_init__(self):
        # "attention,mlp" from the command line arrives as the string or as a tuple holding it
        targets = (self.targets,) if isinstance(self.targets, str) else self.targets
        split = [t.split(",") if isinstance(t, str) else [t] for t in targets]
        object.__setattr__(self, "targets", tuple(t.strip() if isinstance(t, str) else t for ts in split for t in ts))
        own = "config"
        check_int(own, "lora.rank", self.rank, low=0)
        check_number(own, "lora.alpha", self.alpha, low=0.0, strict=True)
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
            raise ConfigError(
                f"config.lora.targets={self.targets!r}: not allowed; allowed: a non-empty tuple of distinct "
                f"names from {TARGETS}"
            )
        check(self.base_dtype in BASE_DTYPES, own, "lora.base_dtype", self.base_dtype, f"one of {BASE_DTYPES}")

    @property
    def on(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        """α / r, the factor on A·B."""
        return self.alpha / self.rank if self.rank else 0.0

    def adapts(self, target: str) -> bool:
        """Whether `target` (one of `TARGETS`) gets adapters."""
        return self.on and target in self.targets


def split(state: nnx.State) -> tuple[nnx.State, nnx.State]:
    """(adapters, base) of a policy's parameters: the `nnx.LoRAParam`s, and everything else."""
    adapters, base = nnx.split_state(state, nnx.LoRAParam, ...)
    return adapters, base


def union(base: nnx.State, adapters: nnx.State) -> nnx.State:
    """The whole policy from its frozen base and its adapters (no array is copied)."""
    return nnx.merge_state(base, adapters)


OFF = LoraConfig()  # LoRA off: the default wherever a module takes a `LoraConfig`


def check_targets(lora: LoraConfig, has_moe: bool, owner: str = "config") -> None:
    """Refuses a target the model cannot have: "experts" or "router" without an MoE layer."""
    allowed = TARGETS if has_moe else tuple(t for t in TARGETS if t not in ("experts", "router"))
    bad = [t for t in lora.targets if t not in allowed]
    if lora.on and bad:
        raise ConfigError(
            f"{owner}.lora.targets={lora.targets!r} is not allowed; {bad[0]!r} needs an MoE layer and the model has "
            f"none: choose from {allowed}"
        )


LORA_AXIS = "lora"  # the rank's logical axis (`sharding.RULES`: replicated)


class Adapter(nnx.Module):
    """The low-rank pair of one weight of shape [*ins, *outs] (`experts` > 0: [E, *ins, *outs], one pair
    per expert): A [(E,) *ins, R] drawn normal with std 1/√(prod ins) (fan-in, like PEFT's kaiming-uniform
    bound 1/√in), B [(E,) R, *outs] zeros, both float32 `nnx.LoRAParam`s with the weight's logical axes.
    A's key comes from the `lora` stream of `rngs` where it has one, so the base's draws stay those of
    the model without adapters."""

    def __init__(
        self,
        lora: LoraConfig,
        ins: tuple[int, ...],
        in_axes: tuple[str, ...],
        outs: tuple[int, ...],
        out_axes: tuple[str, ...],
        *,
        experts: int = 0,
        rngs: nnx.Rngs,
    ):
        r, n_in = lora.rank, len(ins)
        lead, lead_axes = ((experts,), ("expert",)) if experts else ((), ())
        init_a = nnx.initializers.variance_scaling(
            1.0,
            "fan_in",
            "normal",
            in_axis=tuple(range(-n_in - 1, -1)),
            out_axis=-1,
            batch_axis=tuple(range(len(lead))),
        )
        stream = "lora" if "lora" in rngs else "params"
        self.scale = lora.scale
        self.a = sharding.param(
            rngs, init_a, (*lead, *ins, r), (*lead_axes, *in_axes, LORA_AXIS), jnp.float32, nnx.LoRAParam, stream
        )
        self.b = sharding.param(
            rngs,
            nnx.initializers.zeros,
            (*lead, r, *outs),
            (*lead_axes, LORA_AXIS, *out_axes),
            jnp.float32,
            nnx.LoRAParam,
            stream,
        )

    def scaled_b(self) -> jax.Array:
        """(α/r)·B, float32: the scale folded into B (what the experts' `dispatch.ExpertAdapters` take)."""
        return self.scale * self.b[...]

    def __call__(self, x: jax.Array, dtype=None, precision=None) -> jax.Array:
        """(α/r)·(x·A)·B, contracting x's trailing `ins` axes, in `dtype` (default: x's)."""
        dtype = x.dtype if dtype is None else dtype
        a, b = self.a[...].astype(dtype), self.scaled_b().astype(dtype)
        xa = jnp.tensordot(x.astype(dtype), a, axes=a.ndim - 1, precision=precision)
        return jnp.tensordot(xa, b, axes=1, precision=precision)


def delta(a: jax.Array, b: jax.Array, lead: int, scale: float) -> jax.Array:
    """scale·A·B in float32 as a weight [*lead, *ins, *outs], from A [*lead, *ins, R] and B [*lead, R,
    *outs] (`lead`: how many leading batch axes, layers and experts, they share)."""
    ins, outs = a.shape[lead:-1], b.shape[lead + 1 :]
    a_LIR = a.astype(jnp.float32).reshape(*a.shape[:lead], math.prod(ins), a.shape[-1])
    b_LRO = b.astype(jnp.float32).reshape(*b.shape[: lead + 1], math.prod(outs))
    ab_LIO = jnp.matmul(a_LIR, b_LRO, precision=jax.lax.Precision.HIGHEST)
    return scale * ab_LIO.reshape(*a.shape[:lead], *ins, *outs)


def merged(cfg, state: nnx.State):
    """(the model config with LoRA off, its state): every adapted weight W replaced by W + (α/r)·A·B (per
    expert for the experts), the adapters dropped. The reference for tests: the adapted forward of
    (cfg, state) equals the plain forward of the merged pair up to float rounding."""
    adapters, base = split(state)
    weights = dict(nnx.to_flat_state(base))
    pairs: dict[tuple, dict[str, nnx.Variable]] = {}
    for path, v in nnx.to_flat_state(adapters):
        pairs.setdefault(tuple(path[:-1]), {})[path[-1]] = v
    for path, ab in pairs.items():
        *parent, name = path
        key = (*parent, name.removesuffix("_lora"))
        b_axes = tuple(ab["b"].get_metadata().get("out_sharding") or ())
        d = delta(ab["a"].get_value(), ab["b"].get_value(), b_axes.index(LORA_AXIS), cfg.lora.scale)
        w = weights[key].get_value()
        weights[key] = weights[key].replace((w.astype(jnp.float32) + d).astype(w.dtype))  # a new Variable
    return dataclasses.replace(cfg, lora=LoraConfig()), nnx.from_flat_state(weights)

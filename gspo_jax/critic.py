"""PPO's critic: a scalar value head on a decoder trunk, GAE advantages from it, and its clipped update.

The trunk is a copy of the policy's, initialised from the warm-started policy as RLHF PPO usually does
(`trunk="policy"`), or a separate model of its own config, randomly initialised (`trunk="separate"`,
e.g. fewer layers). Values are aligned like log-probs (`gspo_jax/__init__.py`): `values_BT[b, t]` is
V(s_t), the expected return just before token t is generated, read from the hidden state at t − 1;
position 0 gets 0. The critic has its own parameters and optimizer and trains inside the policy's jitted
`train.train_step`, on the same micro-batches (`update`). Formulas: docs/ALGORITHMS.md, "PPO".
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from gspo_jax import advantages as adv_lib
from gspo_jax import compiles, sharding
from gspo_jax import metrics as metrics_lib
from gspo_jax import model as model_lib
from gspo_jax import optimizer as optimizer_lib
from gspo_jax.metrics import Count, Max, Mean, Min
from gspo_jax.model_config import ModelConfig
from gspo_jax.validation import check, check_choice, check_number

Array = jax.Array
TRUNKS = ("policy", "separate")


@dataclasses.dataclass(frozen=True)
class CriticConfig:
    """The critic and the advantage estimator it feeds (hashable: a static jit argument)."""

    trunk: str = "policy"  # TRUNKS: a copy of the policy's trunk, or a separate model (`model`)
    model: ModelConfig | None = None  # the trunk's architecture (`built.build` resolves it)
    gamma: float = 1.0  # discount
    lam: float = 0.95  # GAE's λ
    kl_reward_coef: float = 0.0  # β of the per-token penalty −β·(log π_old − log π_ref) folded into the reward
    value_clip: float = 0.2  # the value loss's clip range around the rollout's values; 0: unclipped
    whiten_advantages: bool = True  # over the batch's loss tokens

    def __post_init__(self):
        own = "config.critic"
        check_choice(own, "trunk", self.trunk, TRUNKS)
        for f in ("gamma", "lam"):
            check_number(own, f, getattr(self, f), low=0.0, high=1.0)
        check_number(own, "kl_reward_coef", self.kl_reward_coef, low=0.0)
        check_number(own, "value_clip", self.value_clip, low=0.0)
        check(isinstance(self.whiten_advantages, bool), own, "whiten_advantages", self.whiten_advantages, "a bool")


class Critic(nnx.Module):
    """A decoder trunk (no LM head) and a linear value head on its final hidden states. The head starts
    at zero, so the first values are 0 and the first update moves the head alone."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.trunk = model_lib.Transformer(dataclasses.replace(cfg, tie_embeddings=True), rngs=rngs)  # no lm_head
        zeros = nnx.initializers.zeros
        self.value_head = sharding.param(rngs, zeros, (cfg.embed_dim,), ("embed",), jnp.float32)
        self.value_bias = sharding.param(rngs, zeros, (), (), jnp.float32)

    def __call__(self, tokens_BT: Array, positions_BT: Array) -> tuple[Array, model_lib.ModelAux]:
        """float32 values [B, T] aligned to token positions, and the trunk's `ModelAux`."""
        x_BTD, aux = self.trunk.hidden(tokens_BT, positions_BT)
        v_BT = jnp.einsum("btd,d->bt", x_BTD.astype(jnp.float32), self.value_head[...]) + self.value_bias[...]
        return jnp.pad(v_BT[:, :-1], ((0, 0), (1, 0))), aux  # V(s_t) is read at t − 1


@struct.dataclass
class CriticState:
    step: Array  # int32: critic updates applied (a skipped update does not count)
    params: nnx.State
    opt_state: optax.OptState


@dataclasses.dataclass(frozen=True)
class CriticStep:
    """The static part of the critic's update (hashable, part of `train.StepConfig`)."""

    graphdef: nnx.GraphDef
    optimizer: optimizer_lib.AdamW  # its schedule is an argument of the step (`train.Schedules`)
    value_clip: float


def abstract(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, abstract state) of `Critic(cfg)`, allocating nothing."""
    return nnx.split(nnx.eval_shape(lambda: Critic(cfg, rngs=nnx.Rngs(0))))


def _random_state(cfg: ModelConfig, seed: Array) -> nnx.State:
    return nnx.split(Critic(cfg, rngs=nnx.Rngs(jax.random.key(seed))))[1]


def _from_policy(cfg: ModelConfig, policy_params: nnx.State) -> nnx.State:
    critic = Critic(cfg, rngs=nnx.Rngs(0))  # its random trunk is overwritten: dead code to XLA
    nnx.update(critic.trunk, nnx.State({k: v for k, v in policy_params.items() if k != "lm_head"}))
    return nnx.split(critic)[1]


def init_params(cfg: CriticConfig, policy_params: nnx.State, seed: int, shardings) -> nnx.State:
    """The critic's parameters in `shardings`: the policy's trunk (`trunk="policy"`, a copy: the policy
    trains on) and a zero head, or a random model from `seed` (`trunk="separate"`). One program per config."""
    if cfg.trunk == "policy":
        return jax.jit(_from_policy, static_argnums=0, out_shardings=shardings)(cfg.model, policy_params)
    build = jax.jit(
        _random_state, static_argnums=0, out_shardings=shardings, compiler_options=compiles.run_once_options()
    )
    return build(cfg.model, jnp.int32(seed))


def values(graphdef: nnx.GraphDef, params: nnx.State, tokens_BT: Array, positions_BT: Array) -> Array:
    """The critic's values [B, T] of a batch, in `ModelConfig.batch_chunks` chunks of it."""
    critic = nnx.merge(graphdef, params)
    one = lambda tokens, positions: critic(tokens, positions)[0]
    return model_lib.in_batch_chunks(one, critic.trunk.cfg.batch_chunks, tokens_BT, positions_BT)


def estimate(
    cfg: CriticConfig,
    graphdef: nnx.GraphDef,
    params: nnx.State,
    tokens_BT: Array,
    positions_BT: Array,
    mask_BT: Array,
    rewards_B: Array,
    old_logp_BT: Array,
    ref_logp_BT: Array,
) -> tuple[Array, Array, Array, dict[str, Array]]:
    """PPO's advantages for a rollout: the critic's values, token rewards (the sequence reward at the last
    loss token, minus the KL penalty when `kl_reward_coef` > 0), GAE, whitening. Returns (advantages,
    values, returns, metrics), all [B, T] float32 and 0 off the mask; the metrics describe the raw
    advantages and how well the values predicted the returns."""
    m = mask_BT > 0
    v_BT = jnp.where(m, values(graphdef, params, tokens_BT, positions_BT), 0.0)
    kl_BT = old_logp_BT - ref_logp_BT if cfg.kl_reward_coef > 0 else None
    r_BT = adv_lib.token_rewards(rewards_B, m, kl_BT, cfg.kl_reward_coef)
    adv_BT, ret_BT = adv_lib.gae(r_BT, v_BT, m, cfg.gamma, cfg.lam)
    n = jnp.maximum(jnp.sum(m), 1)
    mean = lambda x: jnp.sum(jnp.where(m, x, 0.0)) / n
    metrics = dict(
        advantage_mean=mean(adv_BT),
        advantage_std=jnp.sqrt(mean(jnp.square(adv_BT - mean(adv_BT)))),
        advantage_min=jnp.min(jnp.where(m, adv_BT, jnp.inf)),
        advantage_max=jnp.max(jnp.where(m, adv_BT, -jnp.inf)),
        value_mean=mean(v_BT),
        return_mean=mean(ret_BT),
        explained_variance=adv_lib.explained_variance(v_BT, ret_BT, m),
    )
    if cfg.whiten_advantages:
        adv_BT = adv_lib.whiten(adv_BT, m)
    return adv_BT, v_BT, ret_BT, metrics


def value_loss(
    values_BT: Array, old_values_BT: Array, returns_BT: Array, mask_BT: Array, clip: float, denominator: Array
) -> tuple[Array, dict[str, Mean]]:
    """PPO's clipped value loss, ½·Σ max((V − G)², (V_old + clip(V − V_old, ±clip) − G)²) / denominator
    over the loss tokens (the pessimistic of the two, as in PPO2; `clip` 0: plain squared error).
    `denominator` is the minibatch's loss-token count, so micro-batches add up."""
    m = mask_BT > 0
    v, old, g = (x.astype(jnp.float32) for x in (values_BT, old_values_BT, returns_BT))
    se = jnp.square(v - g)
    if clip > 0:
        se_clipped = jnp.square(old + jnp.clip(v - old, -clip, clip) - g)
        clipped = m & (se_clipped > se)
        se = jnp.maximum(se, se_clipped)
    else:
        clipped = jnp.zeros_like(m)
    total = 0.5 * jnp.sum(jnp.where(m, se, 0.0))
    count = jnp.sum(m).astype(jnp.float32)
    return total / denominator, dict(
        value_loss=Mean(total, count),
        value_clip_frac=Mean(jnp.sum(clipped).astype(jnp.float32), count),
        value_error_abs_max=Max(jnp.max(jnp.where(m, jnp.abs(v - g), -jnp.inf)), count),
        value_error_abs_min=Min(jnp.min(jnp.where(m, jnp.abs(v - g), jnp.inf)), count),
    )


def update(static: CriticStep, schedule: optimizer_lib.Schedule, state: CriticState, micro) -> tuple[CriticState, dict]:
    """One critic update on a minibatch given as micro-batches (`micro`: batch fields stacked [M, ...]
    with `tokens`, `positions`, `loss_mask`, `values` and `returns`), with its own optimizer on
    `schedule`; skipped (state unchanged, counted in `critic_skipped`) if anything it would write is
    not finite."""
    tx = optimizer_lib.make_optimizer(static.optimizer)
    M = micro.tokens.shape[0]
    denominator = jnp.maximum(jnp.sum(micro.loss_mask > 0), 1).astype(jnp.float32)

    def loss_fn(params, mb):
        critic = nnx.merge(static.graphdef, params)
        v_BT, aux = critic(mb.tokens, mb.positions)
        loss, metrics = value_loss(v_BT, mb.values, mb.returns, mb.loss_mask, static.value_clip, denominator)
        return loss + aux.aux_loss / M, metrics

    def accumulate(grads, mb):
        (_, metrics), g = jax.value_and_grad(loss_fn, has_aux=True)(state.params, mb)
        return jax.tree.map(jnp.add, grads, g), metrics

    grads, stacked = jax.lax.scan(accumulate, jax.tree.map(jnp.zeros_like, state.params), micro)
    metrics = metrics_lib.reduce(stacked)
    grad_norm = optax.tree.norm(grads)
    params, opt_state, ok = optimizer_lib.apply_if_finite(tx, schedule, grads, grad_norm, state.opt_state, state.params)
    state = CriticState(step=state.step + ok.astype(jnp.int32), params=params, opt_state=opt_state)
    metrics.update(critic_grad_norm=Mean(grad_norm, 1), critic_skipped=Count((~ok).astype(jnp.float32)))
    return state, metrics


def init_state(
    cfg: CriticConfig, static: CriticStep, shardings: CriticState, seed: int, policy_params: nnx.State
) -> CriticState:
    """A fresh critic state in `shardings` (parameters from `init_params`)."""
    params = init_params(cfg, policy_params, seed, shardings.params)
    tx = optimizer_lib.make_optimizer(static.optimizer)
    opt_state = optimizer_lib.init_state(tx, params, shardings.params, shardings.opt_state)
    return jax.device_put(CriticState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state), shardings)


def state_shardings(static: CriticStep, abstract_params: nnx.State, mesh) -> CriticState:
    """Where the critic's state lives: parameters by the rules table, moments like them."""
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    param_sh = sharding.param_shardings(mesh, abstract_params)
    tx = optimizer_lib.make_optimizer(static.optimizer)
    return CriticState(
        step=rep, params=param_sh, opt_state=optimizer_lib.state_shardings(tx, abstract_params, param_sh, mesh)
    )


def with_advantages(cfg: CriticConfig, graphdef: nnx.GraphDef, critic_params: nnx.State, batch, rewards_B: Array):
    """`batch` (a `train.TrainBatch`) with PPO's GAE advantages, the critic's values and the returns
    (`estimate`), and the estimate's metrics."""
    args = (batch.tokens, batch.positions, batch.loss_mask, rewards_B, batch.old_logp, batch.ref_logp)
    adv_BT, v_BT, ret_BT, metrics = estimate(cfg, graphdef, critic_params, *args)
    return batch.replace(advantages=adv_BT, values=v_BT, returns=ret_BT), metrics

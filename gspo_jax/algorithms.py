"""One home per algorithm: everything that makes GRPO GRPO, DAPO DAPO, and so on.

An `Algorithm` is its policy loss (`losses.LossConfig`: ratio × gate × aggregation, KL), how its
advantages are scaled, and what it changes in the rollout (DAPO's dynamic sampling and overlong
shaping). `configs/<name>.py` builds an experiment from `ALGORITHMS[name]`; nothing else in the
package knows an algorithm by name. Formulas: docs/ALGORITHMS.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

from gspo_jax.losses import LossConfig
from gspo_jax.validation import check_choice


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """An RL algorithm as this project implements it: critic-free, or PPO with its critic."""

    name: str
    title: str  # what it is, in one line
    paper: str  # where its values come from
    loss: LossConfig
    advantage_scale: str = "group"  # advantages.SCALES: divide by the group's std, the batch's, or not at all
    rollout: Mapping[str, object] = dataclasses.field(default_factory=dict)  # RolloutConfig fields it sets
    critic: bool = False  # a learned value model and GAE advantages (`gspo_jax/critic.py`) instead of groups

    def __post_init__(self):
        object.__setattr__(self, "rollout", MappingProxyType(dict(self.rollout)))

    def loss_config(self, max_new_tokens: int) -> LossConfig:
        """The loss for completions of at most `max_new_tokens`: Dr.GRPO divides token sums by that
        length (its constant T_max), so the constant follows the run's generation budget."""
        if self.loss.aggregation == "seq_mean_token_sum_norm":
            return dataclasses.replace(self.loss, sum_norm_len=float(max_new_tokens))
        return self.loss


ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm(
            name="grpo",
            title="GRPO: token ratios, symmetric PPO clip, per-sequence token mean, KL to the reference",
            paper="DeepSeekMath (Shao et al., 2024): eps 0.2, beta 0.04 with the k3 estimator",
            loss=LossConfig(eps_low=0.2, eps_high=0.2, aggregation="seq_mean_token_mean", kl_coef=0.04),
        ),
        Algorithm(
            name="dapo",
            title="DAPO: clip-higher, token-level mean, dynamic sampling, overlong reward shaping, no KL",
            paper="DAPO (Yu et al., 2025): eps_low 0.2, eps_high 0.28; drop all-equal groups and resample",
            loss=LossConfig(eps_low=0.2, eps_high=0.28, aggregation="token_mean"),
            # Soft overlong punishment over the last 4 tokens of the (short) default budget; truncated
            # completions stay in the loss (`rollout.overlong_filter=True` drops them instead).
            rollout=dict(
                dynamic_sampling=True,
                max_rounds=3,
                overlong_filter=False,
                overlong_cache_len=4,
                overlong_factor=1.0,
            ),
        ),
        Algorithm(
            name="gspo",
            title="GSPO: one length-normalised sequence ratio per completion, clipped per sequence",
            paper="GSPO (Zheng et al., 2025): eps_low 3e-4, eps_high 4e-4",
            loss=LossConfig(ratio="sequence", eps_low=3e-4, eps_high=4e-4, aggregation="sequence"),
        ),
        Algorithm(
            name="gspo_token",
            title="GSPO-token: GSPO's sequence ratio with per-token gradients (equals GSPO for one A per sequence)",
            paper="GSPO (Zheng et al., 2025), section on GSPO-token",
            loss=LossConfig(ratio="sequence_token", eps_low=3e-4, eps_high=4e-4, aggregation="seq_mean_token_mean"),
        ),
        Algorithm(
            name="dr_grpo",
            title="Dr.GRPO: GRPO without std scaling, token sums divided by the max completion length",
            paper="Understanding R1-Zero-Like Training (Liu et al., 2025)",
            # sum_norm_len is replaced by max_new_tokens (`loss_config`); 1024 stands for "the budget".
            loss=LossConfig(aggregation="seq_mean_token_sum_norm", sum_norm_len=1024.0),
            advantage_scale="none",
        ),
        Algorithm(
            name="gmpo",
            title="GMPO: geometric mean of token ratios, each clipped in log space on the side sign(A) selects",
            paper="Geometric-Mean Policy Optimization (Zhao et al., 2025): log-space range (-0.4, 0.4)",
            loss=LossConfig(ratio="geometric", eps_low=0.4, eps_high=0.4, aggregation="sequence"),
        ),
        Algorithm(
            name="cispo",
            title="CISPO: REINFORCE weighted by a clipped, stop-gradient token ratio; no token loses its gradient",
            paper="MiniMax-M1 (2025): only the upper bound is tuned; eps_low 1 (no lower bound), eps_high 0.2",
            loss=LossConfig(gate="cispo", eps_low=1.0, eps_high=0.2, aggregation="token_mean"),
        ),
        Algorithm(
            name="sapo",
            title="SAPO: a soft sigmoid gate instead of a hard clip, sharper for negative advantages",
            paper="Soft Adaptive Policy Optimization (Qwen, 2025): tau_pos 1.0, tau_neg 1.05",
            loss=LossConfig(gate="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05),
        ),
        Algorithm(
            name="vespo",
            title="VESPO: REINFORCE weighted by a gamma kernel of the unnormalised sequence ratio; no hard clip",
            paper="VESPO (Shen et al., 2026) and TRL's `vespo` loss: k, lambda = 2, 3 for A >= 0; 3, 2 for A < 0",
            loss=LossConfig(
                ratio="sequence_sum_token",
                gate="vespo",
                aggregation="token_mean",
                vespo_k_pos=2.0,
                vespo_lambda_pos=3.0,
                vespo_k_neg=3.0,
                vespo_lambda_neg=2.0,
            ),
        ),
        Algorithm(
            name="ppo",
            title="PPO: a learned critic, GAE token advantages (whitened), token ratios under the symmetric clip",
            paper="PPO (Schulman et al., 2017) as RLHF runs it (Ouyang et al., 2022; verl, TRL): eps 0.2, "
            "value clip 0.2, gamma 1, lambda 0.95",
            loss=LossConfig(eps_low=0.2, eps_high=0.2, aggregation="token_mean"),
            advantage_scale="none",  # the group advantages are replaced by GAE's
            critic=True,
        ),
        Algorithm(
            name="gspo_sum",
            title="GSPO without the 1/|o|: the product of the token ratios, clipped per sequence (VESPO's ablation)",
            paper="GSPO (Zheng et al., 2025) with its ranges eps_low 3e-4, eps_high 4e-4; critique from VESPO",
            loss=LossConfig(ratio="sequence_sum", eps_low=3e-4, eps_high=4e-4, aggregation="sequence"),
        ),
    )
}


def get(name: str) -> Algorithm:
    """`ALGORITHMS[name]`, or a one-line error naming the allowed names."""
    check_choice("config", "algorithm", name, tuple(ALGORITHMS))
    return ALGORITHMS[name]

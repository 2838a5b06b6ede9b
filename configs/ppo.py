r"""PPO with a learned critic (Schulman et al., 2017, as RLHF runs it: Ouyang et al., 2022; verl, TRL).

The baseline every critic-free method is measured against. A value model — a scalar head on a copy of
the warm-started policy's trunk, with its own parameters and optimizer — predicts each token's return;
advantages are GAE over the completion tokens (γ = 1, λ = 0.95; the reward at the last token, with an
optional per-token KL penalty −β·(log π_old − log π_ref) folded in), whitened over the batch's loss
tokens; the returns are the value targets of a clipped value loss (range 0.2). The policy loss is
PPO's: per-token ratios under the symmetric clip ε = 0.2, averaged over all loss tokens. The same
rollouts as the other configs (8 prompts × 8 samples); the groups are not used.

    python scripts/train.py --config configs/ppo.py --workdir /tmp/ppo  # default size
    python scripts/train.py --config configs/ppo.py:tiny --workdir /tmp/ppo_tiny  # tiny
    python scripts/train.py --config configs/ppo.py --workdir /tmp/ppo_small_critic \
        --config.critic.trunk=separate --config.critic.model.num_layers=2  # a smaller, separate critic
    python scripts/train.py --config configs/ppo.py --workdir /tmp/ppo_kl --config.critic.kl_reward_coef=0.05

What makes it PPO is `ALGORITHMS["ppo"]` in gspo_jax/algorithms.py and the `critic` section (every key
in gspo_jax/critic.py's `CriticConfig`, plus the critic's optimizer); every other key, and the sizes,
in gspo_jax/config.py. Dual clip: --config.loss.dual_clip_c=3.
"""

from gspo_jax.config import base_config


def get_config(arg: str = "default"):
    """arg: the size, tiny | default | qwen3_30b_a3b."""
    return base_config("ppo", arg or "default")

r"""The routing-drift study where the policy still learns: the default policy with 64 experts instead
of 8 (still top-2, so the same active size), updated gently (64 prompts × 8 per rollout, 2 minibatches,
a constant lr 3e-4), with the sampler in bfloat16. One iteration's updates move 7-10% of the routed
expert slots, near the GSPO paper's ~10% for Qwen3-30B-A3B, and the bf16 sampler disagrees with the
float32 trainer on 5-7% of router choices (the R3 paper: ~10%).

    python scripts/train.py --config configs/study/many_experts.py:gspo --workdir /tmp/many_gspo
    python scripts/sweep.py configs/sweeps/many_experts.py --workroot results/many_experts --parallel 2

How it was chosen (configs/sweeps/regime_search.py, docs/RESULTS.md; 2 CPU cores):
- The drift of the default 8-expert model follows the step: lr × updates per rollout. It reaches
  ~10% only at steps (8 minibatches at lr 4e-4: configs/study/moe_drift.py) where every objective's
  held-out accuracy collapses, because of the step, with any router.
- At the step that learns (64 prompts, 2 minibatches, lr 3e-4) the 8-expert model moves 2.4% of its
  slots; 32 experts move 6.8%, 64 experts 7.4-10.5% (GRPO and GSPO, seeds 0 and 1). More experts of
  the same width make the same step move more routing: the routers' margins between the top-2 and
  the rest shrink as the choices multiply.
- There, the policy's sampled accuracy on its own rollouts rose from 0.48 to 0.64-0.67 over 80
  iterations; its greedy held-out accuracy dipped and came back to its 70% warm start. The sampled
  held-out accuracy (`eval_accuracy_sampled`, measured since) is the policy RL optimises.
An iteration costs ~5 s on one core (against ~0.75 s for configs/study/moe_drift.py): 64 experts and
twice the prompts.

arg: the algorithm (a configs/<name>.py file), e.g. `many_experts.py:grpo`.
"""

from gspo_jax.config import base_config


def get_config(arg: str = "grpo"):
    c = base_config(arg or "grpo", "default")
    c.model.num_experts = 64
    c.rollout.update(num_groups=64, dtype="bfloat16")
    c.train.update(num_iterations=80, minibatches=2, learning_rate=3e-4, end_lr_factor=1.0, eval_every=10)
    return c

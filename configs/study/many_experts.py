r"""The routing-drift study where the policy still learns: the default policy with 64 experts instead
of 8 (still top-2, so the same active size), updated gently (64 prompts × 8 per rollout, 2 minibatches,
a constant lr 3e-4), with the sampler in bfloat16. One iteration's updates move 7.6-12.7% of the
routed expert slots (the GSPO paper: ~10% for Qwen3-30B-A3B), the bf16 sampler disagrees with the
float32 trainer on 4.9-8.8% of router choices (the R3 paper: ~10%), and in 80 iterations the
held-out accuracy at the sampling temperature rises 15-25 points, GRPO and GSPO, every seed 0-2,
without routing replay (configs/sweeps/many_experts.py; docs/RESULTS.md). Greedy accuracy stays
within 5 points of the warm start's: its mode starts ~25 points above its samples.

    python scripts/train.py --config configs/study/many_experts.py:gspo --workdir /tmp/many_gspo
    python scripts/sweep.py configs/sweeps/many_experts.py --workroot results/many_experts --parallel 2

How it was chosen (configs/sweeps/regime_search.py, docs/RESULTS.md; 2 CPU cores):
- The drift of the default 8-expert model follows the step: lr × updates per rollout. It reaches
  ~10% only at steps (8 minibatches at lr 4e-4: configs/study/moe_drift.py) where every objective's
  held-out accuracy collapses, because of the step, with any router.
- At the step that learns (64 prompts, 2 minibatches, lr 3e-4) the 8-expert model moves 2.4% of its
  slots; 32 experts move 6.8%, 64 experts 7.4-10.5% (GRPO and GSPO, seeds 0 and 1). More experts of
  the same width make the same step move more routing: the router's probability margin between its
  k-th and (k+1)-th expert (`drift_router_margin`) is 0.010 with 64 experts against 0.052 with 8
  (GRPO seed 0, mean over the run), so a smaller step flips the choice.
- There, the policy's sampled accuracy on its own rollouts rose from 0.48 to 0.64-0.67 over 80
  iterations; its greedy held-out accuracy dipped and came back to its 70% warm start. The sampled
  held-out accuracy (`eval_accuracy_sampled`, measured since) is the policy RL optimises.
An iteration costs ~5 s on one core (against ~0.75 s for configs/study/moe_drift.py): 64 experts and
four times the prompts; a run ~7-9 minutes on one core.

arg: the algorithm (a configs/<name>.py file), e.g. `many_experts.py:grpo`.
"""

from gspo_jax.config import base_config


def get_config(arg: str = "grpo"):
    c = base_config(arg or "grpo", "default")
    c.model.num_experts = 64
    c.rollout.update(num_groups=64, dtype="bfloat16")
    c.train.update(num_iterations=80, minibatches=2, learning_rate=3e-4, end_lr_factor=1.0, eval_every=10)
    return c

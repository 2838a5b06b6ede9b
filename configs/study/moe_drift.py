r"""The routing-drift study: the default MoE policy pushed off-policy until one iteration's updates
change about 10% of its routed expert slots (the GSPO paper's figure for Qwen3-30B-A3B after one
update), with the sampler in bfloat16 so that sampler and trainer disagree too.

    python scripts/train.py --config configs/study/moe_drift.py:grpo --workdir /tmp/drift_grpo
    python scripts/train.py --config configs/study/moe_drift.py:gspo --workdir /tmp/drift_gspo \
        --config.train.routing_replay=R3
    python scripts/sweep.py configs/sweeps/objectives_replay.py --workroot results/objectives_replay

How the numbers were chosen (GRPO/GSPO, seed 0, 16 prompts × 8, measured on 2 CPU cores; drift is
`drift_slot_change_rate`, π_old against π_θ after one iteration's updates):
- 2 minibatches at lr 3e-4 (32 prompts, the default size): ~2% of slots per iteration.
- 4 minibatches at lr 3e-4: 3.8%; 8 minibatches: 6.2%.
- 8 minibatches at lr 5e-4 (cosine decay): ~10% for the first iterations, 2% once the rate had decayed.
- 8 minibatches at a constant lr 4e-4 (this config): 8.5-12% per iteration throughout; held-out
  accuracy fell from 33% to 8-19% within 20 iterations for both GRPO and GSPO (seed 0) and was still
  at 10-13% when those runs stopped (iteration 20-30). Whether any objective or replay learns here is
  what configs/sweeps/objectives_replay.py asks; docs/RESULTS.md has the numbers.
No setting found reaches this drift and still learns (configs/sweeps/regime_search.py, seed 0): above
~5% of slots per iteration every run of this model fell 16-23 points; what learned (64 prompts per
rollout, lr 3e-4: 34% -> 42% in 40 iterations) moved 2.4%, and a 6-layer 16-expert model at those
settings learned (64% -> 74%) at 3.9%, but costs ~7x per iteration; 64 experts top-2 at those settings
moved 7-10.5% and held level (70% -> 59-69% after 80 iterations, GRPO and GSPO, seeds 0-1) without
learning. So this config keeps the paper's drift and the sweeps ask which objective and which replay
lose least under it (docs/RESULTS.md).
Eight updates per rollout is what makes the later minibatches off-policy, which is where clipping and
importance weights act; the constant rate keeps the drift from fading as the run goes on. The bf16
sampler flips about 1.2% of router choices against the float32 trainer (`mismatch_router_flip_rate`),
which R3 replays and R2 does not.

arg: the algorithm (a configs/<name>.py file), e.g. `moe_drift.py:gspo`.
"""

from gspo_jax.config import base_config


def get_config(arg: str = "grpo"):
    c = base_config(arg or "grpo", "default")
    c.rollout.update(num_groups=16, dtype="bfloat16")
    c.train.update(num_iterations=100, minibatches=8, learning_rate=4e-4, end_lr_factor=1.0, eval_every=10)
    return c

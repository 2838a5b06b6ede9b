"""How the study regime was looked for: seed-0 GRPO (and GSPO) runs of configs/study/moe_drift.py with
one thing changed each (per-update batch, learning rate, minibatches, the model's depth and expert
count, the load-balancing loss), to find where one iteration moves ~10% of the expert slots and the
policy still learns. 29 runs, seed 0 (the 64-expert arm also seed 1): leads, not results
(docs/RESULTS.md has the table).

    python scripts/sweep.py configs/sweeps/regime_search.py --workroot results/regime_search --parallel 2
    python scripts/sweep.py configs/sweeps/regime_search.py --workroot results/regime_search --report
"""

BASE = "configs/study/moe_drift.py:{algorithm}"

AGGRESSIVE = [  # more updates per rollout or a higher rate, 50 iterations
    {"train.minibatches": 4, "train.learning_rate": 6e-4},
    {"rollout.num_groups": 32, "train.minibatches": 8, "train.learning_rate": 4e-4},
    {"train.minibatches": 8, "train.learning_rate": 2e-4},
    {"rollout.num_groups": 32, "train.minibatches": 4, "train.learning_rate": 8e-4},
]
MODELS = [  # drift from the router instead of the step: 2 minibatches at 3e-4, 60 iterations
    {},
    {"model.num_layers": 6, "model.num_experts": 16},
    {"model.num_experts": 32, "model.top_k": 8, "model.moe_mlp_dim": 32},
    {"model.num_layers": 8, "model.num_experts": 16},
]
GENTLE = [  # what the accuracy dip at the start of RL depends on: 2 minibatches, 40 iterations
    {"train.learning_rate": 3e-4, "rollout.dtype": "float32"},
    {"train.learning_rate": 3e-4, "model.lb_loss_coef": 0.0, "model.z_loss_coef": 0.0},
    {"train.learning_rate": 1e-4},
    {"train.learning_rate": 3e-4, "rollout.num_groups": 64},
]
COMBINED = {  # the router that drifts (16 experts, 6 layers) at the step that learns (64 prompts, lr 3e-4)
    "model.num_layers": 6,
    "model.num_experts": 16,
    "rollout.num_groups": 64,
    "train.minibatches": 2,
    "train.learning_rate": 3e-4,
    "train.num_iterations": 40,
    "train.eval_every": 5,
}
FINE = {  # drift from more experts at a fixed active size (top-2 of 64) at the step that learns
    "model.num_experts": 64,
    "rollout.num_groups": 64,
    "train.minibatches": 2,
    "train.learning_rate": 3e-4,
    "train.num_iterations": 80,
}
BIG_BATCH = [  # drift at 64 prompts per rollout, 30 iterations
    {"train.minibatches": 2, "train.learning_rate": 1e-3},
    {"train.minibatches": 4, "train.learning_rate": 6e-4},
]


def runs():
    out = [{"algorithm": a, **c, "train.num_iterations": 50, "seed": 0} for c in AGGRESSIVE for a in ("grpo", "gspo")]
    gentle = {"train.minibatches": 2, "train.learning_rate": 3e-4, "train.num_iterations": 60}
    out += [{"algorithm": "grpo", **m, **gentle, "seed": 0} for m in MODELS]
    short = {"train.minibatches": 2, "train.num_iterations": 40, "train.eval_every": 5}
    out += [{"algorithm": "grpo", **c, **short, "seed": 0} for c in GENTLE]
    big = {"rollout.num_groups": 64, "train.num_iterations": 30, "train.eval_every": 5}
    out += [{"algorithm": a, **c, **big, "seed": 0} for c in BIG_BATCH for a in ("grpo", "gspo")]
    out.append({"algorithm": "grpo", **COMBINED, "seed": 0})
    out.append({"algorithm": "grpo", **COMBINED, "train.minibatches": 4, "seed": 0})  # the same, 2x the steps
    out += [{"algorithm": a, **FINE, "seed": seed} for seed in (0, 1) for a in ("grpo", "gspo")]
    short_fine = {**FINE, "train.num_iterations": 40}  # 64 experts at 4 minibatches; 32 experts at 2 and 4
    grid = [(64, 4), (32, 2), (32, 4)]
    return out + [
        {"algorithm": "grpo", **short_fine, "model.num_experts": e, "train.minibatches": mb, "seed": 0}
        for e, mb in grid
    ]

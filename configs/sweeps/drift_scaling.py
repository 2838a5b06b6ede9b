"""Routing drift as a law of MoE depth, expert count, top-k and completion length (issue 65, point 2):
short runs around the mechanism study's cell (configs/study/deep_moe.py: 8 MoE layers of 64 experts
top-2, 36-token worked sums; lr 1e-4 and 4 updates per rollout throughout), one dial at a time, each
architecture and task from its own warm start: depth 1-32 MoE layers, 8-128 experts (expert width and
top-2 fixed: the same active size), top-1 to top-8 (the active size fixed: expert width 256/k), and
completions of ~5 to ~100 tokens. 17 cells x 3 seeds: 51 runs of 10 iterations.

    python scripts/sweep.py configs/sweeps/drift_scaling.py --workroot results/drift_scaling --parallel 2
    python scripts/sweep.py configs/sweeps/drift_scaling.py --workroot results/drift_scaling --report
"""

BASE = "configs/study/deep_moe.py:{algorithm}"
COMMON = {"train.learning_rate": 1e-4, "train.num_iterations": 10, "train.eval_every": 10}

CENTER = {"algorithm": "grpo"}
DEPTHS = (1, 2, 4, 16, 32)  # MoE layers beside the center's 8 (layer 0 stays dense)
EXPERTS = (8, 16, 32, 128)  # beside 64
TOP_K = (1, 4, 8)  # beside 2; expert width 256 / k keeps k x width = 256
LENGTHS = {  # completion length beside the center's 33-39 tokens: (operands, digits, working, budget, prompt)
    "answer": (2, 1, 0.0, 8, 24),  # the answer alone, ~5 tokens
    "one_line": (2, 1, 1.0, 16, 24),  # one worked line, ~12
    "seven_lines": (8, 1, 1.0, 72, 32),  # ~55
    "three_digits": (8, 3, 1.0, 136, 48),  # ~100
}
SEEDS = 3


def _length(operands: int, digits: int, working: float, budget: int, prompt: int) -> dict:
    task = {"task.arithmetic.operands": operands, "task.arithmetic.digits": digits}
    return {**task, "task.arithmetic.working": working, "max_new_tokens": budget, "prompt_len": prompt}


CELLS = (
    [CENTER]
    + [{**CENTER, "model.num_layers": d + 1} for d in DEPTHS]
    + [{**CENTER, "model.num_experts": e} for e in EXPERTS]
    + [{**CENTER, "model.top_k": k, "model.moe_mlp_dim": 256 // k} for k in TOP_K]
    + [{**CENTER, **_length(*v)} for v in LENGTHS.values()]
)

ANALYSIS = """\
Stated before the sweep ran (2026-11-29). Each run's value of a metric is its mean over iterations 1-10
(every iteration's drift pass and updates); a cell's value is the mean of its 3 seeds. Metrics: the
per-iteration slot change rate (`drift_slot_change_rate`), tokens with any flipped layer
(`drift_token_any_flip`), the routing share of the log-ratio (`drift_logratio_routing_share`), the token
ratio's tail on flipped and unflipped tokens (`ratio_tail_frac_*`: outside [0.5, 2];
`abs_log_ratio_p99_*`) and per sequence (`seq_ratio_tail_frac`, `seq_abs_log_ratio_p99`), the clip
fraction on flipped tokens (`clip_frac_flipped`), and the bf16 sampler's router disagreement with the
trainer (`mismatch_router_flip_rate`, `mismatch_token_any_flip`).

Fit: for each dial (MoE layers L, experts E, top-k K, mean completion length N as measured), a line
through the per-seed points on log-log axes, fractions on the log-odds scale (log p/(1-p)), the rest on
the log scale; the slope's 95% interval from the fit (t with n-2 degrees of freedom). Extrapolation to
Qwen3-30B-A3B (L = 48, E = 128, K = 8, N = 1,000): the four dials' slopes combined as a separable power
law around the center cell (no interactions: only one dial moves at a time here), its interval from 1,000
bootstrap resamples of the seeds within each cell, set beside the GSPO paper's ~10% of activated experts
changing per update (against the slot change rate, which here is per iteration of 4 updates) and the R3
paper's ~10% of routers and 94% of tokens differing between training and inference (against the bf16
sampler's disagreement). Limits stated with the figure: one width (128; Qwen3 2,048), one task whose
difficulty changes with its length, warm starts of 112 steps whatever the architecture, 10 iterations,
and extrapolation past the largest measured value of N by 10x and of L by 1.5x.\
"""


def runs():
    return [{**cell, "seed": seed} for seed in range(SEEDS) for cell in CELLS]

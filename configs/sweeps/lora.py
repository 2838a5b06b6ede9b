"""LoRA RL against full fine-tuning in the main job's regime (configs/gspo.py at its default size: the
README's run, 200 iterations): GSPO fully fine-tuned, and with LoRA (the base frozen after the shared
supervised warm start) at rank 1, 8 and 32 on attention + experts and at rank 32 on attention only,
5 seeds each: 25 runs, ~2 hours on 2 cores one at a time. Asks whether low rank matches the full update
here ("LoRA Without Regret", Thinking Machines 2025), and what low-rank updates with a frozen router do to
routing drift, which no paper reports.

    python scripts/sweep.py configs/sweeps/lora.py --workroot results/lora --parallel 1
    python scripts/sweep.py configs/sweeps/lora.py --workroot results/lora --report
"""

BASE = "configs/gspo.py"
# "LoRA Without Regret": with α = 32 and the 1/r scale, LoRA's best learning rate is about 10x full
# fine-tuning's and nearly independent of the rank. The full run's is the config's 3e-4.
LR_FACTOR = 10
LORA_LR = 3e-3  # 3e-4 x LR_FACTOR, written out (3e-4 * 10 is 0.0030000000000000005)
ARMS = {
    "full": {},
    "r1": {"lora.rank": 1, "lora.targets": "attention,experts", "train.learning_rate": LORA_LR},
    "r8": {"lora.rank": 8, "lora.targets": "attention,experts", "train.learning_rate": LORA_LR},
    "r32": {"lora.rank": 32, "lora.targets": "attention,experts", "train.learning_rate": LORA_LR},
    "r32_attention": {"lora.rank": 32, "lora.targets": "attention", "train.learning_rate": LORA_LR},
}

ANALYSIS = """\
Stated before any run of this sweep (2026-11-29), by gspo_jax/study/analysis.py's rule: a run's final
greedy and sampled accuracy is the mean of its last 3 held-out evaluations (iterations 160, 180, 200) and
its gain that minus step 0 (the shared warm start). Each LoRA arm is compared with full fine-tuning
(CONTROL), paired by seed, with a 95% t-interval over the 5 seeds. Sampled gain is primary, greedy beside
it. The learning rate is the full run's (3e-4) times 10 for every LoRA arm, per LoRA Without Regret.
Claim "LoRA RL at rank 1 matches full fine-tuning" (LoRA Without Regret): supported if rank 1's paired
sampled-gain interval lies within ±5 points; contradicted if it lies wholly below 0; otherwise not
settled, with the interval's width said. The same rule reads rank 8, rank 32 and attention-only (LoRA
Without Regret expects attention-only to fall short).
Routing drift: a run's drift is the mean over its iterations of `drift_slot_change_rate` (the share of
expert slots whose choice moved between consecutive policies); each LoRA arm's is compared with full
fine-tuning's, paired by seed, 95% t-interval. "Lower" if the interval lies wholly below 0.
If rank 32 on attention + experts drifts lower, one arm follows (a later sweep, stated here first): GRPO
with that LoRA in the headline cell (configs/study/deep_moe.py, configs/sweeps/headline.py's COMMON),
with and without R3, 5 seeds, asking whether LoRA RL on an MoE still needs routing replay.\
"""


def CONTROL(arm: dict) -> dict:  # noqa: N802 - the sweep file's CONTROL: full fine-tuning of the same objective
    return {"algorithm": arm["algorithm"]}


def runs():
    return [{"algorithm": "gspo", **arm, "seed": seed} for seed in range(5) for arm in ARMS.values()]

"""Held-out evaluation: accuracy on a fixed set of prompts from the task's eval split, greedy and at the
rollout's own sampling settings, and the greedy completions of the first few prompts (samples.jsonl).

Two accuracies because they answer different questions. Greedy (`eval_accuracy`) is the policy's mode;
sampled (`eval_accuracy_sampled`: one completion per prompt at the rollout's temperature, top-k and
top-p, averaged over the repeated draws, the papers' avg@k) is the policy RL optimises. A warm start's
mode can be far better than its samples (the default's: 50% greedy, 28% sampled), and RL's first
updates then lower the first while they raise the second (docs/RESULTS.md).
"""

from __future__ import annotations

import jax
import numpy as np

from gspo_jax.rollout import Rollout
from gspo_jax.tasks import prompt_iterator

SAMPLES = 8  # held-out completions kept per evaluation
SAMPLED_KEY_OFFSET = 1 << 20  # the sampled draws' keys, apart from the greedy ones (which draw nothing)


def evaluate(rollout: Rollout, params, *, seed: int, num_batches: int) -> tuple[dict[str, float], list[dict]]:
    """Greedy and sampled accuracy on `num_batches` × batch held-out prompts, and the first `SAMPLES`
    of this process's prompts with their greedy completions and rewards.

    The prompts and the sampled draws' keys depend only on (task, seed): every evaluation of a run
    sees the same prompts with the same random numbers, so its curve moves with the policy, not with
    the draw, and the samples show one prompt's answer change over the run. Each process scores the
    completions its devices hold (`Rollout.sample`).
    """
    cfg = rollout.cfg
    prompts = prompt_iterator(rollout.task, seed=seed, split="eval")
    greedy, sampled, samples = [], [], []
    for i in range(num_batches):
        examples = prompts.next_batch(rollout.sampler.batch_size)
        g = rollout.sample(params, examples, 1, jax.random.key(i), temperature=0.0)
        greedy.append(g.raw == 1.0)
        key = jax.random.key(SAMPLED_KEY_OFFSET + i)
        s = rollout.sample(params, examples, 1, key, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
        sampled.append(s.raw == 1.0)
        for row, text in list(zip(rollout.rows, g.texts))[: SAMPLES - len(samples)]:
            samples.append({"prompt": examples[row].prompt, "completion": text, "reward": float(g.raw[row])})
    metrics = {"eval_accuracy": float(np.mean(greedy)), "eval_accuracy_sampled": float(np.mean(sampled))}
    return metrics, samples

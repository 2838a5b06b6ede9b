"""Held-out evaluation: greedy accuracy on a fixed set of prompts from the task's eval split."""

from __future__ import annotations

import jax
import numpy as np

from gspo_jax.rollout import Rollout
from gspo_jax.tasks import prompt_iterator


def evaluate(rollout: Rollout, params, *, seed: int, num_batches: int) -> dict[str, float]:
    """Fraction of `num_batches` × batch held-out prompts whose greedy completion earns reward 1.

    The prompts depend only on (task, seed): every evaluation of a run sees the same ones. Each process
    scores the completions its devices hold (`Rollout.sample`).
    """
    prompts = prompt_iterator(rollout.task, seed=seed, split="eval")
    correct = []
    for i in range(num_batches):
        examples = prompts.next_batch(rollout.sampler.batch_size)
        correct.append(rollout.sample(params, examples, 1, jax.random.key(i), temperature=0.0).raw == 1.0)
    return {"eval_accuracy": float(np.mean(correct))}

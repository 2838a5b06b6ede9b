"""Held-out evaluation: greedy accuracy on a fixed set of prompts from the task's eval split, and the
completions of the first few of them (what the policy writes, logged to samples.jsonl)."""

from __future__ import annotations

import jax
import numpy as np

from gspo_jax.rollout import Rollout
from gspo_jax.tasks import prompt_iterator

SAMPLES = 8  # held-out completions kept per evaluation


def evaluate(rollout: Rollout, params, *, seed: int, num_batches: int) -> tuple[dict[str, float], list[dict]]:
    """Fraction of `num_batches` × batch held-out prompts whose greedy completion earns reward 1, and
    the first `SAMPLES` of this process's prompts with their completions and rewards.

    The prompts depend only on (task, seed): every evaluation of a run sees the same ones, so the
    samples show one prompt's answer change over the run. Each process scores the completions its
    devices hold (`Rollout.sample`).
    """
    prompts = prompt_iterator(rollout.task, seed=seed, split="eval")
    correct, samples = [], []
    for i in range(num_batches):
        examples = prompts.next_batch(rollout.sampler.batch_size)
        s = rollout.sample(params, examples, 1, jax.random.key(i), temperature=0.0)
        correct.append(s.raw == 1.0)
        for row, text in list(zip(rollout.rows, s.texts))[: SAMPLES - len(samples)]:
            samples.append({"prompt": examples[row].prompt, "completion": text, "reward": float(s.raw[row])})
    return {"eval_accuracy": float(np.mean(correct))}, samples

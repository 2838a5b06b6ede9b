"""Held-out evaluation: greedy accuracy on a fixed set of prompts from the task's eval split."""

from __future__ import annotations

import jax
import numpy as np

from gspo_jax.rollout import Rollout
from gspo_jax.tasks import prompt_iterator


def evaluate(rollout: Rollout, params, *, seed: int, num_batches: int) -> dict[str, float]:
    """Fraction of `num_batches` × batch held-out prompts whose greedy completion earns reward 1.

    The prompts depend only on (task, seed): every evaluation of a run sees the same ones.
    """
    sampler, task = rollout.sampler, rollout.task
    prompts = prompt_iterator(task, seed=seed, split="eval")
    correct = []
    for i in range(num_batches):
        examples = prompts.next_batch(sampler.batch_size)
        tokens_BP, mask_BP = rollout.encode_prompts([e.prompt for e in examples])
        out = sampler(
            params,
            tokens_BP,
            mask_BP,
            jax.random.key(i),
            temperature=0.0,
            eos_ids=rollout.eos_ids,
            pad_id=rollout.pad_id,
        )
        texts = rollout.decode_completions(np.asarray(out.tokens), np.asarray(out.lengths))
        correct += [task.reward(t, e) == 1.0 for t, e in zip(texts, examples)]
    return {"eval_accuracy": float(np.mean(correct))}

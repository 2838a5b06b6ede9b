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

from gspo_jax import passk
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


def sample_n(
    rollout: Rollout,
    params,
    *,
    split: str,
    num_prompts: int,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """`scripts/evaluate.py`'s numbers: n completions (the rollout's group size) of each of `num_prompts`
    prompts of the task's `split` at `temperature`, and the greedy one, scored: greedy accuracy, avg@n,
    pass@k and maj@k (`passk`), the mean completion length and the truncation rate of the samples. The
    prompts and every draw's key come from `seed` alone. One process (each holds the rows it samples)."""
    from tqdm.auto import tqdm

    n, per = rollout.cfg.group_size, rollout.cfg.num_groups  # a sampler call: `per` prompts × n samples
    prompts = prompt_iterator(rollout.task, seed=seed, split=split)
    right, answers, greedy, lengths, truncated = [], [], [], [], []
    calls = -(-num_prompts // per)
    for i in tqdm(range(calls), desc=f"evaluate {num_prompts} prompts × {n}", unit="batch", disable=not progress):
        examples = prompts.next_batch(per)
        keep = min(per, num_prompts - i * per)  # the last call's extra prompts are drawn, not counted
        key = jax.random.fold_in(jax.random.key(seed), i)
        s = rollout.sample(params, examples, n, key, temperature=temperature, top_k=top_k, top_p=top_p)
        g = rollout.sample(params, examples, n, key, temperature=0.0)  # n alike: the first of each is kept
        right.append((s.raw == 1.0).reshape(per, n)[:keep])
        answers += [[rollout.task.extract_answer(t) for t in s.texts[p * n : (p + 1) * n]] for p in range(keep)]
        greedy.append((g.raw == 1.0).reshape(per, -1)[:keep, 0])
        lengths.append(s.lengths.reshape(per, n)[:keep])
        truncated.append(s.truncated.reshape(per, n)[:keep])
    right_PN = np.concatenate(right)
    out = {"greedy_accuracy": float(np.concatenate(greedy).mean())}
    out.update(passk.summarize(right_PN, answers, passk.default_ks(n)))
    out["mean_completion_length"] = float(np.concatenate(lengths).mean())
    out["truncation_rate"] = float(np.concatenate(truncated).mean())
    return out

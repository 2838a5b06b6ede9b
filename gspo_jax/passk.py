"""What reasoning-RL papers report from n samples per prompt (`scripts/evaluate.py`): avg@n, the mean
accuracy of the n samples; pass@k, the chance that at least one of k samples drawn without replacement
from the n is right, by the unbiased estimator 1 − C(n−c, k) / C(n, k) (Chen et al., *Evaluating Large
Language Models Trained on Code*, arXiv 2107.03374; c right of n); and maj@k, whether the most common
answer among the first k samples is right (self-consistency; ties go to the answer reached first,
completions with no answer do not vote). Each is a mean over prompts."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with `c` right among `n` samples, as the stable product
    1 − ∏_{i=n−c+1}^{n} (1 − k/i) (no binomials of large numbers)."""
    if not (isinstance(n, int | np.integer) and 1 <= k <= n and 0 <= c <= n):
        raise ValueError(f"pass_at_k: needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a right one
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def majority_right(answers: Sequence[str | None], right: Sequence[bool]) -> bool:
    """Whether the most common answer among `answers` (None: no answer, no vote) is right, judged by
    the first sample that gave it; ties go to the answer reached first; False when none answered."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return False
    top = max(votes.values())
    first = next(i for i, a in enumerate(answers) if a is not None and votes[a] == top)
    return bool(right[first])


def default_ks(n: int) -> list[int]:
    """The k reported for n samples: the powers of 2 below n, and n."""
    return sorted({*(2**i for i in range(n.bit_length()) if 2**i < n), n})


def summarize(right_PN: np.ndarray, answers_PN: Sequence[Sequence[str | None]], ks: Sequence[int]) -> dict:
    """avg@n, pass@k and maj@k for k in `ks`, each the mean over the P prompts, from which of each prompt's
    n samples are right (`right_PN`) and their extracted answers."""
    right_PN = np.asarray(right_PN, bool)
    P, n = right_PN.shape
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise ValueError(f"summarize: k must be in [1, n={n}], got {bad}")
    c_P = right_PN.sum(1)
    out = {f"avg@{n}": float(right_PN.mean())}
    for k in ks:
        out[f"pass@{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in c_P]))
    for k in ks:
        out[f"maj@{k}"] = float(np.mean([majority_right(answers_PN[p][:k], right_PN[p, :k]) for p in range(P)]))
    return out

"""pass@k by the unbiased estimator against brute force over every k-subset, maj@k's vote and ties, and
avg@n, on small hand-made cases (gspo_jax/passk.py)."""

import itertools

import numpy as np
import pytest

from gspo_jax import passk


def brute_pass_at_k(right: list[bool], k: int) -> float:
    """The share of the k-subsets of the n samples that hold a right one."""
    subsets = list(itertools.combinations(range(len(right)), k))
    return sum(any(right[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_equals_the_share_of_k_subsets_with_a_right_sample(n):
    for c in range(n + 1):
        right = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert passk.pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(right, k), abs=1e-12), (n, c, k)


def test_pass_at_k_by_hand_and_its_bounds():
    assert passk.pass_at_k(4, 1, 1) == pytest.approx(0.25)  # one right of four, one draw
    assert passk.pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert passk.pass_at_k(10, 0, 5) == 0.0 and passk.pass_at_k(10, 6, 5) == 1.0  # none right; every subset hits
    assert passk.pass_at_k(1000, 3, 10) == pytest.approx(1 - np.prod([(997 - i) / (1000 - i) for i in range(10)]))
    for n, c, k in [(4, 1, 0), (4, 1, 5), (4, 5, 1), (4, -1, 1)]:
        with pytest.raises(ValueError, match="needs 1 <= k <= n"):
            passk.pass_at_k(n, c, k)


def test_majority_vote_ignores_no_answer_and_breaks_ties_by_first_reached():
    assert passk.majority_right(["7", "8", "7"], [True, False, True])
    assert not passk.majority_right(["8", "7", "8"], [False, True, False])
    assert passk.majority_right(["7", "8"], [True, False])  # a tie: the first answer reached wins
    assert not passk.majority_right(["8", "7"], [False, True])
    assert passk.majority_right([None, None, "7"], [False, False, True])  # no answer, no vote
    assert not passk.majority_right([None, None], [False, False])


def test_summary_over_prompts_by_hand():
    right = np.array([[True, False, False, False], [False, False, False, False], [True, True, True, True]])
    answers = [["1", "2", "2", None], [None, "3", "4", "3"], ["5", "5", "5", "5"]]
    out = passk.summarize(right, answers, passk.default_ks(4))
    assert passk.default_ks(4) == [1, 2, 4] and passk.default_ks(6) == [1, 2, 4, 6] and passk.default_ks(1) == [1]
    assert out["avg@4"] == pytest.approx(5 / 12)
    assert out["pass@1"] == pytest.approx((0.25 + 0 + 1) / 3)
    assert out["pass@2"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert out["pass@4"] == pytest.approx(2 / 3)
    # maj@1: the first sample; maj@2: prompt 0 ties "1"/"2" -> "1" (right); maj@4: prompt 0 votes "2" (wrong)
    assert (out["maj@1"], out["maj@2"], out["maj@4"]) == (
        pytest.approx(2 / 3),
        pytest.approx(2 / 3),
        pytest.approx(1 / 3),
    )
    with pytest.raises(ValueError, match="k must be in"):
        passk.summarize(right, answers, [8])

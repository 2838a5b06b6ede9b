"""The smoke sweep: GRPO vs GSPO on the tiny config, seeds 0 and 1 (4 runs of 3 iterations, ~20 s each
on 2 CPU cores); tests/test_sweep.py runs it, killed mid-way and restarted.

    python scripts/sweep.py configs/sweeps/tiny.py --workroot /tmp/sweep_tiny --parallel 2
    python scripts/sweep.py configs/sweeps/tiny.py --workroot /tmp/sweep_tiny --report  # -> report.md
"""

from gspo_jax.study.sweeps import grid

BASE = "configs/gspo.py:tiny"
COMMON = {"train.num_iterations": 3}  # pinned here, so that the sweep means the same if tiny changes


def runs():
    return grid(algorithm=["grpo", "gspo"], seed=[0, 1])

"""Does the README's main job learn? The default size (configs/<algorithm>.py, no overrides) for GRPO,
DAPO and GSPO over 3 seeds: the report's "step-0 acc" is the warm start and "final acc" what RL made
of it (issue 38 asked for +20 points in each run, in at most 5 minutes on the 2-core AVX-512 host).
9 runs, ~45 minutes on 2 cores (one at a time: each run on both cores, timed as the README runs it).

    python scripts/sweep.py configs/sweeps/main_job.py --workroot /tmp/main_job --parallel 1
    python scripts/sweep.py configs/sweeps/main_job.py --workroot /tmp/main_job --report
"""

from gspo_jax.study.sweeps import grid

BASE = "configs/gspo.py"


def runs():
    return grid(algorithm=["grpo", "dapo", "gspo"], seed=[0, 1, 2])

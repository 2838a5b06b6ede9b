"""The scripts' exit codes, for schedulers and sweeps: what a process's exit status says about its work.
scripts/train.py exits 0, 2, 75 or 130; scripts/sweep.py (`gspo_jax.study.runner`) reads a run's 75 and 130 as
"stopped, resumes" and exits 0, 1, 2 or 75 itself; scripts/drift.py and scripts/aot_compile.py refuse
with 2.
"""

EXIT_DONE = 0  # everything asked for was done
EXIT_FAILED = 1  # some of the work failed (a sweep's run; the others ran on)
EXIT_REFUSED = 2  # refused before any work, one line on stderr; nothing written
EXIT_STOPPED = 75  # EX_TEMPFAIL, "try again": stopped early with a checkpoint saved; a rerun resumes
EXIT_INTERRUPTED = 130  # 128 + SIGINT: a second Ctrl-C stopped it at once; the newest complete checkpoint is intact

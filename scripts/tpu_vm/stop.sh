#!/usr/bin/env bash
# stop.sh: sends SIGTERM to the trainer that run.sh started on every worker. Like a preemption
# notice: each trainer saves a checkpoint at the end of its current iteration and exits with code 75;
# run.sh with the same arguments resumes from it.
#
# Usage: scripts/tpu_vm/stop.sh [--dry-run]
#
# Variables: TPU_NAME, ZONE (required); PROJECT; REPO_DIR (default gspo_jax, in the workers' home).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "$0")/common.sh"
parse_args "$@"
no_args

require TPU_NAME ZONE
on_workers all "cd $(quote "$REPO_DIR") || exit 1; if $TRAINER_ALIVE; then kill -TERM \$pid && \
echo \"\$(hostname): SIGTERM sent to trainer pid \$pid\"; else echo \"\$(hostname): no trainer running\"; fi"
echo "$SCRIPT: the trainers checkpoint and exit 75 at the end of their iteration; logs.sh shows it" >&2

#!/usr/bin/env bash
# run.sh: starts `python scripts/train.py --config CONFIG --workdir WORKDIR --multihost [FLAGS...]` on
# every worker of the slice at once, detached (setsid nohup), each appending its output to
# REPO_DIR/logs/<run>.<hostname>.log (<run>: the basename of WORKDIR; logs/latest.log points to it),
# then returns. jax.distributed.initialize() finds the coordinator and the process ids on a TPU VM.
# Safe to rerun: it refuses while a trainer is still running on any worker, and a trainer started on
# a workdir that has checkpoints resumes from the latest one (after stop.sh or a preemption).
#
# Usage: scripts/tpu_vm/run.sh [--dry-run] CONFIG WORKDIR [train.py flags...]
#   e.g. run.sh configs/gspo.py:qwen3_30b_a3b /mnt/gcs/runs/gspo_30b --config.hf_checkpoint=...
#   WORKDIR must be one path that every worker sees (the bucket mounted by setup.sh): orbax writes
#   each worker's shards of a checkpoint there. It must be an absolute path.
#
# Variables: TPU_NAME, ZONE (required); PROJECT; REPO_DIR (default gspo_jax, in the workers' home);
# MOUNT (default /mnt/gcs: a WORKDIR elsewhere gets a warning).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "$0")/common.sh"
parse_args "$@"

require TPU_NAME ZONE
if [[ ${#ARGS[@]} -lt 2 ]]; then die "missing argument(s): CONFIG WORKDIR (see --help)"; fi
config="${ARGS[0]}"
workdir="${ARGS[1]}"
if [[ "$workdir" != /* ]]; then die "WORKDIR must be an absolute path that every worker sees, not $workdir"; fi
if [[ "$workdir" != "$MOUNT"/* ]]; then
  echo "$SCRIPT: warning: WORKDIR $workdir is not under $MOUNT; every worker must see it at the same path" >&2
fi
run_name="$(basename "$workdir")"

train=(.venv/bin/python scripts/train.py --config "$config" --workdir "$workdir" --multihost)
if [[ ${#ARGS[@]} -gt 2 ]]; then train+=("${ARGS[@]:2}"); fi
dir="$(quote "$REPO_DIR")"

# First every worker is checked, so that no worker starts while another one still runs a trainer.
on_workers all "cd $dir || exit 1; if $TRAINER_ALIVE; then \
echo \"\$(hostname): a trainer is still running (pid \$pid); stop.sh stops it\" >&2; exit 1; fi"
on_workers all "cd $dir || exit 1; mkdir -p logs; name=$(quote "$run_name").\$(hostname).log; \
echo \"=== \$(date -u +%FT%TZ) run.sh\" >> logs/\$name; \
setsid nohup $(quote_all "${train[@]}") >> logs/\$name 2>&1 < /dev/null & \
echo \$! > logs/train.pid; ln -sfn \$name logs/latest.log; \
echo \"\$(hostname): trainer pid \$(cat logs/train.pid), log $dir/logs/\$name\""

echo "$SCRIPT: started on every worker of $TPU_NAME. Follow worker 0 with: scripts/tpu_vm/logs.sh 0" >&2
echo "$SCRIPT: stop (checkpoint, exit 75) with scripts/tpu_vm/stop.sh; rerun this command to resume" >&2

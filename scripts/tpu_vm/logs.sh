#!/usr/bin/env bash
# logs.sh: follows a worker's trainer log (tail -F over ssh; Ctrl-C stops following, not the run).
# By default the log of the latest run.sh, else the run RUN_NAME (the basename of its WORKDIR).
#
# Usage: scripts/tpu_vm/logs.sh [--dry-run] [WORKER]   (WORKER: 0, 1, ...; default 0)
#
# Variables: TPU_NAME, ZONE (required); PROJECT; RUN_NAME; REPO_DIR (default gspo_jax, in the
# workers' home); TAIL_LINES: how many earlier lines to show first (default 100).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "$0")/common.sh"
parse_args "$@"

require TPU_NAME ZONE
worker=0
if [[ ${#ARGS[@]} -gt 1 ]]; then die "unexpected argument: ${ARGS[1]} (see --help)"; fi
if [[ ${#ARGS[@]} -eq 1 ]]; then worker="${ARGS[0]}"; fi
if [[ ! "$worker" =~ ^[0-9]+$ ]]; then die "WORKER must be a worker number (0, 1, ...), not '$worker'"; fi
TAIL_LINES="${TAIL_LINES:-100}"
if [[ ! "$TAIL_LINES" =~ ^[0-9]+$ ]]; then die "TAIL_LINES=$TAIL_LINES: expected a number"; fi

log="logs/latest.log"
if [[ -n "${RUN_NAME:-}" ]]; then log="logs/$(quote "$RUN_NAME").\$(hostname).log"; fi
on_workers "$worker" "cd $(quote "$REPO_DIR") && tail -n $TAIL_LINES -F $log"

#!/usr/bin/env bash
# create.sh: creates the Cloud TPU VM or pod slice TPU_NAME; with QUEUED=1, a queued resource QR_ID
# for it instead, then waits until the queued resource is ACTIVE.
#
# Usage: scripts/tpu_vm/create.sh [--dry-run] [more gcloud create flags, e.g. --reserved]
#
# Variables:
#   TPU_NAME, ZONE          required
#   ACCELERATOR_TYPE        required, e.g. v5p-64 (64 TensorCores = 32 chips, 8 hosts)
#   RUNTIME_VERSION         required, e.g. v2-alpha-tpuv5 (for v5p)
#   PROJECT                 passed as --project when set
#   SPOT=1 | PREEMPTIBLE=1  cheaper, can be preempted (not both; a queued resource takes SPOT only)
#   QUEUED=1                create a queued resource (QR_ID, default TPU_NAME-qr) and wait for it
#   WAIT_TIMEOUT            seconds to wait for ACTIVE (default 3600); POLL_SECONDS between checks (30)
#
# Every script here prints each command before running it; --dry-run (or DRY_RUN=1) only prints.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "$0")/common.sh"
parse_args "$@"

require TPU_NAME ZONE ACCELERATOR_TYPE RUNTIME_VERSION
if is_on SPOT && is_on PREEMPTIBLE; then die "SPOT=1 and PREEMPTIBLE=1 contradict each other: set one"; fi
if is_on QUEUED && is_on PREEMPTIBLE; then die "QUEUED=1 with PREEMPTIBLE=1: a queued resource takes SPOT=1 instead"; fi
WAIT_TIMEOUT="${WAIT_TIMEOUT:-3600}"
POLL_SECONDS="${POLL_SECONDS:-30}"
if [[ ! "$WAIT_TIMEOUT$POLL_SECONDS" =~ ^[0-9]+$ ]]; then die "WAIT_TIMEOUT and POLL_SECONDS are whole seconds"; fi

if ! is_on QUEUED; then
  cmd=(tpu-vm create "$TPU_NAME" --accelerator-type "$ACCELERATOR_TYPE" --version "$RUNTIME_VERSION")
  if is_on SPOT; then cmd+=(--spot); fi
  if is_on PREEMPTIBLE; then cmd+=(--preemptible); fi
  if [[ ${#ARGS[@]} -gt 0 ]]; then cmd+=("${ARGS[@]}"); fi
  tpus "${cmd[@]}"
  exit 0
fi

cmd=(queued-resources create "$QR_ID" --node-id "$TPU_NAME" --accelerator-type "$ACCELERATOR_TYPE"
  --runtime-version "$RUNTIME_VERSION")
if is_on SPOT; then cmd+=(--spot); fi
if [[ ${#ARGS[@]} -gt 0 ]]; then cmd+=("${ARGS[@]}"); fi
tpus "${cmd[@]}"

deadline=$((SECONDS + WAIT_TIMEOUT))
while true; do
  # A failed describe (a network blip) is reported by gcloud and tried again; WAIT_TIMEOUT bounds it.
  state="$(tpus queued-resources describe "$QR_ID" --format='value(state.state)')" || state=""
  if is_on DRY_RUN; then
    echo "$SCRIPT: (dry run) would repeat this every ${POLL_SECONDS}s until ACTIVE, for at most ${WAIT_TIMEOUT}s" >&2
    exit 0
  fi
  echo "$SCRIPT: queued resource $QR_ID is ${state:-in no state yet}" >&2
  case "$state" in
    ACTIVE) exit 0 ;;
    FAILED | SUSPENDING | SUSPENDED)
      echo "$SCRIPT: $QR_ID will not become ACTIVE; QUEUED=1 delete.sh removes it" >&2
      exit 1
      ;;
  esac
  if [[ $SECONDS -ge $deadline ]]; then
    echo "$SCRIPT: $QR_ID not ACTIVE after ${WAIT_TIMEOUT}s; it stays queued: check it with" \
      "gcloud compute tpus queued-resources describe $QR_ID --zone $ZONE" >&2
    exit 1
  fi
  sleep "$POLL_SECONDS"
done

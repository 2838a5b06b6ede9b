#!/usr/bin/env bash
# delete.sh: deletes the TPU VM or pod slice TPU_NAME; with QUEUED=1, its queued resource QR_ID
# (--force deletes the slice with it). Everything on the workers' disks goes with it; a workdir in
# the bucket stays.
#
# Usage: scripts/tpu_vm/delete.sh [--dry-run]
#
# Variables: TPU_NAME, ZONE (required); PROJECT; QUEUED=1, QR_ID (default TPU_NAME-qr).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "$0")/common.sh"
parse_args "$@"
no_args

require TPU_NAME ZONE
if is_on QUEUED; then
  tpus queued-resources delete "$QR_ID" --force --quiet
else
  tpus tpu-vm delete "$TPU_NAME" --quiet
fi

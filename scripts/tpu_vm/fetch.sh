#!/usr/bin/env bash
# fetch.sh: copies a run's workdir back from the slice into DEST/<basename of WORKDIR>: metrics.jsonl,
# samples.jsonl, tb/, plots/, config.json, without the checkpoints and the cached warm start
# (model-sized) unless WITH_CHECKPOINTS=1. A WORKDIR under MOUNT with BUCKET set is read straight from
# the bucket (gcloud storage rsync); any other is read from worker 0 (packed with tar, then
# gcloud compute tpus tpu-vm scp; with WITH_CHECKPOINTS=1, scp --recurse). Rerunning updates the copy.
#
# Usage: scripts/tpu_vm/fetch.sh [--dry-run] WORKDIR DEST
#   e.g. fetch.sh /mnt/gcs/runs/gspo_30b runs   ->  runs/gspo_30b/metrics.jsonl, ...
#
# Variables: TPU_NAME, ZONE (required unless read from the bucket); PROJECT; BUCKET, MOUNT (default
# /mnt/gcs); WITH_CHECKPOINTS=1.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "$0")/common.sh"
parse_args "$@"

if [[ ${#ARGS[@]} -ne 2 ]]; then die "expected the arguments WORKDIR DEST (see --help)"; fi
workdir="${ARGS[0]%/}"
dest="${ARGS[1]%/}"
name="$(basename "$workdir")"
if [[ "$workdir" != /* ]]; then die "WORKDIR must be an absolute path (as given to run.sh), not $workdir"; fi

if [[ -n "$BUCKET" && "$workdir" == "$MOUNT"/* ]]; then
  cmd=(gcloud storage rsync --recursive "gs://$BUCKET/${workdir#"$MOUNT"/}" "$dest/$name")
  if ! is_on WITH_CHECKPOINTS; then cmd+=("--exclude=^(checkpoints|warm_start_[^/]*)/"); fi
  if [[ -n "$PROJECT" ]]; then cmd+=(--project "$PROJECT"); fi
  run mkdir -p "$dest/$name"
  run "${cmd[@]}"
  exit 0
fi

require TPU_NAME ZONE
run mkdir -p "$dest"
if is_on WITH_CHECKPOINTS; then
  tpus tpu-vm scp --recurse "$TPU_NAME:$workdir" "$dest/" --worker=0
  exit 0
fi
tarball="/tmp/gspo_jax_fetch.$name.tar.gz"
on_workers 0 "tar -czf $(quote "$tarball") -C $(quote "$workdir") --exclude=./checkpoints \
--exclude=\"./warm_start_*\" ."
tpus tpu-vm scp "$TPU_NAME:$tarball" "$dest/$name.tar.gz" --worker=0
run mkdir -p "$dest/$name"
run tar -xzf "$dest/$name.tar.gz" -C "$dest/$name"
run rm -f "$dest/$name.tar.gz"

#!/usr/bin/env bash
# setup.sh: installs the project on every worker of the slice: copies this repository's HEAD (git
# archive; uncommitted changes are not copied) or clones REPO_URL into REPO_DIR, creates REPO_DIR/.venv
# and runs pip install -e ".[tpu]" there. With BUCKET set, it also mounts the bucket with gcsfuse at
# MOUNT on every worker: a multi-host workdir must be one path that every worker sees.
# Safe to rerun (after a new commit, or after a worker rebooted and lost its mount).
#
# Usage: scripts/tpu_vm/setup.sh [--dry-run]
#
# Variables:
#   TPU_NAME, ZONE   required
#   PROJECT          passed as --project when set
#   REPO_DIR         the checkout on the workers, relative to their home or absolute (default gspo_jax)
#   REPO_URL         git clone (or pull) this instead of copying HEAD from here
#   PYTHON           the interpreter for the venv (default python3.11; JAX needs 3.11 or later),
#                    installed with apt (with its -venv package) where the worker lacks it
#   BUCKET, MOUNT    a GCS bucket to mount (name or gs://name) and where (default /mnt/gcs)
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "$0")/common.sh"
parse_args "$@"
no_args

require TPU_NAME ZONE
PYTHON="${PYTHON:-python3.11}"
dir="$(quote "$REPO_DIR")"
# apt-get waits for the package lock, which a freshly booted VM's unattended upgrades may hold.
apt_install="sudo apt-get -q update && sudo apt-get -q -y -o DPkg::Lock::Timeout=600 install"

# 1. The code.
if [[ -n "${REPO_URL:-}" ]]; then
  on_workers all "if [ -d $dir/.git ]; then git -C $dir pull --ff-only; else git clone $(quote "$REPO_URL") $dir; fi"
else
  if [[ -n "$(git -C "$REPO_ROOT" status --porcelain --untracked-files=no 2> /dev/null)" ]]; then
    echo "$SCRIPT: note: uncommitted changes are not copied (git archive HEAD)" >&2
  fi
  tarball="${TMPDIR:-/tmp}/gspo_jax.$TPU_NAME.tar.gz"
  run git -C "$REPO_ROOT" archive --format=tar.gz -o "$tarball" HEAD
  tpus tpu-vm scp "$tarball" "$TPU_NAME:gspo_jax.tar.gz" --worker=all
  run rm -f "$tarball"
  on_workers all "mkdir -p $dir && tar -xzf gspo_jax.tar.gz -C $dir && rm gspo_jax.tar.gz"
fi

# 2. A virtualenv with the project and libtpu.
py="$(quote "$PYTHON")"
on_workers all "($py -m ensurepip --version > /dev/null 2>&1 || ($apt_install $py $py-venv)) && \
cd $dir && $py -m venv .venv && .venv/bin/pip install -q --upgrade pip && .venv/bin/pip install -q -e \".[tpu]\""

# 3. The bucket, mounted at the same path on every worker. --implicit-dirs shows directories that
# another worker created; --rename-dir-limit lets orbax rename a finished checkpoint's directory into
# place (gcsfuse refuses directory renames without it, on buckets without hierarchical namespace).
if [[ -n "$BUCKET" ]]; then
  mnt="$(quote "$MOUNT")"
  gcsfuse_repo="deb [signed-by=/usr/share/keyrings/cloud.google.asc] https://packages.cloud.google.com/apt \
gcsfuse-\$(lsb_release -cs) main"
  install_gcsfuse="echo \"$gcsfuse_repo\" | sudo tee /etc/apt/sources.list.d/gcsfuse.list > /dev/null && \
curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg | sudo tee /usr/share/keyrings/cloud.google.asc \
> /dev/null && $apt_install gcsfuse"
  on_workers all "(command -v gcsfuse > /dev/null || ($install_gcsfuse)) && sudo mkdir -p $mnt && \
sudo chown \$(id -u):\$(id -g) $mnt && (mountpoint -q $mnt || \
gcsfuse --implicit-dirs --rename-dir-limit=1000000 $(quote "$BUCKET") $mnt)"
fi
echo "$SCRIPT: done; start a run with scripts/tpu_vm/run.sh CONFIG WORKDIR [flags]" >&2

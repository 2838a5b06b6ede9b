# common.sh: sourced by the other scripts in scripts/tpu_vm/, never run. Reads the settings from the
# environment, parses --dry-run / --help, and runs commands after printing each of them on stderr
# (one line, shell-quoted, after "+ "); with --dry-run or DRY_RUN=1 it prints them and runs nothing.
# Written for bash 3.2 and later (macOS's /bin/bash too): no empty array is ever expanded.
# shellcheck shell=bash disable=SC2034  # (the settings are used by the scripts that source this)

TPU_NAME="${TPU_NAME:-}"
ZONE="${ZONE:-}"
PROJECT="${PROJECT:-}"
ACCELERATOR_TYPE="${ACCELERATOR_TYPE:-}"
RUNTIME_VERSION="${RUNTIME_VERSION:-}"
SPOT="${SPOT:-0}"
PREEMPTIBLE="${PREEMPTIBLE:-0}"
QUEUED="${QUEUED:-0}"
QR_ID="${QR_ID:-${TPU_NAME}-qr}"
BUCKET="${BUCKET:-}"
BUCKET="${BUCKET#gs://}" # a bucket name; gs://name is accepted too
BUCKET="${BUCKET%/}"
MOUNT="${MOUNT:-/mnt/gcs}"
MOUNT="${MOUNT%/}"
# The checkout on the workers: relative to the home directory (commands over ssh start there), or
# absolute. A leading ~/ is dropped, since it would be expanded here rather than on the workers.
REPO_DIR="${REPO_DIR:-gspo_jax}"
REPO_DIR="${REPO_DIR#\~/}"
DRY_RUN="${DRY_RUN:-0}"

SCRIPT="$(basename "$0")"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
ARGS=() # the arguments left after parse_args

die() { # a usage error: one line on stderr, exit code 2
  echo "$SCRIPT: error: $*" >&2
  exit 2
}

usage() { # the script's header comment, without the leading '# '
  awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"
}

parse_args() { # --dry-run and -h/--help anywhere before a lone --; everything else goes to ARGS
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --dry-run) DRY_RUN=1 ;;
      -h | --help)
        usage
        exit 0
        ;;
      --)
        shift
        while [[ $# -gt 0 ]]; do
          ARGS+=("$1")
          shift
        done
        break
        ;;
      *) ARGS+=("$1") ;;
    esac
    shift
  done
}

no_args() { # for scripts that take no arguments
  if [[ ${#ARGS[@]} -gt 0 ]]; then die "unexpected argument: ${ARGS[0]} (see --help)"; fi
}

is_on() { # is_on NAME: true when the variable NAME is 1, false when it is 0 or empty, else a usage error
  case "${!1:-0}" in
    1) return 0 ;;
    0) return 1 ;;
    *) die "$1=${!1}: expected 1 or 0" ;;
  esac
}

require() { # require NAME...: exits 2 naming every one of these variables that is empty
  local name missing=""
  for name in "$@"; do
    if [[ -z "${!name:-}" ]]; then missing="$missing $name"; fi
  done
  if [[ -n "$missing" ]]; then die "missing variable(s):$missing (set them in the environment; see --help)"; fi
}

quote() { # one word, shell-quoted only when it needs it
  local word="$1" escaped="'\\''"
  if [[ -n "$word" && "$word" != *[!A-Za-z0-9_./:=,@%+-]* ]]; then
    printf '%s' "$word"
  else
    printf "'%s'" "${word//\'/$escaped}"
  fi
}

quote_all() { # the words, each quoted, separated by spaces
  local word line=""
  for word in "$@"; do line="$line $(quote "$word")"; done
  printf '%s' "${line# }"
}

run() { # run COMMAND...: prints it, then runs it unless this is a dry run
  echo "+ $(quote_all "$@")" >&2
  if is_on DRY_RUN; then return 0; fi
  "$@"
}

tpus() { # tpus ARGS...: gcloud compute tpus ARGS... --zone ZONE [--project PROJECT]
  local cmd=(gcloud compute tpus "$@" --zone "$ZONE")
  if [[ -n "$PROJECT" ]]; then cmd+=(--project "$PROJECT"); fi
  run "${cmd[@]}"
}

on_workers() { # on_workers WORKER COMMAND: runs the shell command COMMAND on worker WORKER (a number, or all)
  tpus tpu-vm ssh "$TPU_NAME" --worker="$1" --command "$2"
}

# A shell condition, run on a worker inside $REPO_DIR: a trainer started by run.sh is alive there.
# shellcheck disable=SC2016  # expanded on the worker
TRAINER_ALIVE='pid=$(cat logs/train.pid 2>/dev/null); [ -n "$pid" ] && grep -qs train.py /proc/$pid/cmdline'

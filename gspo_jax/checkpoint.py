"""Checkpoints: an orbax `CheckpointManager` (current `args` API) that saves an array pytree plus a
JSON `meta` dict per step, resumes from the newest step that actually restores, and a SIGTERM guard
so a preempted run can save and exit at an iteration boundary.

Layout: `<directory>/<step>/{state,meta}` as orbax writes it; `<directory>/checksums/<step>.json`,
the sha256 of every file of a step, recorded once the step is complete and verified on restore (a
byte changed after the save fails the step like a truncated file would); steps that failed to
restore while an older one succeeded are moved (never deleted) to `<directory>/corrupt/<step>.<unix time>`.

What goes in `state`:
- Any pytree of arrays / numpy / Python scalars. `flax.nnx.State` (e.g. `nnx.state(model, nnx.Param)`)
  and optax states holding `nnx.State`s are saved as they are: orbax 0.12.8 flattens them with their
  registered pytree keys and `StandardRestore` rebuilds the exact `nnx.State` / `Param` structure from
  the abstract tree, so no `nnx.to_pure_dict` round trip is needed.
- A run's state is its `train.TrainState`; with `rollout.staleness` = k > 0, its fields beside the k
  lagged policies (`staleness.saved`), so `params` is a top-level key in every run's checkpoint.
- PRNG keys: pass `jax.random.key_data(key)` (uint32) and rebuild with `jax.random.wrap_key_data`.
  Orbax 0.12.8 happens to round-trip typed keys too, but raw key data is portable across orbax
  versions and PRNG implementations, so `save` refuses typed keys with an explicit error.

Multi-process: every process calls `save` / `restore_latest` (orbax writes each process's shards and
the JSON `meta` from process 0 only). `PreemptionGuard` sees only its own process's signals; the
trainer stops when any process has one (`multihost.any_process`, once per iteration), so every
process saves the same step.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import signal
import sys
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from gspo_jax.validation import ConfigError

log = logging.getLogger(__name__)

STATE_ITEM = "state"
META_ITEM = "meta"
CORRUPT_SUBDIR = "corrupt"
CHECKSUM_SUBDIR = "checksums"  # <step>.json: sha256 of every file of a finished step
# Orbax 0.12.8 writes this into every step directory as the last act of a save (both in its
# atomic-rename mode for local disks and its commit-file mode for GCS). Its own step listing only
# checks it on GCS, so we check it ourselves: a step without it was never finished.
_COMMIT_MARKER = "commit_success.txt"


class Checkpointer:
    """Saves `(state pytree, meta dict)` per step and restores the newest step that is intact.

    Saves are asynchronous by default: `save` returns once arrays are copied to host (donating them
    afterwards is safe) and writing continues in the background. `wait()` blocks until written;
    forced saves block before returning; normal interpreter exit also waits (see `_register_exit_wait`).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = 3,
        save_every: int = 1,
        async_save: bool = True,
        bridge=None,
    ):
        """`bridge` (`hosts.Bridge`, a split over hosts): arrays held by one side's processes are saved
        mirrored on both sides' devices and restored back onto their own side's."""
        self._bridge = bridge
        if save_every < 1:
            raise ValueError(f"save_every must be >= 1, got {save_every}")
        directory = os.fspath(directory)
        self.directory = epath.Path(directory if "://" in directory else os.path.abspath(directory))
        self.save_every = save_every
        async_save = async_save and _register_exit_wait(self)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True, enable_async_checkpointing=async_save
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=(STATE_ITEM, META_ITEM))
        self._closed = False

    # -- saving ---------------------------------------------------------------------------------

    def save(self, step: int, state: Any, meta: dict, *, force: bool = False) -> bool:
        """Saves `state` and `meta` as `step` if `step % save_every == 0` or `force`.

        Returns whether a save was started. Saving a step that already exists is a no-op (False);
        a step older than the newest one on disk is refused with a warning (orbax would never
        pick it as latest). With `force`, waits until the checkpoint is fully written.
        """
        step = int(step)
        _check_no_typed_keys(state)
        meta_json = json.loads(json.dumps(meta))  # fail here, not in a background thread
        if not force and step % self.save_every:
            return False
        self.wait()  # the previous save is complete (orbax would wait for it too): record its checksums
        steps = self._manager.all_steps()
        if step in steps:
            return False
        if steps and step < max(steps):
            log.warning("Not saving step %d: %s already holds newer step %d.", step, self.directory, max(steps))
            return False
        if self._bridge is not None:
            state = self._bridge.mirror(state)
        # force=True: the save_every decision above is the only one; orbax's own policy is bypassed.
        saved = self._manager.save(
            step,
            args=ocp.args.Composite(
                **{
                    STATE_ITEM: ocp.args.StandardSave(state),
                    META_ITEM: ocp.args.JsonSave(meta_json),
                }
            ),
            force=True,
        )
        if force:
            self.wait()
        return saved

    def wait(self) -> None:
        """Blocks until any in-flight asynchronous save is fully written, then records its checksums."""
        if not self._closed:
            self._manager.wait_until_finished()
            self._record_checksums()

    def close(self) -> None:
        """Waits for in-flight saves and releases orbax's resources; idempotent."""
        if not self._closed:
            self.wait()
            self._manager.close()
            self._closed = True

    # -- checksums ------------------------------------------------------------------------------

    def _checksum_path(self, step: int):
        return self.directory / CHECKSUM_SUBDIR / f"{step}.json"

    def _record_checksums(self) -> None:
        """sha256 of every file of each finished step that has none yet (process 0); drops the
        records of steps orbax has deleted."""
        if jax.process_index() != 0 or not self.directory.exists():
            return
        steps = set(self._manager.all_steps())
        for step in steps:
            path = self._checksum_path(step)
            if not path.exists() and (self.directory / str(step) / _COMMIT_MARKER).exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.parent / f"{step}.json.tmp"
                tmp.write_text(json.dumps(_file_digests(self.directory / str(step)), indent=0, sort_keys=True))
                tmp.rename(path)
        if (self.directory / CHECKSUM_SUBDIR).exists():
            for record in (self.directory / CHECKSUM_SUBDIR).glob("*.json"):
                if record.stem.isdigit() and int(record.stem) not in steps:
                    record.unlink()

    def _verify(self, step: int) -> None:
        """Raises if any file of `step` changed, appeared or vanished since its checksums were recorded."""
        path = self._checksum_path(step)
        if not path.exists():
            log.warning(
                "Checkpoint step %d has no checksum record (its run stopped before recording one); "
                "restoring it unverified.",
                step,
            )
            return
        recorded = json.loads(path.read_text())
        actual = _file_digests(self.directory / str(step))
        changed = sorted(f for f in set(recorded) | set(actual) if recorded.get(f) != actual.get(f))
        if changed:
            raise ValueError(f"step {step}: {len(changed)} file(s) changed since saved, e.g. {changed[0]}")

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- restoring ------------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Step numbers present in the directory (including ones that may not restore), ascending."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restores one step into `abstract_state`'s structure; raises if it is unfinished or corrupt.

        `abstract_state` has `jax.ShapeDtypeStruct` leaves (e.g. from `jax.eval_shape` or
        `nnx.eval_shape`); leaves with a `sharding` come back as arrays with that sharding.
        """
        if not (self.directory / str(step) / _COMMIT_MARKER).exists():
            raise FileNotFoundError(f"step {step} has no {_COMMIT_MARKER}: save never finished")
        self._verify(step)
        target = abstract_state if self._bridge is None else self._bridge.widen(abstract_state)
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                **{
                    STATE_ITEM: ocp.args.StandardRestore(target),
                    META_ITEM: ocp.args.JsonRestore(),
                }
            ),
        )
        meta = restored[META_ITEM]
        if not isinstance(meta, dict):
            raise ValueError(f"step {step}: meta is {type(meta).__name__}, not a dict")
        state = restored[STATE_ITEM]
        return (state if self._bridge is None else self._bridge.narrow(state, abstract_state)), meta

    def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict] | None:
        """Restores the newest step that restores cleanly: `(step, state, meta)`, or None.

        A step that raises (missing or garbled files, no commit marker) is logged and skipped in
        favour of the one before it. When an older step then restores, the newer failed steps are
        moved to `corrupt/` so that the resumed run can save those step numbers again; when nothing
        restores, nothing is moved (the failures may be a changed model, not corruption).
        """
        self.wait()
        failed = []
        for step in sorted(self._manager.all_steps(), reverse=True):
            try:
                state, meta = self.restore(step, abstract_state)
            except Exception as e:  # noqa: BLE001 - any failure means "try the previous step"
                log.warning(
                    "Checkpoint step %d in %s does not restore (%s: %s); trying an older step.",
                    step,
                    self.directory,
                    type(e).__name__,
                    _short(e),
                )
                failed.append(step)
                continue
            if failed:
                self._quarantine(failed)
            return step, state, meta
        if failed:
            log.error(
                "No checkpoint in %s restores (steps %s); starting fresh. Saves of steps "
                "<= %d will be refused until those directories are moved.",
                self.directory,
                sorted(failed),
                max(failed),
            )
        return None

    def _quarantine(self, steps: Iterable[int]) -> None:
        """Moves failed step directories aside (process 0), then re-reads the step list everywhere."""
        if jax.process_index() == 0:
            dest_root = self.directory / CORRUPT_SUBDIR
            dest_root.mkdir(parents=True, exist_ok=True)
            for step in steps:
                dest = dest_root / f"{step}.{int(time.time())}"
                try:
                    (self.directory / str(step)).rename(dest)
                    log.warning("Moved unrestorable checkpoint step %d to %s.", step, dest)
                except OSError as e:
                    log.error(
                        "Could not move step %d aside (%s); later saves of steps <= %d will be refused.", step, e, step
                    )
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("gspo_jax.checkpoint.quarantine")
        self._manager.reload()


class PreemptionGuard:
    """Context manager whose signal handler only sets `requested`; the loop polls it and saves.

    Handles SIGTERM (what TPU VMs and schedulers send before preemption) and, with `sigint=True`,
    Ctrl-C — a second Ctrl-C raises `KeyboardInterrupt` for an impatient user. Previous handlers
    are restored on exit. Outside the main thread (where handlers cannot be installed) it is inert.
    """

    def __init__(self, *, sigint: bool = False):
        self.signals = (signal.SIGTERM, signal.SIGINT) if sigint else (signal.SIGTERM,)
        self.requested = False
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.signum = signum

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is not threading.main_thread():
            log.warning("PreemptionGuard outside the main thread: signals will not be caught.")
            return self
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def threads_start_at_exit(version: tuple[int, ...] = tuple(sys.version_info[:3])) -> bool:
    """Whether this Python starts threads from `threading`'s exit hooks: CPython 3.12.0-3.12.2 refuse
    once interpreter exit has begun ("can't create new thread at interpreter shutdown", gh-113964,
    fixed in 3.12.3), and orbax's background writer starts threads to finish a save."""
    return not (3, 12) <= version < (3, 12, 3)


def _register_exit_wait(ckpt: Checkpointer) -> bool:
    """Makes interpreter exit wait for `ckpt`'s background save; False if that cannot be arranged.

    `atexit` is too late: orbax's background writer needs the executors that `threading._shutdown`
    stops before atexit callbacks run (the save then dies leaving only a tmp directory).
    `threading._register_atexit` callbacks run before that, in reverse registration order.
    """
    register = getattr(threading, "_register_atexit", None)
    if register is None or not threads_start_at_exit():
        why = "threading._register_atexit unavailable" if register is None else f"Python {sys.version.split()[0]}"
        log.warning("%s cannot finish a background save at exit: checkpoint saves are synchronous.", why)
        return False
    ref = weakref.ref(ckpt)

    def wait():
        if (c := ref()) is not None:
            c.wait()

    register(wait)
    return True


def _check_no_typed_keys(state: Any) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            raise TypeError(
                f"typed PRNG key at {jax.tree_util.keystr(path)}: save "
                "jax.random.key_data(key) and rebuild with jax.random.wrap_key_data"
            )


def _short(e: Exception, limit: int = 300) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return text if len(text) <= limit else text[:limit] + "..."


def _file_digests(step_dir) -> dict[str, str]:
    """{relative path: sha256} of every file under a step directory."""
    out = {}
    for path in sorted(pathlib.Path(os.fspath(step_dir)).rglob("*")):
        if path.is_file():
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda f=f: f.read(1 << 20), b""):
                    digest.update(block)
            out[str(path.relative_to(os.fspath(step_dir)))] = digest.hexdigest()
    return out


@jax.jit
def _leaf_sums(leaves):
    """Per leaf, its float32 sum and sum of magnitudes: a cheap fingerprint computed on the devices."""
    return [jnp.stack([jnp.sum(x.astype(jnp.float32)), jnp.sum(jnp.abs(x.astype(jnp.float32)))]) for x in leaves]


def base_identity(base, source: str) -> dict[str, str]:
    """A LoRA run's frozen base as its checkpoints record it: where it comes from (`source`) and a hash
    of its content (each leaf's path, shape, dtype and float32 sums, the sums to 7 significant digits so that a
    mesh that reorders a reduction still matches); the base never leaves the devices."""
    flat = jax.tree_util.tree_flatten_with_path(base)[0]
    sums = jax.device_get(_leaf_sums([x for _, x in flat]))
    rows = [
        [jax.tree_util.keystr(p), list(x.shape), str(x.dtype), *(f"{v:.6e}" for v in s)]
        for (p, x), s in zip(flat, sums)
    ]
    return dict(source=source, hash=hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16])


def check_base(saved: dict | None, current: dict) -> None:
    """Refuses, in one line, to resume a LoRA run's adapters on another base than they were trained on."""
    saved = saved or {}
    differ = [k for k in ("source", "hash") if saved.get(k) != current[k]]
    if differ:
        k = differ[0]
        raise ConfigError(
            f"checkpoint's LoRA base differs from this run's: {k} {saved.get(k)!r} there, {current[k]!r} here; "
            "resume on the same base (hf_checkpoint, warm start, base_dtype) or use a new workdir"
        )


class CheckpointMismatch(ConfigError):
    """The workdir has checkpoints but none restores into this run's state: training would never save."""


def resume(ckpt: Checkpointer, abstract: Any, prompts, with_meta: bool = False) -> tuple | None:
    """(first iteration to run, restored state[, its meta with `with_meta`]) from the newest good
    checkpoint of a run (its meta holds `iteration` and `prompts`, the prompt iterator's position), or
    None when the directory has none; restores `prompts` in place. Raises `CheckpointMismatch` when
    checkpoints exist but none restores: the run would never save."""
    restored = ckpt.restore_latest(abstract)
    if restored is None:
        if ckpt.all_steps():
            raise CheckpointMismatch(
                f"no checkpoint in {ckpt.directory} (steps {ckpt.all_steps()}) restores into this run's state: "
                "they hold another model or train state (another rollout.staleness or train.freeze_router), "
                "or are all corrupt; use a new workdir"
            )
        return None
    _, state, meta = restored
    prompts.restore(meta["prompts"])
    log.info("resumed from iteration %d", int(meta["iteration"]))
    return (int(meta["iteration"]) + 1, state) + ((meta,) if with_meta else ())

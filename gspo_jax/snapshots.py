"""A run's checkpoints as policy snapshots, read-only: the run's config and model, the steps whose
save finished, and the policy parameters of any of them (without the optimizer state).

Reading never writes to the workdir and takes no lock, so it works on a finished run and on one
that is still training (a step counts once orbax's commit marker is in it). Used by
`scripts/drift.py` (drift between snapshots) and `scripts/convert_hf.py --direction run2hf` (export).

Drift between snapshots: a `Probe` (fixed held-out prompts with completions sampled once by one
snapshot) is scored teacher-forced by every snapshot (`route`: its live router top-k and logits on the
completion tokens), then `drift_matrix` compares every pair with `routing.routing_drift`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from gspo_jax import built as built_lib
from gspo_jax import compiles, lora, routing
from gspo_jax import config as config_lib
from gspo_jax import model as model_lib
from gspo_jax import sharding as sharding_lib
from gspo_jax.checkpoint import _COMMIT_MARKER, STATE_ITEM
from gspo_jax.model_config import ModelConfig
from gspo_jax.sampler import Sampler, SamplerOptions, left_pad
from gspo_jax.tasks import load_tokenizer, prompt_iterator
from gspo_jax.validation import ConfigError
from gspo_jax.workdir import CONFIG_FILE

CHECKPOINT_DIR = "checkpoints"


@dataclasses.dataclass(frozen=True)
class Run:
    """What a workdir says about its policy: the config it was started with and its model."""

    workdir: Path
    config: ml_collections.ConfigDict
    model: ModelConfig
    graphdef: nnx.GraphDef
    abstract_params: nnx.State  # shapes and dtypes, no arrays


def _as_tuples(d):
    """JSON turned the config's tuples into lists; the config's fields want them back."""
    if isinstance(d, dict):
        return {k: _as_tuples(v) for k, v in d.items()}
    return tuple(_as_tuples(v) for v in d) if isinstance(d, list) else d


def _with_defaults(recorded: dict) -> dict:
    """The recorded config over this code's defaults for its algorithm: a key added since the run
    started (which the run did not have) takes its default, so older runs stay readable."""

    def merge(base, over):
        if not (isinstance(base, dict) and isinstance(over, dict)):
            return over
        return {**base, **{k: merge(base.get(k), v) for k, v in over.items()}}

    try:
        base = config_lib.base_config(recorded.get("algorithm", "")).to_dict()
    except ValueError:  # an algorithm this code does not know: build() will say so
        return recorded
    task = recorded.get("task")
    if isinstance(task, dict) and not isinstance(task.get(task.get("name")), dict):
        # Recorded before config.task had one section per task: the task's fields sat beside its name.
        fields = {k: v for k, v in task.items() if k != "name"}
        recorded = {**recorded, "task": {"name": task.get("name"), task.get("name"): fields}}
    return merge(base, recorded)


def build_here(config: ml_collections.ConfigDict) -> built_lib.Built:
    """`built_lib.build` with the mesh of this process's one device: the run's own mesh may need
    devices this machine lacks, and snapshots are read onto one device."""
    local = ml_collections.ConfigDict(config.to_dict())
    local.mesh = dict(data=1, fsdp=1, expert=1, tensor=1)
    return built_lib.build(local, device_count=len(jax.devices()))


def open_run(workdir: str | os.PathLike, adapters: bool = False) -> Run:
    """The run in `workdir` (its `config.json`), or ConfigError naming what is missing. Keys added to
    the config since the run started take their defaults; the recorded mesh is not checked against
    this machine's devices (snapshots are read onto one device). A LoRA run's checkpoints hold its
    adapters, not the policy: it opens only with `adapters` (its `abstract_params` the adapters')."""
    workdir = Path(workdir)
    path = workdir / CONFIG_FILE
    if not path.exists():
        raise ConfigError(f"{workdir} is not a run's workdir: it has no {CONFIG_FILE}")
    config = ml_collections.ConfigDict(_as_tuples(_with_defaults(json.loads(path.read_text()))))
    try:
        built = build_here(config)
    except ConfigError as e:
        raise ConfigError(f"{path} does not describe a run this code can read: {e}") from None
    if built.plan.lora and not adapters:  # the policy needs the base rebuilt: not supported yet
        raise ConfigError(
            f"{workdir} is a LoRA run (lora.rank={built.model.lora.rank}): its checkpoints hold the adapters, "
            "not the base, and reading them as snapshots (drift, export) is not supported yet; "
            "scripts/convert_hf.py --direction run2peft exports the adapters"
        )
    if adapters and not built.plan.lora:
        raise ConfigError(f"{workdir} is not a LoRA run (lora.rank=0): it has no adapters")
    graphdef, abstract = model_lib.abstract_model(built.model)
    return Run(workdir, config, built.model, graphdef, lora.split(abstract)[0] if adapters else abstract)


def steps(workdir: str | os.PathLike) -> list[int]:
    """Checkpointed steps whose save finished, ascending (a running run's in-flight save is not one)."""
    directory = Path(workdir) / CHECKPOINT_DIR
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and (p / _COMMIT_MARKER).exists())


def load_params(run: Run, step: int, sharding: jax.sharding.Sharding | None = None) -> nnx.State:
    """The policy parameters saved at `step` (its optimizer state is not read), on `sharding`
    (default: the first device)."""
    available = steps(run.workdir)
    if step not in available:
        raise ConfigError(f"step {step} is not a finished checkpoint of {run.workdir} (steps: {available or 'none'})")
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = sharding_lib.abstract(run.abstract_params, sharding)
    path = (run.workdir / CHECKPOINT_DIR / str(step) / STATE_ITEM).absolute()
    restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=sharding), target)
    with ocp.PyTreeCheckpointer() as checkpointer:
        restored = checkpointer.restore(
            path,
            args=ocp.args.PyTreeRestore(
                item={"params": target}, restore_args={"params": restore_args}, partial_restore=True
            ),
        )
    return restored["params"]


# ---------------------------------------------------------------------------------------------- drift
# The routing of several snapshots on one fixed probe set, and every pair's drift (`scripts/drift.py`).

PROBE_FILE = "probe.npz"
# ModelConfig fields that say how a model runs, not what its parameters mean: two snapshots that differ
# only in these route the same tokens the same way, so their drift is comparable.
RUNTIME_FIELDS = (
    "dispatch",
    "scan_layers",
    "remat",
    "logprob_chunk",
    "batch_chunks",
    "lb_loss_coef",
    "z_loss_coef",
    "dtype",
)


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """One checkpoint of one run, and how tables and plots name it."""

    run: Run
    step: int
    label: str


def select(run: Run, requested: Sequence[int] | None = None, *, minimum: int = 2) -> list[Snapshot]:
    """Snapshots of `run`'s finished steps (`requested` ones, or all), or ConfigError saying what is
    missing: a model without MoE layers, an unknown step, fewer than `minimum` steps."""
    check_moe(run)
    available = steps(run.workdir)
    chosen = available if requested is None else sorted(set(int(s) for s in requested))
    unknown = [s for s in chosen if s not in available]
    if unknown:
        finished = available or "none"
        raise ConfigError(f"step(s) {unknown} are not finished checkpoints of {run.workdir} (steps: {finished})")
    if len(chosen) < minimum:
        raise ConfigError(
            f"drift needs at least {minimum} finished checkpoints; {run.workdir} has {chosen or 'none'}"
            + ("" if requested is None else f" of the requested ones (finished: {available or 'none'})")
        )
    return [Snapshot(run, s, str(s)) for s in chosen]


def check_moe(run: Run) -> None:
    """ConfigError unless the run's policy has MoE layers (a dense model has no routing to compare)."""
    if run.model.num_moe_layers == 0:
        experts = run.model.num_experts
        raise ConfigError(f"{run.workdir}: the model has no MoE layers (num_experts={experts}): no routing to compare")


def check_comparable(a: Run, b: Run) -> None:
    """ConfigError unless `a` and `b` have one architecture and tokenizer (fields in `RUNTIME_FIELDS`
    aside): otherwise their routings of one probe set mean different things."""
    fa, fb = dataclasses.asdict(a.model), dataclasses.asdict(b.model)
    differ = [f"{k}: {fa[k]!r} vs {fb[k]!r}" for k in fa if k not in RUNTIME_FIELDS and fa[k] != fb[k]]
    if a.config.tokenizer_path != b.config.tokenizer_path:
        differ.append(f"tokenizer_path: {a.config.tokenizer_path!r} vs {b.config.tokenizer_path!r}")
    if differ:
        raise ConfigError(f"{a.workdir} and {b.workdir} hold different models: {'; '.join(differ)}")


@dataclasses.dataclass(frozen=True)
class Probe:
    """Fixed prompts and completions that every snapshot scores teacher-forced: the same tokens for all,
    so routing differences are the snapshots', not the data's. Rows are left-padded prompts then
    completions, as the sampler lays them out (T = prompt_len + max_new_tokens)."""

    tokens_BT: np.ndarray  # int32
    positions_BT: np.ndarray  # int32, -1 on padding
    completion_mask_BT: np.ndarray  # bool: the tokens drift is measured on
    meta: dict  # where it came from (workdir, step, seed, temperature, ...), JSON-able

    @property
    def num_tokens(self) -> int:
        """N, the completion tokens every routing holds."""
        return int(self.completion_mask_BT.sum())

    def save(self, path: str | os.PathLike) -> Path:
        """Writes the probe as an npz (no pickles) that `Probe.load` reads back."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            np.savez(
                f,
                tokens_BT=self.tokens_BT,
                positions_BT=self.positions_BT,
                completion_mask_BT=self.completion_mask_BT,
                meta=np.array(json.dumps(self.meta)),
            )
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> Probe:
        """A probe `save` wrote, or ConfigError saying why it is not one."""
        try:
            with np.load(path, allow_pickle=False) as z:
                probe = cls(
                    tokens_BT=z["tokens_BT"].astype(np.int32),
                    positions_BT=z["positions_BT"].astype(np.int32),
                    completion_mask_BT=z["completion_mask_BT"].astype(bool),
                    meta=json.loads(str(z["meta"])),
                )
        except (OSError, KeyError, ValueError) as e:
            raise ConfigError(f"{path} is not a probe file ({type(e).__name__}: {e})") from None
        shapes = {a.shape for a in (probe.tokens_BT, probe.positions_BT, probe.completion_mask_BT)}
        if len(shapes) != 1 or len(probe.tokens_BT.shape) != 2:
            raise ConfigError(f"{path}: tokens, positions and completion mask must be one [B, T] shape, got {shapes}")
        return probe

    def check_fits(self, run: Run) -> None:
        """ConfigError if `run`'s model cannot score these tokens, or there is nothing to measure."""
        if self.num_tokens == 0:
            raise ConfigError(f"the probe set ({self.meta.get('workdir')}) has no completion tokens")
        if int(self.tokens_BT.max()) >= run.model.vocab_size:
            raise ConfigError(
                f"the probe set has token id {int(self.tokens_BT.max())}, past {run.workdir}'s vocab_size="
                f"{run.model.vocab_size}: it was made for another model"
            )


def make_probe(
    run: Run,
    params: nnx.State,
    *,
    step: int,
    num_prompts: int,
    seed: int = 0,
    temperature: float | None = None,
    batch_size: int = 64,
) -> Probe:
    """`num_prompts` held-out prompts of the run's task (eval split, `seed`), each with one completion
    sampled by `params` (the snapshot at `step`) with a key from `seed`: at `temperature` (default the
    run's rollout temperature, with its top-k / top-p; 0 is greedy). Deterministic in its arguments."""
    c = run.config
    rollout = c.rollout
    temperature = float(rollout.temperature if temperature is None else temperature)
    if num_prompts < 1 or batch_size < 1 or temperature < 0:
        raise ConfigError(f"make_probe: num_prompts={num_prompts}, batch_size={batch_size} >= 1, temperature >= 0")
    built = build_here(c)
    tokenizer = load_tokenizer(c.tokenizer_path or None)
    examples = prompt_iterator(built.task, seed=seed, split="eval").next_batch(num_prompts)
    B = min(batch_size, num_prompts)
    examples += examples[-1:] * (-num_prompts % B)  # a whole last batch: one compile
    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    # A one-device mesh: its explicit shardings keep the sampler at one compile (without a mesh, its
    # first call, on a fresh KV cache, and later ones, on the donated cache, compile separately).
    mesh = sharding_lib.make_mesh(devices=jax.devices()[:1])
    options = SamplerOptions(compiler_options=compiles.step_options(c.get("cpu_fast_compile", True)))
    sampler = Sampler(
        run.graphdef, run.model, B, c.prompt_len, c.max_new_tokens, mesh=mesh, state=params, options=options
    )
    key = jax.random.key(seed)
    rows = []
    for i in range(0, len(examples), B):
        ids = [bos + tokenizer.encode(ex.prompt, add_special_tokens=False) for ex in examples[i : i + B]]
        prompts_BP, mask_BP = left_pad(ids, c.prompt_len, pad_id)
        out = sampler(
            params,
            prompts_BP,
            mask_BP,
            jax.random.fold_in(key, i // B),
            temperature=temperature,
            top_k=rollout.top_k,
            top_p=rollout.top_p,
            eos_ids=(tokenizer.eos_token_id,),
            pad_id=pad_id,
        )
        rows.append(jax.device_get((out.tokens, out.prompt_mask, out.completion_mask)))
    tokens_BT, prompt_mask_BT, completion_mask_BT = (np.concatenate(x)[:num_prompts] for x in zip(*rows))
    real_BT = prompt_mask_BT | completion_mask_BT
    positions_BT = np.where(real_BT, np.cumsum(real_BT, axis=1) - 1, -1).astype(np.int32)
    meta = dict(
        workdir=str(run.workdir),
        step=int(step),
        task=config_lib.task_settings(c),
        split="eval",
        seed=int(seed),
        num_prompts=int(num_prompts),
        temperature=temperature,
        top_k=int(rollout.top_k),
        top_p=float(rollout.top_p),
    )
    return Probe(tokens_BT.astype(np.int32), positions_BT, completion_mask_BT.astype(bool), meta)


class Routing(NamedTuple):
    """One snapshot's routing of a probe set's N completion tokens (row-major over the probe's
    completion mask), layer-major so that `routing.routing_drift` reads it as one sequence."""

    topk_LNK: np.ndarray  # int32: the experts each MoE layer chose
    logits_LNE: np.ndarray  # float32: the router's logits (router KL / TV)


def _route(graphdef: nnx.GraphDef, params: nnx.State, tokens_BT, positions_BT):
    """The live routing of a teacher-forced forward (no LM head): top-k [B, L, T, K], logits [B, L, T, E]."""
    model = nnx.merge(graphdef, params)

    def one(tokens_BT, positions_BT):
        _, aux = model.hidden(tokens_BT, positions_BT, return_router_logits=True)
        return aux.topk, aux.router_logits

    chunks = model.cfg.batch_chunks if tokens_BT.shape[0] % model.cfg.batch_chunks == 0 else 1
    return model_lib.in_batch_chunks(one, chunks, tokens_BT, positions_BT)


_route_jit = jax.jit(_route, static_argnums=0)


def route(run: Run, params: nnx.State, probe: Probe, *, batch_size: int = 64) -> Routing:
    """How `params` routes the probe's completion tokens, scored teacher-forced in batches of
    `batch_size` rows (the last one padded): one compile per model and batch size, whatever the step."""
    n = probe.tokens_BT.shape[0]
    B = min(batch_size, n)
    pad = lambda a: np.concatenate([a, np.repeat(a[-1:], -n % B, axis=0)])
    tokens_BT, positions_BT = pad(probe.tokens_BT), pad(probe.positions_BT)
    mask_BT = np.concatenate([probe.completion_mask_BT, np.zeros((-n % B, *probe.tokens_BT.shape[1:]), bool)])
    topk, logits = [], []
    for i in range(0, len(tokens_BT), B):
        rows = slice(i, i + B)
        topk_BLTK, logits_BLTE = jax.device_get(_route_jit(run.graphdef, params, tokens_BT[rows], positions_BT[rows]))
        m_BT = mask_BT[rows]
        topk.append(topk_BLTK.transpose(1, 0, 2, 3)[:, m_BT])  # [L, n, K]
        logits.append(logits_BLTE.transpose(1, 0, 2, 3)[:, m_BT])
    return Routing(np.concatenate(topk, axis=1).astype(np.int32), np.concatenate(logits, axis=1).astype(np.float32))


def route_snapshots(
    snapshots: Sequence[Snapshot], probe: Probe, *, batch_size: int = 64, on_skip=None
) -> tuple[list[Snapshot], list[Routing]]:
    """Each snapshot's `route` of the probe, one set of parameters in memory at a time. A step that
    vanished meanwhile (a running run's `keep_checkpoints` deleted it) is skipped, and `on_skip(snapshot,
    error)` told; any other failure raises."""
    kept, routings = [], []
    for snap in snapshots:
        try:
            params = load_params(snap.run, snap.step)
        except Exception as e:  # noqa: BLE001 - only a step that is gone now is skipped
            if snap.step in steps(snap.run.workdir):
                raise
            if on_skip is not None:
                on_skip(snap, e)
            continue
        routings.append(route(snap.run, params, probe, batch_size=batch_size))
        kept.append(snap)
        del params
    return kept, routings


_pair_drift = jax.jit(routing.routing_drift)


def drift_matrix(routings: Sequence[Routing]) -> dict[str, np.ndarray]:
    """`routing.routing_drift` of every ordered pair: metric[i, j] compares snapshot i (old) with j
    (new); scalars as [S, S], `flip_rate_per_layer` as [S, S, L]. All but router_kl (KL(p_i ‖ p_j))
    are symmetric; the diagonal is 0 (Jaccard 1). One compile: every routing has the probe's shape."""
    L, N, _ = routings[0].topk_LNK.shape
    valid_1N = jnp.ones((1, N), bool)
    dev = [(jnp.asarray(r.topk_LNK)[None], jnp.asarray(r.logits_LNE)[None]) for r in routings]
    rows = [[jax.device_get(_pair_drift(a[0], b[0], valid_1N, a[1], b[1])) for b in dev] for a in dev]
    return {k: np.array([[np.asarray(cell[k]) for cell in row] for row in rows]) for k in rows[0][0]}


def drift_report(snapshots: Sequence[Snapshot], matrix: dict[str, np.ndarray], probe: Probe) -> dict:
    """What `scripts/drift.py` writes as drift.json: the snapshots, the probe, every pair's metrics
    (`pairs[metric][i][j]`, i old, j new), and the curves from the first snapshot (the matrix's first
    row) and from the previous one (its first off-diagonal; null for the first snapshot)."""
    S = len(snapshots)
    previous = lambda m: [None] + [m[i - 1, i].tolist() for i in range(1, S)]
    return dict(
        snapshots=[dict(label=s.label, workdir=str(s.run.workdir), step=s.step) for s in snapshots],
        moe_layers=list(snapshots[0].run.model.moe_layer_ids),
        probe=dict(probe.meta, num_sequences=int(probe.tokens_BT.shape[0]), num_tokens=probe.num_tokens),
        pairs={k: m.tolist() for k, m in matrix.items()},
        from_first={k: m[0].tolist() for k, m in matrix.items()},
        from_previous={k: previous(m) for k, m in matrix.items()},
    )

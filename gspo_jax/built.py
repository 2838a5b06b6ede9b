"""The typed build of a config: `build()` turns a `config.base_config` ConfigDict into `Built`, its
validated sections and every setting derived from them (`Plan`), before any work starts.

`build` refuses at the door (a one-line `ConfigError`, exit 2 from scripts/train.py, nothing written)
whatever cannot work: a bad value or unknown field, a path that does not exist, a task whose train or
eval split would be empty, a prompt bucket (`prompt_len`) shorter than the task's longest prompt, a
mesh that does not divide the batches it splits. What a run decides from its settings (which replay
fields the batch carries, whether π_old's log-probs come from the update's own forward, whether a KL
reference is kept) is decided here once, in `Plan`; nothing downstream re-derives it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import ml_collections

from gspo_jax import algorithms, losses
from gspo_jax.config import as_json, optimizer_keys, warm_start_key
from gspo_jax.critic import CriticConfig
from gspo_jax.hf_config import config_from_hf
from gspo_jax.lora import LoraConfig, check_targets
from gspo_jax.mesh_config import MeshConfig, check_mesh, check_split
from gspo_jax.model_config import CONFIG_KEYS, ModelConfig
from gspo_jax.optimizer import OptimizerConfig
from gspo_jax.rollout import RolloutConfig
from gspo_jax.tasks import TASKS, check_fields, check_splits, load_tokenizer, make_task
from gspo_jax.trackers import LoggingConfig, logging_config
from gspo_jax.validation import ConfigError, check, check_choice, check_int

OLD_LOGP_SOURCES = ("sampler", "trainer")
# R2: π_old's routing recomputed by the trainer; R3: the sampler's expert ids; R3W: the sampler's ids and
# their combine weights (weight replay).
REPLAY = ("none", "R2", "R3", "R3W")
SAMPLER_ROUTING = ("R3", "R3W")  # the replays of the sampler's routing


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """`config.train` less its optimizer's keys: the RL loop's schedule and update split, where π_old's
    log-probs and routing come from, the routing instruments, evaluation and checkpoints."""

    num_iterations: int
    epochs: int
    minibatches: int
    microbatches: int
    microbatch_tokens: int  # 0: no bound (`resolve_microbatches`)
    old_logp_source: str  # OLD_LOGP_SOURCES
    routing_replay: str  # REPLAY
    drift_metrics: bool
    drift_subsample: int
    routing_diagnostics: bool
    eval_every: int
    eval_batches: int
    checkpoint_every: int
    keep_checkpoints: int

    def __post_init__(self):
        keys = ("num_iterations", "epochs", "minibatches", "microbatches", "drift_subsample", "eval_every")
        for key in (*keys, "checkpoint_every", "keep_checkpoints"):
            check_int("config", f"train.{key}", getattr(self, key))
        check_int("config", "train.microbatch_tokens", self.microbatch_tokens, low=0)
        check_int("config", "train.eval_batches", self.eval_batches)
        check_choice("config", "train.old_logp_source", self.old_logp_source, OLD_LOGP_SOURCES)
        check_choice("config", "train.routing_replay", self.routing_replay, REPLAY)
        for key in ("drift_metrics", "routing_diagnostics"):
            check(isinstance(getattr(self, key), bool), "config", f"train.{key}", getattr(self, key), "True or False")

    @property
    def updates(self) -> int:
        """Optimizer updates over the whole run (the schedule's length)."""
        return self.num_iterations * self.epochs * self.minibatches


@dataclasses.dataclass(frozen=True)
class WarmStartConfig:
    """`config.warm_start`: supervised steps on demonstrations before RL (0: none), their optimizer."""

    steps: int
    batch_size: int
    cache_dir: str  # "": the workdir
    optimizer: OptimizerConfig

    def __post_init__(self):
        if self.cache_dir:  # created on first use: it, or its parent, must be a directory already
            d = Path(self.cache_dir)
            ok = d.is_dir() or (not d.exists() and d.parent.is_dir())
            allowed = "a directory, or a new one in an existing directory"
            check(ok, "config", "warm_start.cache_dir", self.cache_dir, allowed)
        check_int("config", "warm_start.steps", self.steps, low=0)
        check_int("config", "warm_start.batch_size", self.batch_size)


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """The sampler's lengths: the prompt bucket (BOS + prompt) and the completion, in tokens."""

    prompt_len: int
    max_new_tokens: int

    def __post_init__(self):
        for key in ("prompt_len", "max_new_tokens"):
            check_int("config", key, getattr(self, key))

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.max_new_tokens


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a run decides from its sections, decided once by `build` and read from here downstream."""

    update_microbatches: int  # per update: train.microbatches, raised by train.microbatch_tokens
    sampler_routing: bool  # R3 / R3W: the update replays the sampler's routing
    weight_replay: bool  # R3W: the sampler records its combine weights and the batch carries them
    # π_old's log-probs (and routing) come from the update's own forward instead of a scoring pass
    # (`on_policy`), so the update is the only one on its batch and starts at π_old.
    on_policy: bool
    forces_routing: bool  # the update's forward routes with the batch's top-k (R3 / R3W; R2 off-policy)
    old_router: bool  # the batch carries π_old's router log-probs at its top-k (RSPO off the on-policy path)
    reference: bool  # a frozen π_ref is kept: a KL term in the loss, or in a critic's rewards
    scoring_temperature: float  # log-probs are scored at the sampling temperature
    lora: bool = False  # LoRA: the state trains adapters on a frozen base (`TrainState.frozen`)


def on_policy(train: TrainConfig, loss: losses.LossConfig, critic: CriticConfig | None, staleness: int) -> bool:
    """Whether π_old's log-probs can come from the update's own forward instead of a scoring pass:
    one update per batch (epochs = minibatches = 1), recomputed by the trainer, under the routing the
    update uses (live; R2 replays π_old's own routing, which the forward at π_old chooses anyway; R3
    replays the sampler's, and π_old is scored under it too), and no masked-IS correction (its mask
    changes the loss denominator, which must be known before the first micro-batch), and no KL
    penalty in a critic's rewards (GAE needs π_old's log-probs before the update), and no staleness
    (`rollout.staleness`: the update starts at today's policy, π_old is an older one)."""
    kl_reward = critic is not None and critic.kl_reward_coef > 0
    single = train.epochs * train.minibatches == 1 and staleness == 0
    return single and train.old_logp_source == "trainer" and loss.is_correction != "mis" and not kl_reward


def plan(
    train: TrainConfig,
    loss: losses.LossConfig,
    rollout: RolloutConfig,
    critic: CriticConfig | None,
    micro: int,
    lora: bool = False,
) -> Plan:
    """The run's derived settings (`Plan`) from its typed sections and resolved micro-batch count."""
    shared = on_policy(train, loss, critic, rollout.staleness)
    replay = train.routing_replay
    return Plan(
        update_microbatches=micro,
        sampler_routing=replay in SAMPLER_ROUTING,
        weight_replay=replay == "R3W",
        on_policy=shared,
        forces_routing=replay in SAMPLER_ROUTING or (replay == "R2" and not shared),
        old_router=loss.router_shift and not shared,
        reference=loss.kl_coef > 0 or (critic is not None and critic.kl_reward_coef > 0),
        scoring_temperature=float(rollout.temperature),
        lora=lora,
    )


@dataclasses.dataclass(frozen=True)
class Built:
    """The typed pieces of a config, all validated."""

    algorithm: str
    seed: int
    model: ModelConfig
    loss: losses.LossConfig
    rollout: RolloutConfig
    task: Any
    sampler: SamplerConfig
    train: TrainConfig
    optimizer: OptimizerConfig  # the policy's: `config.train`'s optimizer keys
    warm_start: WarmStartConfig
    mesh: MeshConfig  # the trainer's (and with no `rollout_mesh`, the sampler's too)
    rollout_mesh: MeshConfig | None  # the sampler's own mesh on `mesh.rollout_devices` devices, or None
    rollout_devices: int  # `mesh.rollout_devices`: the last devices, the sampler's (0: one mesh)
    critic: CriticConfig | None  # PPO's value model, its architecture resolved
    critic_optimizer: OptimizerConfig | None  # `config.critic`'s optimizer keys
    plan: Plan  # what the run decides from these sections, decided once (`plan`)
    hf_checkpoint: str  # "": a random init from `seed`
    tokenizer_path: str  # "": the built-in tokenizer
    cpu_fast_compile: bool  # XLA:CPU's fast-compile code generation for the step programs
    logging: LoggingConfig  # the trackers the run logs to besides its workdir (`trackers.py`)
    config_json: str  # the config built from (`as_json`): a workdir's config.json, what a resume must match
    warm_start_key: str  # the warm start's cache name (`warm_start_key`): runs that share it share the cache

    @property
    def batch_size(self) -> int:
        """Sequences per rollout: num_groups × group_size."""
        return self.rollout.num_groups * self.rollout.group_size


def _typed(name: str, cls, values: dict, keys: tuple[str, ...] | None = None):
    """`cls(**values)` with any error as one line prefixed by the config key (a `ConfigError` that
    names its key already, `config.<name>.…`, as it is). `keys`: the fields the section may hold
    (default: all of `cls`'s)."""
    fields = {f.name for f in dataclasses.fields(cls)} if keys is None else set(keys)
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ConfigError(f"config.{name}: unknown field(s) {unknown}; allowed: {sorted(fields)}")
    try:
        return cls(**values)
    except ConfigError as e:
        if str(e).startswith(f"config.{name}."):
            raise
        raise ConfigError(f"config.{name}: {e}") from None
    except (ValueError, TypeError) as e:
        raise ConfigError(f"config.{name}: {e}") from None


def build(config: ml_collections.ConfigDict, device_count: int | None = None) -> Built:
    """Validates the whole config and returns its typed pieces; raises `ConfigError` naming the key.
    The mesh is resolved against `device_count` devices (default: this runtime's, `jax.device_count()`,
    which a mesh over several processes must cover whole). What a run needs of the config itself (its
    JSON, its warm start's cache name) is taken here: nothing after the build reads the ConfigDict."""
    model_cfg = _model(config)
    lora = _lora(config, model_cfg)
    loss_cfg = _typed("loss", losses.LossConfig, dict(config.loss))
    rollout_cfg = _typed("rollout", RolloutConfig, dict(config.rollout))
    task = _task(config.task)
    sampler = SamplerConfig(prompt_len=config.prompt_len, max_new_tokens=config.max_new_tokens)
    train, optimizer = _with_optimizer("train", TrainConfig, dict(config.train))
    no_router = "False: the model has no MoE layer, so no router to freeze"
    check(not optimizer.freeze_router or model_cfg.num_moe_layers > 0, "config", "train.freeze_router", True, no_router)
    adapted = "False while lora.targets adapts the router (its adapter would move the routing it freezes)"
    check(not (optimizer.freeze_router and lora.adapts("router")), "config", "train.freeze_router", True, adapted)
    check(
        isinstance(config.cpu_fast_compile, bool),
        "config",
        "cpu_fast_compile",
        config.cpu_fast_compile,
        "True or False",
    )
    batch = rollout_cfg.num_groups * rollout_cfg.group_size
    _check_update_splits(batch, train)
    warm = _with_optimizer("warm_start", WarmStartConfig, dict(config.warm_start), nested=True)
    critic_cfg, critic_opt = _critic(config, model_cfg)
    no_critic = "0 with a critic (PPO): LoRA RL is critic-free"
    check(not (lora.on and critic_cfg), "config", "lora.rank", lora.rank, no_critic)
    experts = [("model", model_cfg)] + ([("critic.model", critic_cfg.model)] if critic_cfg else [])
    for key, m in experts[1:]:  # a separate critic scores the batch in its own chunks
        check(batch % m.batch_chunks == 0, "config", f"{key}.batch_chunks", m.batch_chunks, f"a divisor of {batch}")
    chunks = model_cfg.batch_chunks
    check(
        batch % (chunks * train.drift_subsample) == 0,
        "config",
        "model.batch_chunks",
        chunks,
        f"a divisor of num_groups×group_size={batch} (and of the drift batch, batch / train.drift_subsample)",
    )
    split = {  # every batch the data axes split; 0: not there, nothing to split
        "num_groups×group_size": batch,
        "a batch chunk (model.batch_chunks)": batch // chunks,
        "a critic batch chunk (critic.model.batch_chunks)": batch // critic_cfg.model.batch_chunks if critic_cfg else 0,
        "a micro-batch (train.minibatches, train.microbatches)": batch // (train.minibatches * train.microbatches),
        "a drift batch chunk (train.drift_subsample, model.batch_chunks)": batch // (train.drift_subsample * chunks),
        "warm_start.batch_size": warm.batch_size if warm.steps else 0,
    }
    devices = jax.device_count() if device_count is None else device_count
    processes = jax.process_count() if device_count is None else 1
    num_experts = {key: m.num_experts for key, m in experts if m.num_moe_layers}
    mesh_keys = dict(config.mesh)
    rollout_devices, rollout_axes = mesh_keys.pop("rollout_devices", 0), dict(mesh_keys.pop("rollout", {}))
    check_split(rollout_devices, devices, processes, rollout_cfg.staleness, lora.on)
    rollout_mesh = None
    if rollout_devices:  # the sampler's mesh: the batch it draws is all it splits
        rollout_mesh = check_mesh(
            _typed("mesh.rollout", MeshConfig, rollout_axes),
            split={"num_groups×group_size": batch},
            sampler_threads=rollout_cfg.sampler_threads,
            devices=rollout_devices,
            num_experts={"model": model_cfg.num_experts} if model_cfg.num_moe_layers else {},
            name="mesh.rollout",
        )
    mesh = check_mesh(
        _typed("mesh", MeshConfig, mesh_keys),
        split=split,
        sampler_threads=1 if rollout_devices else rollout_cfg.sampler_threads,
        devices=devices - rollout_devices,
        processes=processes,
        num_experts=num_experts,
    )
    if rollout_mesh is not None and processes > 1:  # a split over hosts moves arrays between like layouts
        same = rollout_mesh.axes() == mesh.axes()
        check(
            same,
            "config",
            "mesh.rollout",
            rollout_mesh.axes(),
            f"the trainer's axes {mesh.axes()} on several processes",
        )
    _check_lengths(config, task, model_cfg, loss_cfg)
    micro = resolve_microbatches(
        batch // train.minibatches,
        config.prompt_len + config.max_new_tokens,
        mesh.data_size,
        train.microbatches,
        train.microbatch_tokens,
    )
    return Built(
        algorithm=config.algorithm,
        seed=config.seed,
        model=dataclasses.replace(model_cfg, lora=lora),  # the policy's adapters; the critic has none
        loss=loss_cfg,
        rollout=rollout_cfg,
        task=task,
        sampler=sampler,
        train=train,
        optimizer=optimizer,
        warm_start=warm,
        mesh=mesh,
        rollout_mesh=rollout_mesh,
        rollout_devices=rollout_devices,
        critic=critic_cfg,
        critic_optimizer=critic_opt,
        plan=plan(train, loss_cfg, rollout_cfg, critic_cfg, micro, lora.on),
        hf_checkpoint=config.hf_checkpoint,
        tokenizer_path=config.tokenizer_path,
        cpu_fast_compile=config.cpu_fast_compile,
        logging=logging_config(config.get("logging", {})),
        config_json=as_json(config),
        warm_start_key=warm_start_key(config),
    )


def _check_update_splits(batch: int, train: TrainConfig) -> None:
    """The rollout's `batch` sequences against what the update splits it into: minibatches ×
    microbatches, and the drift measurement's subsample."""
    check(
        batch % (train.minibatches * train.microbatches) == 0,
        "config",
        "train.minibatches",
        train.minibatches,
        f"num_groups×group_size={batch} must be divisible by minibatches×microbatches",
    )
    check(
        batch % train.drift_subsample == 0,
        "config",
        "train.drift_subsample",
        train.drift_subsample,
        f"a divisor of num_groups×group_size={batch}",
    )


def _model(config: ml_collections.ConfigDict) -> ModelConfig:
    """`config.model` typed; with `hf_checkpoint`, the checkpoint's architecture and `config.model`'s
    choice of what Hugging Face does not describe. The local paths (`hf_checkpoint`, `tokenizer_path`)
    must exist: nothing is downloaded at run time."""
    m = dict(config.model)
    model_cfg = _typed("model", ModelConfig, m, CONFIG_KEYS)
    for key, what in (
        ("hf_checkpoint", "a local Hugging Face checkpoint directory"),
        ("tokenizer_path", "a local tokenizer.json or directory"),
    ):
        if config[key]:  # nothing is downloaded at run time: a path must exist
            check(Path(config[key]).exists(), "config", key, config[key], f"{what} that exists (nothing is downloaded)")
    if config.hf_checkpoint:
        # The checkpoint fixes the architecture; config.model still picks what HF does not describe.
        keep = ("dispatch", "param_dtype", "dtype", "lb_loss_coef", "z_loss_coef")
        keep += ("scan_layers", "remat", "logprob_chunk", "batch_chunks")  # how the model runs
        try:
            model_cfg = config_from_hf(config.hf_checkpoint, **{k: getattr(model_cfg, k) for k in keep})
        except (OSError, ValueError) as e:
            raise ConfigError(f"config.hf_checkpoint={config.hf_checkpoint!r}: {e}") from None
    return model_cfg


def _lora(config: ml_collections.ConfigDict, model_cfg: ModelConfig) -> LoraConfig:
    """`config.lora` typed (rank 0, LoRA off, where a config has no such section), its targets checked
    against the model: "experts" and "router" only where it has an MoE layer."""
    lora = _typed("lora", LoraConfig, dict(config.get("lora", {})))
    check_targets(lora, model_cfg.num_moe_layers > 0)
    return lora


def _check_lengths(
    config: ml_collections.ConfigDict, task: Any, model_cfg: ModelConfig, loss_cfg: losses.LossConfig
) -> None:
    """What the lengths must hold: the prompt bucket the task's longest prompt (tokenized as the run
    will), the vocabulary the built-in tokenizer's, Dr.GRPO's constant the max completion length."""
    tokenizer = load_tokenizer(config.tokenizer_path or None)
    bos = 0 if tokenizer.bos_token_id is None else 1
    longest = bos + task.max_prompt_tokens(lambda text: tokenizer.encode(text, add_special_tokens=False))
    check(
        longest <= config.prompt_len,
        "config",
        "prompt_len",
        config.prompt_len,
        f"the prompt bucket must hold the longest prompt of task {task.name!r}: {longest} tokens (BOS included)",
    )
    check(
        model_cfg.vocab_size >= 128 or bool(config.tokenizer_path),
        "config",
        "model.vocab_size",
        model_cfg.vocab_size,
        "the built-in tokenizer needs vocab_size >= 128",
    )
    if loss_cfg.aggregation == "seq_mean_token_sum_norm":
        check(
            loss_cfg.sum_norm_len == float(config.max_new_tokens),
            "config",
            "loss.sum_norm_len",
            loss_cfg.sum_norm_len,
            f"Dr.GRPO normalises by the max completion length, max_new_tokens={config.max_new_tokens}",
        )


def _with_optimizer(name: str, cls, section: dict, nested: bool = False):
    """`config.<name>` as `cls` and the `OptimizerConfig` of its optimizer keys: (typed, optimizer),
    or with `nested` one `cls` holding it as its `optimizer` field."""
    optimizer = OptimizerConfig.from_config(section, f"config.{name}")
    rest = {k: v for k, v in section.items() if k not in optimizer_keys(learning_rate=1.0, freeze_router=False)}
    if nested:
        return _typed(name, cls, {**rest, "optimizer": optimizer})
    return _typed(name, cls, rest), optimizer


def _task(section: ml_collections.ConfigDict):
    """The task `config.task` names, built from its section; every section's fields checked, and the
    task's train and eval splits checked non-empty (`tasks.check_splits`)."""
    name = section.get("name")
    check_choice("config", "task.name", name, sorted(TASKS))
    stray = sorted(set(section) - {"name"} - set(TASKS))
    if stray:
        raise ConfigError(
            f"config.task: unknown key(s) {stray}; it holds `name` and one section per task, {sorted(TASKS)}, "
            f"each with that task's fields (e.g. config.task.{name}.{stray[0]})"
        )
    for n in TASKS:  # every section: a misspelt field is refused even where another task runs
        try:
            check_fields(n, section.get(n, {}))
        except ConfigError as e:
            raise ConfigError(f"config.task.{n}: {e}") from None
    try:
        task = make_task(name, **dict(section.get(name, {})))
        check_splits(task)
    except ValueError as e:  # ConfigError included; one line, prefixed with the section
        raise ConfigError(f"config.task.{name}: {str(e).splitlines()[0]}") from None
    return task


def resolve_microbatches(rows: int, seq_len: int, data: int, at_least: int, max_tokens: int) -> int:
    """How many micro-batches an update of `rows` sequences of `seq_len` tokens runs: the fewest, from
    `at_least` (`train.microbatches`) up, that split the rows evenly over the `data` devices and hold at
    most `max_tokens` tokens per device (0: no bound); the finest such split where none does.

    On CPU the bound is also speed: XLA maps a step's temporaries afresh for every call, and where a
    VM's host takes freed memory back, each call faults them in again (docs/BENCHMARKS.md)."""
    counts = [m for m in range(at_least, rows + 1) if rows % m == 0 and rows // m % data == 0]
    if not counts:  # no count splits the rows over the devices: `build` has refused such a config already
        return at_least
    fits = [m for m in counts if max_tokens == 0 or rows // m // data * seq_len <= max_tokens]
    return fits[0] if fits else counts[-1]


def _critic(
    config: ml_collections.ConfigDict, policy: ModelConfig
) -> tuple[CriticConfig | None, OptimizerConfig | None]:
    """`config.critic` typed, its trunk's architecture resolved (the policy's, or `critic.model`), and
    its optimizer; (None, None) without a critic."""
    has = "critic" in config
    needs = algorithms.get(config.algorithm).critic
    check(
        has == needs,
        "config",
        "critic",
        "present" if has else "absent",
        f"a section exactly when the algorithm has a critic ({config.algorithm}: {needs})",
    )
    if not has:
        return None, None
    section = dict(config.critic)
    opt = OptimizerConfig.from_config(section, "config.critic")
    fields = {f.name for f in dataclasses.fields(CriticConfig)} | {f.name for f in dataclasses.fields(opt) if f.compare}
    unknown = sorted(set(section) - fields)
    if unknown:
        raise ConfigError(f"config.critic: unknown field(s) {unknown}; allowed: {sorted(fields)}")
    model = policy
    if section.get("trunk") == "separate":
        model = _typed("critic.model", ModelConfig, dict(section["model"]), CONFIG_KEYS)
        check(
            model.vocab_size == policy.vocab_size,
            "config",
            "critic.model.vocab_size",
            model.vocab_size,
            f"the policy's, {policy.vocab_size} (the critic reads the same tokens)",
        )
    keys = {f.name for f in dataclasses.fields(CriticConfig)} - {"model"}
    critic = _typed("critic", CriticConfig, {**{k: section[k] for k in keys if k in section}, "model": model})
    return critic, opt

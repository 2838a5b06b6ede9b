"""LoRA on the policy (gspo_jax/lora.py): the `config.lora` keys and their refusals, rank 0 changing
nothing, the adapters starting as the base exactly, and the unmerged forward and its gradients equal to
the merged-weight reference, on one device and sharded. The experts' dispatch paths with adapters are
tests/test_lora_experts.py's; here the experts run on the "dense" reference (and "auto" at init)."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gspo_jax import built, config, hf_config, lora, model, model_config, sharding
from gspo_jax.lora import LoraConfig
from gspo_jax.validation import ConfigError

ALL = ("attention", "mlp", "experts", "router")
B, T = 4, 10


def tiny(**lora_values) -> model_config.ModelConfig:
    """The tiny MoE (layer 0 dense, layers 1-2 MoE) on the dense experts path, with `lora_values`."""
    cfg = model_config.get("tiny", dispatch="dense")
    return dataclasses.replace(cfg, lora=LoraConfig(**lora_values)) if lora_values else cfg


def inputs(seed: int = 1):
    tokens_BT = jax.random.randint(jax.random.key(seed), (B, T), 0, 128)
    positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return tokens_BT, positions_BT


@functools.cache
def logprobs_fn(graphdef):
    return jax.jit(functools.partial(model.logprobs, graphdef))


def logp(graphdef, state, seed: int = 1):
    return logprobs_fn(graphdef)(state, *inputs(seed))[0]


def random_state(cfg: model_config.ModelConfig):
    """(graphdef, a state of `cfg`'s shapes drawn by NumPy, B included): no init program to compile.
    Norm scales 1, embeddings unit normal, every other weight normal with std 0.1."""
    graphdef, abstract = model.abstract_model(cfg)
    rng = np.random.default_rng(1)

    def draw(path, v):
        shape, dtype = v.get_value().shape, v.get_value().dtype
        if path[-1] == "scale":
            return v.replace(jnp.ones(shape, dtype))
        std = 1.0 if path[-1] == "embed_tokens" else 0.1
        return v.replace(jnp.asarray(std * rng.standard_normal(shape), dtype))

    return graphdef, nnx.from_flat_state([(path, draw(path, v)) for path, v in nnx.to_flat_state(abstract)])


# ------------------------------------------------------------------ config keys


def test_config_lora_section_defaults_and_warm_start_key():
    cfg = config.base_config("grpo", "tiny")
    assert dict(cfg.lora) == dict(rank=0, alpha=32.0, targets=("attention", "mlp", "experts"), base_dtype="")
    assert "lora" not in cfg.model  # set from its own section, not a `config.model` key
    assert config.missing_key(cfg, "model.lora") is not None
    # Existing configs keep their warm-start caches (the keys `config.warm_start_key` gave before LoRA).
    assert config.warm_start_key(cfg) == "89fcc6fc4511"
    assert config.warm_start_key(config.base_config("gspo", "default")) == "e53370da169d"
    cfg.lora.update(rank=8, alpha=16.0, targets=("attention", "router"))
    assert config.warm_start_key(cfg) == "89fcc6fc4511"


def test_build_types_the_section_onto_the_model():
    cfg = config.base_config("grpo", "tiny")
    assert built.build(cfg).model.lora == LoraConfig()
    cfg.lora.update(rank=4, alpha=8.0, targets=("mlp", "router"), base_dtype="bfloat16")
    b = built.build(cfg)
    assert b.model.lora == LoraConfig(rank=4, alpha=8.0, targets=("mlp", "router"), base_dtype="bfloat16")
    assert b.model.lora.scale == 2.0 and b.model.jnp_param_dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "key, value, allowed",
    [
        ("rank", -1, "it must be an int >= 0"),
        ("alpha", 0.0, "it must be a finite number > 0.0"),
        ("targets", ("attention", "ffn"), "('attention', 'mlp', 'experts', 'router')"),
        ("targets", (), "('attention', 'mlp', 'experts', 'router')"),
        ("base_dtype", "float16", "('', 'float32', 'bfloat16')"),
    ],
)
def test_bad_lora_keys_are_refused_in_one_line(key, value, allowed):
    cfg = config.base_config("grpo", "tiny")
    cfg.lora.rank = 4
    cfg.lora[key] = value
    with pytest.raises(ConfigError) as e:
        built.build(cfg)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"config.lora.{key}=") and allowed in message


@pytest.mark.parametrize("target", ["experts", "router"])
def test_a_target_the_model_cannot_have_is_refused(target):
    cfg = config.base_config("grpo", "tiny")
    cfg.model.update(num_experts=0)
    cfg.lora.update(rank=4, targets=("attention", target))
    with pytest.raises(ConfigError) as e:
        built.build(cfg)
    message = str(e.value)
    assert "\n" not in message and message.startswith("config.lora.targets=")
    assert "choose from ('attention', 'mlp')" in message
    cfg.lora.rank = 0  # off: targets are not read
    assert built.build(cfg).model.lora.rank == 0


def test_a_frozen_router_with_a_router_adapter_is_refused():
    """`train.freeze_router` freezes the router's weights; an adapter on them would still move the routing."""
    cfg = config.base_config("grpo", "tiny")
    cfg.train.freeze_router = True
    cfg.lora.update(rank=4, targets=("attention", "router"))
    with pytest.raises(ConfigError) as e:
        built.build(cfg)
    message = str(e.value)
    assert "\n" not in message and message.startswith("config.train.freeze_router=True") and "router" in message
    cfg.lora.targets = ("attention", "experts")  # the router frozen, adapters elsewhere: a run
    assert built.build(cfg).optimizer.freeze_router


def test_hf_config_ignores_lora():
    cfg = tiny(rank=4, targets=ALL)
    assert hf_config.config_to_hf(cfg) == hf_config.config_to_hf(tiny())
    assert hf_config.exportable_config(cfg) == hf_config.exportable_config(tiny())


def test_model_config_reads_back_from_json_with_its_adapters():
    """As scripts/convert_hf.py writes and reads a model_config.json (`dataclasses.asdict`)."""
    for cfg in (tiny(), tiny(rank=2, alpha=4.0, targets=("mlp", "router"))):
        assert model_config.ModelConfig(**json.loads(json.dumps(dataclasses.asdict(cfg)))) == cfg


# ------------------------------------------------------------------ rank 0: nothing changes


def test_rank_0_is_the_model_it_was():
    graphdef, state = model.abstract_model(model_config.get("tiny"))
    assert not jax.tree.leaves(lora.split(state)[0])
    assert all(type(v) is nnx.Param for v in jax.tree.leaves(state, is_leaf=sharding.is_variable))
    assert len(jax.tree.leaves(state)) == 26
    assert model.count_params(model_config.get("tiny")) == (177_696, 103_968)  # as before LoRA
    # rank 0 with other settings: the same graph and tree.
    off = dataclasses.replace(model_config.get("tiny"), lora=LoraConfig(rank=0, alpha=4.0, targets=ALL))
    graphdef_off, state_off = model.abstract_model(off)
    assert jax.tree.structure(state_off) == jax.tree.structure(state)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), state_off) == jax.tree.map(lambda a: (a.shape, a.dtype), state)


# ------------------------------------------------------------------ adapters


def test_adapters_have_the_shapes_axes_and_types_asked_for():
    adapters, _ = lora.split(model.abstract_model(tiny(rank=4, alpha=8.0, targets=ALL))[1])
    moe = adapters["stacks"][1]["layer"]["mlp"]
    n, E, D, F = 2, 8, 64, 32
    assert moe["gate_proj_lora"]["a"].get_value().shape == (n, E, D, 4)
    assert moe["gate_proj_lora"]["b"].get_metadata()["out_sharding"] == ("layers", "expert", "lora", "mlp")
    assert moe["down_proj_lora"]["a"].get_value().shape == (n, E, F, 4)
    assert moe["down_proj_lora"]["b"].get_value().shape == (n, E, 4, D)
    assert moe["router_lora"]["b"].get_value().shape == (n, 4, E)
    attn = adapters["stacks"][0]["layer"]["self_attn"]
    assert attn["q_proj_lora"]["b"].get_value().shape == (1, 4, 4, 16)  # [layers, R, H, W]
    assert attn["o_proj_lora"]["a"].get_value().shape == (1, 4, 16, 4)  # [layers, H, W, R]
    assert set(adapters["stacks"][0]["layer"]["mlp"]) == {"gate_proj_lora", "up_proj_lora", "down_proj_lora"}
    for v in jax.tree.leaves(adapters, is_leaf=sharding.is_variable):
        assert type(v) is nnx.LoRAParam and v.get_value().dtype == jnp.float32
    only_mlp, _ = lora.split(model.abstract_model(tiny(rank=2, targets=("mlp",)))[1])
    assert {p[-2] for p, _ in nnx.to_flat_state(only_mlp)} == {"gate_proj_lora", "up_proj_lora", "down_proj_lora"}
    assert len(jax.tree.leaves(only_mlp)) == 6  # the dense layer's only: experts are not "mlp"


@pytest.mark.slow  # two init programs to compile
def test_init_draws_a_fan_in_normal_and_b_zero_and_leaves_the_base_as_it_was():
    adapters, base = lora.split(model.init(tiny(rank=4, alpha=8.0, targets=ALL), 0)[1])
    _, plain = model.init(tiny(), 0)
    # The base is the model without adapters, bit for bit (the adapters draw from a stream of their own).
    jax.tree.map(np.testing.assert_array_equal, base, plain)
    for path, v in nnx.to_flat_state(adapters):
        x = np.asarray(v.get_value())
        if path[-1] == "b":
            assert not x.any()
        else:  # normal, std 1/√fan-in
            fan_in = np.prod(x.shape[-3:-1]) if path[-2] == "o_proj_lora" else x.shape[-2]
            assert abs(x.std() * np.sqrt(fan_in) - 1) < 0.25, path


@pytest.mark.parametrize("dispatch", ["dense", pytest.param("auto", marks=pytest.mark.slow)])
def test_with_b_zero_the_adapted_policy_is_the_base_bitwise(dispatch):
    """B = 0, as at init: the log-probs are the base's (the same parameters without adapters) bit for bit."""
    cfg = dataclasses.replace(tiny(rank=4, alpha=8.0, targets=ALL), dispatch=dispatch)  # auto: sparse on CPU
    graphdef, state = random_state(cfg)
    zero_b = [(p, v.replace(jnp.zeros_like(v.get_value())) if p[-1] == "b" else v) for p, v in nnx.to_flat_state(state)]
    state = nnx.from_flat_state(zero_b)
    base_graphdef, _ = model.abstract_model(dataclasses.replace(cfg, lora=LoraConfig()))
    np.testing.assert_array_equal(logp(graphdef, state), logp(base_graphdef, lora.split(state)[1]))


@pytest.mark.parametrize(
    "targets",
    [ALL] + [pytest.param((t,), marks=pytest.mark.slow) for t in ALL],  # one compile each; ALL holds them together
)
def test_forward_equals_the_merged_reference(targets):
    cfg = tiny(rank=4, alpha=8.0, targets=targets)
    graphdef, state = random_state(cfg)
    merged_cfg, merged_state = lora.merged(cfg, state)
    assert merged_cfg.lora == LoraConfig() and not jax.tree.leaves(lora.split(merged_state)[0])
    merged_graphdef, _ = model.abstract_model(merged_cfg)
    adapted = logp(graphdef, state)
    base = logp(merged_graphdef, lora.split(state)[1])
    assert float(jnp.abs(adapted - base).max()) > 1e-2  # the adapters do change the policy
    np.testing.assert_allclose(adapted, logp(merged_graphdef, merged_state), atol=2e-5, rtol=1e-5)


def test_merged_leaves_its_input_alone():
    cfg = tiny(rank=4, alpha=8.0, targets=ALL)
    state = random_state(cfg)[1]
    before = jax.tree.map(np.asarray, state)
    lora.merged(cfg, state)
    jax.tree.map(np.testing.assert_array_equal, state, before)


@pytest.mark.slow  # two backward passes to compile
def test_adapter_gradients_equal_the_merged_references():
    """d/dA, d/dB of a loss on the unmerged forward = those through W + (α/r)·A·B (chain rule)."""
    cfg = tiny(rank=4, alpha=8.0, targets=ALL)
    graphdef, state = random_state(cfg)
    adapters, base = lora.split(state)
    merged_cfg = dataclasses.replace(cfg, lora=LoraConfig())
    merged_graphdef, _ = model.abstract_model(merged_cfg)
    tokens_BT, positions_BT = inputs()
    w_BT = jax.random.normal(jax.random.key(7), (B, T))

    def loss(adapters, merge: bool):
        whole = lora.union(base, adapters)
        if merge:
            return jnp.sum(
                w_BT * model.logprobs(merged_graphdef, lora.merged(cfg, whole)[1], tokens_BT, positions_BT)[0]
            )
        return jnp.sum(w_BT * model.logprobs(graphdef, whole, tokens_BT, positions_BT)[0])

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    unmerged, reference = grad(adapters, False), grad(adapters, True)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(reference))
    assert scale > 0
    for (path, g), (_, r) in zip(nnx.to_flat_state(unmerged), nnx.to_flat_state(reference)):
        np.testing.assert_allclose(g.get_value(), r.get_value(), atol=1e-4 * scale, rtol=1e-3, err_msg=str(path))


def test_sharded_adapted_forward_equals_unsharded():
    cfg = tiny(rank=4, alpha=8.0, targets=ALL)
    graphdef, state = random_state(cfg)
    expected = logp(graphdef, state)
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    shardings = sharding.param_shardings(mesh, state)
    b = lora.split(shardings)[0]["stacks"][1]["layer"]["mlp"]["gate_proj_lora"]["b"]
    # [layers, E, R, F]: the rank split over fsdp, as the weight's D is (else B sits whole on every chip)
    assert b.get_value().spec == jax.sharding.PartitionSpec(None, "expert", "fsdp", "tensor")
    a = lora.split(shardings)[0]["stacks"][0]["layer"]["self_attn"]["q_proj_lora"]["a"]
    assert a.get_value().spec == jax.sharding.PartitionSpec(None, "fsdp", None)  # [layers, D, R]: fsdp taken by D
    batch = sharding.batch_sharding(mesh, 2)
    tokens_BT, positions_BT = (jax.device_put(x, batch) for x in inputs())
    fn = jax.jit(sharding.under_mesh(functools.partial(model.logprobs, graphdef), mesh))
    got = fn(jax.device_put(state, shardings), tokens_BT, positions_BT)[0]
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.slow  # a prefill and a decode step to compile
def test_prefill_then_decode_with_adapters_matches_the_full_forward():
    """The sampler's path: the adapters act on the KV-cache forward (each layer sliced from its stack) as
    on the full one."""
    cfg = tiny(rank=4, alpha=8.0, targets=ALL)
    graphdef, state = random_state(cfg)
    tokens_BT, positions_BT = inputs()
    apply = jax.jit(functools.partial(model.apply, graphdef))
    full_BTV = apply(state, tokens_BT, positions_BT)[0]
    P = 6
    logits, aux = apply(state, tokens_BT[:, :P], positions_BT[:, :P], model.init_cache(cfg, B, T))
    np.testing.assert_allclose(logits, full_BTV[:, :P], atol=2e-5, rtol=1e-5)
    for t in range(P, T):
        logits, aux = apply(state, tokens_BT[:, t : t + 1], positions_BT[:, t : t + 1], aux.cache)
        np.testing.assert_allclose(logits[:, 0], full_BTV[:, t], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("given", [("attention,experts",), ("attention", " experts")])
def test_targets_as_the_command_line_gives_them(given):
    """`--config.lora.targets=attention,experts` reaches the config as a tuple holding the string."""
    cfg = config.base_config("grpo", "tiny")
    cfg.lora.update(rank=4, targets=given)
    assert built.build(cfg).model.lora.targets == ("attention", "experts")


def test_train_flops_leave_out_the_frozen_bases_weight_gradients():
    """By hand: a LoRA step is 6 × adapter + 4 × base matmul parameters per token, plus three forwards'
    attention; the forward counts the adapters' matmuls too (x·A, then ·B, routed tokens only)."""
    from gspo_jax import flops

    off, on = tiny(), tiny(rank=4, targets=ALL)
    B, T = 2, 16
    base, adapters = flops.matmul_params(off), flops.matmul_params(on) - flops.matmul_params(off)
    attention = 4 * on.num_layers * B * T * T * on.num_heads * on.head_dim
    assert adapters > 0
    assert flops.forward_flops(on, B, T) == 2 * (base + adapters) * B * T + attention
    assert flops.train_flops(on, B, T) == (4 * base + 6 * adapters) * B * T + 3 * attention
    assert flops.train_flops(off, B, T) == 6 * base * B * T + 3 * attention

"""Records what PEFT makes of our LoRA export, for tests/test_lora_peft.py (CI reads the output only).

Usage (by hand; needs torch and peft):
    pip install torch==2.13.0 peft   # the CPU build is enough
    python scripts/make_peft_fixture.py [--out tests/fixtures]

For each tiny Hugging Face fixture (tests/fixtures/qwen3_moe_tiny, qwen3_moe_tiny_dense0 for a dense layer,
mixtral_tiny) it draws LoRA adapters on every target (attention, dense MLP, experts, router; B non-zero, so
they move the logits), writes them in our layout (`adapters.npz`) and in PEFT's format through
`gspo_jax.hf_lora.save_peft_adapter`, loads that directory with `peft.PeftModel.from_pretrained` onto
transformers' model of the fixture, and records its logits on the fixture's input ids (`expected.npz`),
checking them against ours first.
"""

import argparse
import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from gspo_jax import hf, hf_lora, lora
from gspo_jax import model as model_lib
from gspo_jax.lora import LoraConfig

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
SOURCES = {"qwen3_moe_tiny": "qwen3_moe", "qwen3_moe_tiny_dense0": "qwen3_moe", "mixtral_tiny": "mixtral"}
LORA = LoraConfig(rank=4, alpha=8.0, targets=lora.TARGETS)
SEED = 0
TOLERANCE = 1e-4


def adapted_state(name: str, adapters: dict | None = None):
    """(cfg with LoRA on, graphdef, the fixture's weights with `adapters` (per "/"-joined path; drawn
    from SEED when None: A and B ~ N(0, 0.2²)))."""
    cfg, _, base = hf.load_hf_checkpoint(FIXTURES / name)
    cfg = dataclasses.replace(cfg, lora=LORA)
    graphdef, abstract = model_lib.abstract_model(cfg)
    ours, _ = lora.split(abstract)
    rng = np.random.default_rng(SEED)
    drawn = {}
    for path, v in ours.flat_state():
        key, shape = "/".join(map(str, path)), v.get_value().shape
        drawn[key] = adapters[key] if adapters is not None else (0.2 * rng.standard_normal(shape)).astype(np.float32)
    filled = nnx_state(ours, drawn)
    return cfg, graphdef, lora.union(base, filled), drawn


def nnx_state(abstract, arrays: dict):
    return jax.tree_util.tree_map_with_path(
        lambda p, v: v.replace(jnp.asarray(arrays["/".join(str(k.key) for k in p)])),
        abstract,
        is_leaf=lambda x: hasattr(x, "get_value"),
    )


def our_logits(graphdef, state, input_ids: np.ndarray) -> np.ndarray:
    ids = jnp.asarray(input_ids, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    return np.asarray(model_lib.apply(graphdef, state, ids, positions)[0], np.float32)


def peft_logits(source: Path, adapter_dir: Path, input_ids: np.ndarray) -> np.ndarray:
    """transformers' model of `source` with PEFT's load of `adapter_dir`: its float32 logits."""
    import peft  # noqa: PLC0415 (only here: the tests read this script's helpers without torch)
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(model, adapter_dir).eval()
    with torch.no_grad():
        return model(torch.as_tensor(input_ids)).logits.numpy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=FIXTURES)
    args = parser.parse_args()
    import peft  # noqa: PLC0415
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    for name, model_type in SOURCES.items():
        out = args.out / f"{name}_peft"
        cfg, graphdef, state, drawn = adapted_state(name)
        hf_lora.save_peft_adapter(out, cfg, lora.split(state)[0], model_type, base_model_name_or_path=name)
        np.savez(out / "adapters.npz", **drawn)
        input_ids = np.load(FIXTURES / name / "expected.npz")["input_ids"]
        theirs, ours = peft_logits(FIXTURES / name, out, input_ids), our_logits(graphdef, state, input_ids)
        base = np.load(FIXTURES / name / "expected.npz")["logits"]
        err, moved = np.abs(theirs - ours).max(), np.abs(theirs - base).max()
        print(f"{name}: PEFT vs ours max |Δlogit| {err:.2e}; the adapters moved the logits by up to {moved:.2f}")
        assert err <= TOLERANCE and moved > 100 * TOLERANCE
        np.savez(out / "expected.npz", input_ids=input_ids, logits=theirs)
        print(
            f"wrote {out} (peft {peft.__version__}, transformers {transformers.__version__}, torch {torch.__version__})"
        )


if __name__ == "__main__":
    main()

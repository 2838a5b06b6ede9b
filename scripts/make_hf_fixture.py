"""Builds the tiny Hugging Face checkpoints and reference outputs under tests/fixtures/.

Usage (by hand, needs torch; CI only reads the committed output):
    pip install torch   # CPU build is enough
    python scripts/make_hf_fixture.py [--out tests/fixtures]

For each tiny random model (transformers' own classes, float32) it writes the
`save_pretrained` directory plus `expected.npz`: input_ids [B,T], logits [B,T,V],
router_logits [L_moe,B,T,E] and topk [L_moe,B,T,k] (softmax then top-k, as the HF
router does). Weights are drawn at O(1) scale so logits are informative, and router
weights large enough that every token's top-k has a clear margin (ties would make
the expected routing ambiguous). It also writes a bf16 copy of qwen3_moe_tiny in
transformers v5's fused expert layout, and finally checks that our export of each
fixture (`gspo_jax.hf.save_hf_checkpoint`) loads in transformers with identical logits.
"""

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers

from gspo_jax import hf

B, T = 2, 7
SEED = 0
MIN_TOPK_MARGIN = 1e-3  # smallest allowed gap between the k-th and (k+1)-th router probability

QWEN3_MOE_TINY = dict(
    vocab_size=128,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    rope_theta=10_000.0,
)
# Layer 0 dense, un-renormalised top-k, head_dim != hidden / heads, tied embeddings.
QWEN3_MOE_TINY_DENSE0 = dict(
    QWEN3_MOE_TINY,
    head_dim=16,
    mlp_only_layers=[0],
    norm_topk_prob=False,
    tie_word_embeddings=True,
    rope_theta=1_000_000.0,
)
MIXTRAL_TINY = dict(
    vocab_size=128,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=16,
    num_local_experts=8,
    num_experts_per_tok=2,
    rope_theta=1_000_000.0,
)


def randomize_(model: torch.nn.Module, generator: torch.Generator) -> None:
    """O(1)-scale random weights: matrices ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.1^2), routers ~ N(0, 4/D)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=generator))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=generator))
            else:
                std = (2.0 if name.endswith("gate.weight") else 1.0) / p.shape[-1] ** 0.5
                p.copy_(std * torch.randn(p.shape, generator=generator))


def run(model, input_ids: torch.Tensor, top_k: int) -> dict[str, np.ndarray]:
    """Logits, router logits and softmax-then-top-k indices on unpadded inputs."""
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), output_router_logits=True)
    router = torch.stack([r.reshape(B, T, -1).float() for r in out.router_logits])  # [L_moe, B, T, E]
    probs = torch.softmax(router, dim=-1)
    top = torch.topk(probs, top_k + 1, dim=-1).values
    margin = float((top[..., top_k - 1] - top[..., top_k]).min())
    topk = torch.topk(probs, top_k, dim=-1).indices
    return {
        "input_ids": input_ids.numpy().astype(np.int32),
        "logits": out.logits.float().numpy(),
        "router_logits": router.numpy(),
        "topk": topk.numpy().astype(np.int32),
        "min_topk_margin": np.float32(margin),
    }


def build(name: str, config_cls, model_cls, kwargs: dict, out_dir: Path, seed: int) -> tuple:
    """Random model -> save_pretrained(out_dir/name) + expected.npz; retries seeds until top-k is unambiguous."""
    config = config_cls(**kwargs)
    config._attn_implementation = "eager"
    input_ids = torch.randint(0, config.vocab_size, (B, T), generator=torch.Generator().manual_seed(1234))
    for attempt in range(20):
        torch.manual_seed(seed + attempt)
        model = model_cls(config).eval()
        randomize_(model, torch.Generator().manual_seed(seed + attempt))
        expected = run(model, input_ids, config.num_experts_per_tok)
        if expected["min_topk_margin"] > MIN_TOPK_MARGIN:
            break
    else:
        raise RuntimeError(f"{name}: no seed gave a top-k margin > {MIN_TOPK_MARGIN}")
    path = out_dir / name
    shutil.rmtree(path, ignore_errors=True)
    model.save_pretrained(path)
    np.savez(path / "expected.npz", **expected)
    print(
        f"{name}: seed {seed + attempt}, min top-k margin {expected['min_topk_margin']:.4f}, "
        f"|logits| max {np.abs(expected['logits']).max():.2f}"
    )
    return model, expected


def check_export(fixture: Path, expected: dict, max_shard_bytes: int) -> None:
    """Our loader -> our exporter -> transformers.from_pretrained must reproduce the logits."""
    cfg, _, state = hf.load_hf_checkpoint(fixture)
    model_type = json.loads((fixture / "config.json").read_text())["model_type"]
    with tempfile.TemporaryDirectory() as tmp:
        files = hf.save_hf_checkpoint(tmp, cfg, state, model_type, max_shard_bytes=max_shard_bytes)
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            tmp, output_loading_info=True, attn_implementation="eager", dtype="auto"
        )
        bad = {k: v for k, v in info.items() if v}
        if bad:
            raise RuntimeError(f"{fixture.name}: from_pretrained loading info {bad}")
        got = run(model.eval(), torch.from_numpy(expected["input_ids"]).long(), cfg.top_k)
    diff = np.abs(got["logits"] - expected["logits"]).max()
    same_topk = np.array_equal(got["topk"], expected["topk"])
    print(
        f"{fixture.name}: export -> from_pretrained ({len(files)} shard(s)): max |dlogits| {diff:.2e}, "
        f"top-k identical {same_topk}"
    )
    if diff > 1e-5 or not same_topk:
        raise RuntimeError(f"{fixture.name}: exported checkpoint does not reproduce transformers' outputs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "tests" / "fixtures"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_default_dtype(torch.float32)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")

    Q, QM = transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM
    MC, MM = transformers.MixtralConfig, transformers.MixtralForCausalLM
    qwen, qwen_expected = build("qwen3_moe_tiny", Q, QM, QWEN3_MOE_TINY, out, SEED)
    _, dense0_expected = build("qwen3_moe_tiny_dense0", Q, QM, QWEN3_MOE_TINY_DENSE0, out, SEED + 100)
    _, mixtral_expected = build("mixtral_tiny", MC, MM, MIXTRAL_TINY, out, SEED + 200)

    # The same qwen3_moe_tiny weights in bf16, written in the fused v5 layout (experts.gate_up_proj).
    bf16 = out / "qwen3_moe_tiny_bf16_fused"
    shutil.rmtree(bf16, ignore_errors=True)
    qwen.to(torch.bfloat16).save_pretrained(bf16, save_original_format=False)
    # Reference = the checkpoint as transformers loads it (`.to(bf16)` would also round RoPE's inv_freq buffer).
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(bf16, attn_implementation="eager", dtype="auto")
    bf16_outputs = run(reloaded.eval(), torch.from_numpy(qwen_expected["input_ids"]).long(), 2)
    print(f"{bf16.name}: bf16, fused expert layout (no expected.npz: tests compare its weights)")

    check_export(out / "qwen3_moe_tiny", qwen_expected, max_shard_bytes=10**9)
    check_export(out / "qwen3_moe_tiny_dense0", dense0_expected, max_shard_bytes=40_000)  # sharded
    check_export(out / "mixtral_tiny", mixtral_expected, max_shard_bytes=10**9)
    check_export(bf16, bf16_outputs, max_shard_bytes=10**9)  # bf16 in, bf16 out, same transformers outputs

    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    for f in sorted(out.rglob("*")):
        if f.is_file():
            print(f"  {f.relative_to(out)}: {f.stat().st_size / 1024:.1f} KiB")
    print(f"fixtures total {total / 1024:.1f} KiB")


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()

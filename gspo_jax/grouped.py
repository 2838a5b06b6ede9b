"""Grouped expert matmuls for accelerators: each (token, choice) row sorted by expert, every expert
matmul one grouped kernel that reads an expert's weights for its own rows only, forward and backward.
Shape letters: `gspo_jax/__init__.py` (A = N·K sorted rows).

The backward is written by hand around two kernels: `gmm` (rows × their group's matrix, optionally
transposed: the forward and the input gradient) and `tgmm` (each group's rows contracted with each
other: the weight gradient, [E, D, F] and nothing larger). Autodiff of `lax.ragged_dot` instead
lets XLA rewrite the weight gradient into dense per-expert matmuls over every row
(bf16[128, 196608, 2048] at Qwen3-30B-A3B's dims: 96 GiB), which is what this module avoids.

Kernels, one per backend (`KERNELS`; `for_platform` picks):
  mosaic_gpu  JAX's Hopper kernels `pallas.ops.gpu.ragged_dot_mgpu` / `transposed_ragged_dot_mgpu`
  megablox    JAX's TPU kernels `pallas.ops.tpu.megablox` gmm / tgmm
  interpret   megablox in Pallas interpret mode: the TPU kernels' own code, run on a CPU (tests)
  xla         `lax.ragged_dot(_general)` on both sides: the exact reference (tests; XLA's rewrite makes
              the dense buffers above, so never a default)
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp

KERNELS = ("mosaic_gpu", "megablox", "interpret", "xla")

# Mosaic GPU tiles (block_m rows × block_n outputs, block_k deep; steps in flight; output tiles per
# program along n). `benchmarks/moe_kernels.py --tiles` measures others.
GPU_TILES = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1)
GPU_TGMM_TILES = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1)
GPU_DIM_MULTIPLE = 128  # D and F in whole tiles: gmm contracts over both (block_k), tgmm tiles both (128)
GPU_DECODE_ROWS = 4096  # up to this many rows (a decode step's B·K), 64-row tiles: less padding per expert


def for_platform(platform: str) -> str:
    """The kernels a platform runs: mosaic_gpu on "gpu" (CUDA), megablox on "tpu", the reference elsewhere."""
    return {"gpu": "mosaic_gpu", "cuda": "mosaic_gpu", "tpu": "megablox"}.get(platform, "xla")


def gpu_dims_fit(dims: tuple[int, int] | None) -> bool:
    """Whether the model and expert widths (D, F) are whole tiles of the Mosaic GPU kernels (None: unknown, yes)."""
    return dims is None or all(int(d) % GPU_DIM_MULTIPLE == 0 for d in dims)


def gpus_have_wgmma() -> bool:
    """Whether this process's GPUs are Hopper or newer (compute capability >= 9.0), which the Mosaic GPU
    kernels need; True where none is visible (a compile for a GPU elsewhere assumes one)."""
    try:
        devices = jax.devices("gpu")
    except RuntimeError:  # no GPU backend in this process
        return True
    return all(int(str(getattr(d, "compute_capability", "9.0")).split(".")[0]) >= 9 for d in devices)


def _tile(t: int, dim: int) -> int:
    """A megablox tile for a dimension: `t`, or the whole dimension where it is smaller."""
    return min(t, dim)


def _row_tile(m: int) -> int:
    """megablox's row tile: 128, or the rows rounded up to a multiple of 8 where fewer."""
    return 128 if m >= 128 else -(-m // 8) * 8


def _pad_rows(x_MX, tm: int):
    """Zero rows up to a multiple of `tm` (megablox needs whole row tiles; they lie past every group)."""
    return jnp.pad(x_MX, ((0, -x_MX.shape[0] % tm), (0, 0)))


def _megablox():
    """megablox's kernel module (the package's `gmm` attribute is its custom-VJP function, not the module)."""
    return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def gmm(kernels: str, lhs_MK, rhs_GKN, sizes_G, transpose_rhs: bool = False, out_dtype=None):
    """out[m] = lhs[m] @ rhs[group of m] (rhs[g].T when `transpose_rhs`: rhs is [G, N, K]); rows are
    sorted by group, `sizes_G` rows each; rows past sum(sizes_G) are left to the caller to mask."""
    out_dtype = out_dtype or lhs_MK.dtype
    if kernels == "xla":
        rhs = jnp.swapaxes(rhs_GKN, 1, 2) if transpose_rhs else rhs_GKN
        return jax.lax.ragged_dot(lhs_MK, rhs, sizes_G, preferred_element_type=jnp.float32).astype(out_dtype)
    if kernels in ("megablox", "interpret"):
        mb = _megablox()
        (m, k), tm = lhs_MK.shape, _row_tile(lhs_MK.shape[0])
        n = rhs_GKN.shape[1] if transpose_rhs else rhs_GKN.shape[2]
        tiling = (tm, _tile(128, k), _tile(128, n))
        out = mb.gmm(
            _pad_rows(lhs_MK, tm), rhs_GKN, sizes_G, jnp.float32, tiling, transpose_rhs=transpose_rhs,
            interpret=kernels == "interpret",
        )  # fmt: skip
        return out[:m].astype(out_dtype)
    if kernels == "mosaic_gpu":
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

        tiles = dict(GPU_TILES)
        if lhs_MK.shape[0] <= GPU_DECODE_ROWS:
            tiles["block_m"] = 64
        out = ragged_dot_mgpu.ragged_dot(lhs_MK, rhs_GKN, group_sizes=sizes_G, transpose_rhs=transpose_rhs, **tiles)
        return out.astype(out_dtype)
    raise ValueError(f"grouped.gmm: kernels={kernels!r}; allowed {KERNELS}")


def tgmm(kernels: str, lhs_MK, rhs_MN, sizes_G):
    """out[g] = lhs[rows of g].T @ rhs[rows of g], float32 [G, K, N]: a weight gradient. A group with
    no rows gets exact zeros (masked here, whatever the kernel leaves)."""
    G = sizes_G.shape[0]
    if kernels == "xla":
        dims = jax.lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
        )
        out = jax.lax.ragged_dot_general(lhs_MK, rhs_MN, sizes_G, dims, preferred_element_type=jnp.float32)
    elif kernels in ("megablox", "interpret"):
        mb = _megablox()
        k, tm = lhs_MK.shape[1], _row_tile(lhs_MK.shape[0])
        tiling = (tm, _tile(128, k), _tile(128, rhs_MN.shape[1]))
        lhs_KM, rhs_MN = _pad_rows(lhs_MK, tm).T, _pad_rows(rhs_MN, tm)
        out = mb.tgmm(
            lhs_KM, rhs_MN, sizes_G, jnp.float32, tiling, num_actual_groups=G, interpret=kernels == "interpret"
        )
    elif kernels == "mosaic_gpu":
        from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

        out = transposed_ragged_dot_mgpu.transposed_ragged_dot(lhs_MK, rhs_MN, group_sizes=sizes_G, **GPU_TGMM_TILES)
    else:
        raise ValueError(f"grouped.tgmm: kernels={kernels!r}; allowed {KERNELS}")
    return jnp.where((sizes_G > 0)[:, None, None], out.astype(jnp.float32), 0.0)


def _masked(x_AX, used_A):
    return jnp.where(used_A[:, None], x_AX, jnp.zeros((), x_AX.dtype))


def _adapted(kernels, x_AX, w_EXY, a_EXR, b_ERY, sizes_E, used_A):
    """x·W + (x·A)·B on the sorted rows, each product a grouped matmul, and x·A ([A, R], masked: the
    backward's B gradient reads it)."""
    xa_AR = _masked(gmm(kernels, x_AX, a_EXR, sizes_E), used_A)
    out = gmm(kernels, x_AX, w_EXY, sizes_E, out_dtype=jnp.float32) + gmm(
        kernels, xa_AR, b_ERY, sizes_E, out_dtype=jnp.float32
    )
    return _masked(out.astype(x_AX.dtype), used_A), xa_AR


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _experts(kernels, x_ND, gates_NK, order_A, inverse_A, sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD, adapters):
    args = (x_ND, gates_NK, order_A, inverse_A, sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD, adapters)
    return _experts_fwd(kernels, *args)[0]


def _experts_fwd(kernels, x_ND, gates_NK, order_A, inverse_A, sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD, adapters):
    (N, K), D = gates_NK.shape, x_ND.shape[1]
    used_A = jnp.arange(N * K) < jnp.sum(sizes_E)  # the sorted tail routed to "no expert" (index E)
    x_AD = x_ND[order_A // K]
    if adapters is None:
        g_AF = _masked(gmm(kernels, x_AD, w_gate_EDF, sizes_E), used_A)
        u_AF = _masked(gmm(kernels, x_AD, w_up_EDF, sizes_E), used_A)
        h_AF = (jax.nn.silu(g_AF.astype(jnp.float32)) * u_AF.astype(jnp.float32)).astype(x_ND.dtype)
        y_AD = _masked(gmm(kernels, h_AF, w_down_EFD, sizes_E), used_A)
        inner = None
    else:
        a = adapters
        g_AF, xa_gate_AR = _adapted(kernels, x_AD, w_gate_EDF, a.a_gate_EDR, a.b_gate_ERF, sizes_E, used_A)
        u_AF, xa_up_AR = _adapted(kernels, x_AD, w_up_EDF, a.a_up_EDR, a.b_up_ERF, sizes_E, used_A)
        h_AF = (jax.nn.silu(g_AF.astype(jnp.float32)) * u_AF.astype(jnp.float32)).astype(x_ND.dtype)
        y_AD, ha_down_AR = _adapted(kernels, h_AF, w_down_EFD, a.a_down_EFR, a.b_down_ERD, sizes_E, used_A)
        inner = (xa_gate_AR, xa_up_AR, ha_down_AR)
    y_NKD = y_AD[inverse_A].reshape(N, K, D)
    y_ND = jnp.einsum("nkd,nk->nd", y_NKD, gates_NK, preferred_element_type=jnp.float32).astype(x_ND.dtype)
    weights = (w_gate_EDF, w_up_EDF, w_down_EFD, adapters, inner)
    return y_ND, (x_ND, g_AF, u_AF, y_NKD, gates_NK, order_A, inverse_A, sizes_E, *weights)


def _experts_bwd(kernels, res, dy_ND):
    """Every gradient from grouped kernels: inputs by `gmm` (transposed), weights by `tgmm`, the
    adapters' as their own grouped products. A weight gradient the caller drops (a frozen base under
    LoRA) is an unused kernel call, dead code that jit removes."""
    x_ND, g_AF, u_AF, y_NKD, gates_NK, order_A, inverse_A, sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD, a, inner = res
    (N, K), D, dtype = gates_NK.shape, x_ND.shape[1], x_ND.dtype
    used_A = jnp.arange(N * K) < jnp.sum(sizes_E)
    dy_ND = dy_ND.astype(jnp.float32)
    d_gates_NK = jnp.einsum("nkd,nd->nk", y_NKD.astype(jnp.float32), dy_ND).astype(gates_NK.dtype)
    token_A = order_A // K
    gate_A = gates_NK.reshape(-1)[order_A].astype(jnp.float32)
    dy_AD = _masked(dy_ND[token_A] * gate_A[:, None], used_A).astype(dtype)
    x_AD = x_ND[token_A]
    g_AF, u_AF = g_AF.astype(jnp.float32), u_AF.astype(jnp.float32)
    sig_AF = jax.nn.sigmoid(g_AF)
    silu_AF = g_AF * sig_AF
    h_AF = (silu_AF * u_AF).astype(dtype)
    dh_AF = gmm(kernels, dy_AD, w_down_EFD, sizes_E, transpose_rhs=True, out_dtype=jnp.float32)
    # dy·B^T, dg·B^T, du·B^T: each adapter's output gradient pulled back to rank R ([A, R], masked)
    back = lambda d_AY, b_ERY: _masked(gmm(kernels, d_AY, b_ERY, sizes_E, True), used_A)
    if a is not None:
        dyb_AR = back(dy_AD, a.b_down_ERD)
        dh_AF = dh_AF + gmm(kernels, dyb_AR, a.a_down_EFR, sizes_E, True, jnp.float32)
    dg_AF = _masked(dh_AF * u_AF * sig_AF * (1 + g_AF * (1 - sig_AF)), used_A).astype(dtype)
    du_AF = _masked(dh_AF * silu_AF, used_A).astype(dtype)
    dx_AD = gmm(kernels, dg_AF, w_gate_EDF, sizes_E, True, jnp.float32) + gmm(
        kernels, du_AF, w_up_EDF, sizes_E, True, jnp.float32
    )
    cast = lambda g, like: g.astype(like.dtype)
    d_adapters = None
    if a is not None:
        (xa_gate_AR, xa_up_AR, ha_down_AR), dgb_AR, dub_AR = inner, back(dg_AF, a.b_gate_ERF), back(du_AF, a.b_up_ERF)
        dx_AD = dx_AD + gmm(kernels, dgb_AR, a.a_gate_EDR, sizes_E, True, jnp.float32)
        dx_AD = dx_AD + gmm(kernels, dub_AR, a.a_up_EDR, sizes_E, True, jnp.float32)
        grads = (
            tgmm(kernels, x_AD, dgb_AR, sizes_E),
            tgmm(kernels, xa_gate_AR, dg_AF, sizes_E),
            tgmm(kernels, x_AD, dub_AR, sizes_E),
            tgmm(kernels, xa_up_AR, du_AF, sizes_E),
            tgmm(kernels, h_AF, dyb_AR, sizes_E),
            tgmm(kernels, ha_down_AR, dy_AD, sizes_E),
        )
        d_adapters = type(a)(*map(cast, grads, a))
    dx_ND = jnp.sum(_masked(dx_AD, used_A)[inverse_A].reshape(N, K, D), axis=1).astype(dtype)
    return (
        dx_ND,
        d_gates_NK,
        None,
        None,
        None,
        cast(tgmm(kernels, x_AD, dg_AF, sizes_E), w_gate_EDF),
        cast(tgmm(kernels, x_AD, du_AF, sizes_E), w_up_EDF),
        cast(tgmm(kernels, h_AF, dy_AD, sizes_E), w_down_EFD),
        d_adapters,
    )


_experts.defvjp(_experts_fwd, _experts_bwd)


def _pad_rank(adapters, multiple: int):
    """The adapters with the rank R zero-padded to a multiple of `multiple` (A's last axis, B's middle):
    the same products, in whole kernel tiles; the padding's gradients are sliced off by autodiff."""
    pad = -adapters.a_gate_EDR.shape[-1] % multiple
    if not pad:
        return adapters
    a_pad, b_pad = ((0, 0), (0, 0), (0, pad)), ((0, 0), (0, pad), (0, 0))
    return type(adapters)(*(jnp.pad(x, a_pad if i % 2 == 0 else b_pad) for i, x in enumerate(adapters)))


def grouped_experts(x_BTD, topk_BTK, gates_BTK, w_gate_EDF, w_up_EDF, w_down_EFD, adapters=None, *, kernels: str):
    """Dropless SwiGLU experts on expert-sorted rows with grouped kernels (`kernels`: one of KERNELS).
    The rows are sorted once (a stable argsort: within an expert, rows keep their order); the sort's
    inverse takes outputs and input gradients home as gathers, never scatter-adds. Memory grows with
    the rows (A·D, A·F) and the weights (E·D·F), never with experts × rows. Adapters
    (`dispatch.ExpertAdapters`) are grouped products on the same rows, (x·A)·B, their gradients
    `tgmm`s too; on the Mosaic GPU kernels, whose tiles are 128 wide (`GPU_DIM_MULTIPLE`), the rank is
    zero-padded to whole tiles (megablox takes a rank below 128 as one whole-dimension tile)."""
    B, T, D = x_BTD.shape
    K, E = topk_BTK.shape[-1], w_gate_EDF.shape[0]
    A, dtype = B * T * K, x_BTD.dtype
    expert_A = topk_BTK.reshape(A).astype(jnp.int32)
    order_A = jnp.argsort(expert_A, stable=True).astype(jnp.int32)
    inverse_A = jnp.zeros_like(order_A).at[order_A].set(jnp.arange(A, dtype=jnp.int32), unique_indices=True)
    sizes_E = jnp.zeros((E + 1,), jnp.int32).at[expert_A].add(1)[:E]  # index E: "no expert", no group
    if adapters is not None:
        adapters = type(adapters)(*(x.astype(dtype) for x in adapters))
        if kernels == "mosaic_gpu":
            adapters = _pad_rank(adapters, GPU_DIM_MULTIPLE)
    y_ND = _experts(
        kernels,
        x_BTD.reshape(B * T, D),
        gates_BTK.reshape(B * T, K),
        order_A,
        inverse_A,
        sizes_E,
        w_gate_EDF.astype(dtype),
        w_up_EDF.astype(dtype),
        w_down_EFD.astype(dtype),
        adapters,
    )
    return y_ND.reshape(B, T, D)

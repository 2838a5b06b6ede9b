"""The experts' dispatch paths, each a function (x_BTD, topk_BTK, gates_BTK, w_gate_EDF, w_up_EDF,
w_down_EFD) -> y_BTD on one device: "dense" (every expert on every token), "ragged" (`lax.ragged_dot`),
"sparse" (a block loop over expert-sorted rows, with a hand-written backward) and "grouped" (the
grouped kernels of `gspo_jax/grouped.py`), and the `auto` rule that picks one per backend. The router
and the layer are `gspo_jax/moe.py`; the experts on a mesh, `gspo_jax/expert_parallel.py`. Shape
letters: `gspo_jax/__init__.py` (E experts, K chosen per token, F expert width).

Every path is dropless and exact: a token's output is computed from its own row only. Every path reads
an expert index equal to E as "no expert": that row's output is zero (the expert-parallel exchange uses
it for the empty slots of its buffers).

Every path takes optional low-rank adapters (`ExpertAdapters`, LoRA): expert e's projections use
W_e + A_e·B_e, computed unmerged, (x·A_e)·B_e, on the routed rows only (the dense reference excepted).
Without them every path is the program it was.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from gspo_jax import grouped

DISPATCHES = ("auto", "sparse", "grouped", "dense", "ragged")


class ExpertAdapters(NamedTuple):
    """Each expert's low-rank adapters (R the rank): projection p of expert e uses W_p[e] + A_p[e]·B_p[e].
    No scale is applied here (the caller folds α/r into B); cast to the compute dtype like the weights.
    On a mesh they are split over "expert" like the weights (`gspo_jax/expert_parallel.py`)."""

    a_gate_EDR: jax.Array
    b_gate_ERF: jax.Array
    a_up_EDR: jax.Array
    b_up_ERF: jax.Array
    a_down_EFR: jax.Array
    b_down_ERD: jax.Array


def cast_adapters(adapters: ExpertAdapters | None, dtype) -> ExpertAdapters | None:
    """The adapters in the compute dtype (None stays None)."""
    return None if adapters is None else ExpertAdapters(*(a.astype(dtype) for a in adapters))


def resolve_dispatch(dispatch: str, platform: str, dtype=jnp.bfloat16, dims: tuple[int, int] | None = None) -> str:
    """The one `dispatch="auto"` rule, by platform and compute dtype:
    - CPU: "sparse" (the block loop): loops are cheap there and XLA:CPU has no grouped kernels;
    - TPU: "grouped" (megablox kernels);
    - GPU: "grouped" (Mosaic GPU kernels) in 16-bit compute on Hopper or newer; "dense" in float32,
      which the kernels' wgmma does not take (a float32 model on a GPU is a small one: E/K times the
      routed FLOPs in one einsum beats a serial block loop), on older GPUs, which lack wgmma, and
      where the model or expert width (`dims`, (D, F)) is not whole 128-wide tiles of the kernels.
    On an H100 at Qwen3-30B-A3B's expert dims the grouped training pass runs 4.8x the sparse loop and
    its decode step 1.8x the dense path (`benchmarks/moe_kernels.py`; the real-dims sampler's step 1.6x,
    `benchmarks.run`). Any other value is kept."""
    if dispatch != "auto":
        return dispatch
    if platform == "cpu":
        return "sparse"
    if platform in ("gpu", "cuda") and (
        jnp.dtype(dtype).itemsize > 2 or not grouped.gpus_have_wgmma() or not grouped.gpu_dims_fit(dims)
    ):
        return "dense"
    return "grouped"


def experts_fn(dispatch: str, platform: str, dtype=jnp.bfloat16, dims: tuple[int, int] | None = None):
    """The experts function (x, topk, gates, w_gate, w_up, w_down) -> y of a dispatch on a platform;
    `dims`: the model and expert widths (D, F), where known."""
    dispatch = resolve_dispatch(dispatch, platform, dtype, dims)
    if dispatch == "grouped":
        kernels = grouped.for_platform(platform)
        if kernels == "mosaic_gpu" and not grouped.gpu_dims_fit(dims):
            raise ValueError(
                f"MoE: dispatch='grouped' on a GPU needs model.embed_dim and model.moe_mlp_dim in multiples of "
                f"{grouped.GPU_DIM_MULTIPLE} (the Mosaic GPU kernels' tiles), not {dims}; use dispatch='auto'"
            )
        if kernels == "mosaic_gpu" and jnp.dtype(dtype).itemsize > 2:
            raise ValueError(
                f"MoE: dispatch='grouped' on a GPU needs a 16-bit compute dtype (bfloat16 or float16), not "
                f"{jnp.dtype(dtype).name}: the Mosaic GPU kernels' wgmma takes no float32; use dispatch='auto'"
            )
        if kernels == "mosaic_gpu" and not grouped.gpus_have_wgmma():
            raise ValueError(
                "MoE: dispatch='grouped' on a GPU needs compute capability 9.0 or newer (Hopper: the Mosaic GPU "
                "kernels use wgmma); use dispatch='auto'"
            )
        return functools.partial(grouped.grouped_experts, kernels=kernels)
    return {"dense": dense_experts, "ragged": ragged_experts, "sparse": sparse_experts}[dispatch]


def dense_experts(x_BTD, topk_BTK, gates_BTK, w_gate_EDF, w_up_EDF, w_down_EFD, adapters: ExpertAdapters | None = None):
    """Every expert on every token, mixed by a [B,T,E] combine tensor (zero off the top-k).

    E times the FLOPs of sparse dispatch, but plain einsums: the fast path on CPU at small E. The
    reference: adapters run on every token too.
    """
    dtype = x_BTD.dtype
    combine_BTE = jnp.einsum(
        "btk,btke->bte", gates_BTK, jax.nn.one_hot(topk_BTK, w_gate_EDF.shape[0], dtype=jnp.float32)
    )
    gate_BTEF = jnp.einsum("btd,edf->btef", x_BTD, w_gate_EDF.astype(dtype))
    up_BTEF = jnp.einsum("btd,edf->btef", x_BTD, w_up_EDF.astype(dtype))
    ad = cast_adapters(adapters, dtype)
    if ad is not None:
        gate_BTEF += jnp.einsum("bter,erf->btef", jnp.einsum("btd,edr->bter", x_BTD, ad.a_gate_EDR), ad.b_gate_ERF)
        up_BTEF += jnp.einsum("bter,erf->btef", jnp.einsum("btd,edr->bter", x_BTD, ad.a_up_EDR), ad.b_up_ERF)
    h_BTEF = jax.nn.silu(gate_BTEF) * up_BTEF
    y_BTED = jnp.einsum("btef,efd->bted", h_BTEF, w_down_EFD.astype(dtype))
    if ad is not None:
        y_BTED += jnp.einsum("bter,erd->bted", jnp.einsum("btef,efr->bter", h_BTEF, ad.a_down_EFR), ad.b_down_ERD)
    y_BTD = jnp.einsum("bted,bte->btd", y_BTED, combine_BTE, preferred_element_type=jnp.float32)
    return y_BTD.astype(dtype)


def ragged_experts(
    x_BTD, topk_BTK, gates_BTK, w_gate_EDF, w_up_EDF, w_down_EFD, adapters: ExpertAdapters | None = None
):
    """Sparse dispatch: sort the A = B·T·K (token, expert) assignments by expert, run grouped
    matmuls with `lax.ragged_dot` (the adapters' too, (x·A)·B on the sorted rows), unsort, weight by
    the gates and sum over K.

    All shapes are static (A assignments), so it jit-compiles once; the TPU path.
    """
    B, T, D = x_BTD.shape
    K = topk_BTK.shape[-1]
    E = w_gate_EDF.shape[0]
    dtype = x_BTD.dtype
    x_ND = x_BTD.reshape(B * T, D)
    expert_A = topk_BTK.reshape(-1)
    order_A = jnp.argsort(expert_A, stable=True)
    x_AD = x_ND[order_A // K]
    group_sizes_E = jnp.bincount(expert_A, length=E).astype(jnp.int32)
    gate_AF = jax.lax.ragged_dot(x_AD, w_gate_EDF.astype(dtype), group_sizes_E)
    up_AF = jax.lax.ragged_dot(x_AD, w_up_EDF.astype(dtype), group_sizes_E)
    ad = cast_adapters(adapters, dtype)
    lora = lambda x_AX, a_EXR, b_ERY: jax.lax.ragged_dot(
        jax.lax.ragged_dot(x_AX, a_EXR, group_sizes_E), b_ERY, group_sizes_E
    )
    if ad is not None:
        gate_AF += lora(x_AD, ad.a_gate_EDR, ad.b_gate_ERF)
        up_AF += lora(x_AD, ad.a_up_EDR, ad.b_up_ERF)
    h_AF = jax.nn.silu(gate_AF) * up_AF
    y_sorted_AD = jax.lax.ragged_dot(h_AF, w_down_EFD.astype(dtype), group_sizes_E)
    if ad is not None:
        y_sorted_AD += lora(h_AF, ad.a_down_EFR, ad.b_down_ERD)
    inverse_A = jnp.zeros_like(order_A).at[order_A].set(jnp.arange(order_A.shape[0], dtype=order_A.dtype))
    y_NKD = y_sorted_AD[inverse_A].reshape(B * T, K, D)
    y_ND = jnp.einsum("nkd,nk->nd", y_NKD, gates_BTK.reshape(B * T, K), preferred_element_type=jnp.float32)
    return y_ND.reshape(B, T, D).astype(dtype)


def sparse_block_size(assignments: int, num_experts: int) -> int:
    """Rows per block of the sparse path: the largest power of two in [8, 256] with E·b <= A/4, so the
    padding (at most b - 1 rows per expert) costs at most a quarter of the useful rows, on average an
    eighth, while the blocks stay wide enough for efficient matmuls."""
    b = 256
    while b > 8 and num_experts * b * 4 > assignments:
        b //= 2
    return b


class BlockLayout(NamedTuple):
    """Where each (token, choice) assignment sits in the expert-sorted, block-padded row buffer.

    Rows are grouped by expert, each expert's group padded to a multiple of `b` rows, so every block of
    b rows belongs to one expert. Padding rows point at token N (a zero row). Static sizes: R = NB·b
    rows with NB = (A + E·(b - 1)) // b blocks, the most any routing can need; only `num_blocks` are used.
    """

    row_NK: jax.Array  # int32 [N, K]: the row of each assignment
    token_R: jax.Array  # int32 [R]: the token of each row (N on padding rows)
    expert_NB: jax.Array  # int32 [NB]: the expert of each block (clamped to E - 1 past the used ones)
    num_blocks: jax.Array  # int32 scalar: blocks in use
    block_end_E: jax.Array  # int32 [E]: one past each expert's last block


def block_layout(topk_NK: jax.Array, num_experts: int, b: int) -> BlockLayout:
    """The block-padded expert-sorted layout of a routing (integer work only, no sort: a token's rank
    within its expert is a running count). Within an expert, rows keep the assignments' order."""
    N, K = topk_NK.shape
    A, E = N * K, num_experts
    NB = (A + E * (b - 1)) // b
    expert_A = topk_NK.reshape(A)
    onehot_AE = jax.nn.one_hot(expert_A, E, dtype=jnp.int32)
    rank_A = jnp.take_along_axis(jnp.cumsum(onehot_AE, axis=0), expert_A[:, None], axis=1)[:, 0] - 1
    blocks_E = (jnp.sum(onehot_AE, axis=0) + b - 1) // b
    block_end_E = jnp.cumsum(blocks_E)
    row_A = ((block_end_E - blocks_E) * b)[expert_A] + rank_A
    token_R = jnp.full((NB * b,), N, jnp.int32).at[row_A].set(jnp.arange(A, dtype=jnp.int32) // K, unique_indices=True)
    expert_NB = jnp.searchsorted(block_end_E, jnp.arange(NB, dtype=jnp.int32), side="right")
    return BlockLayout(
        row_NK=row_A.reshape(N, K).astype(jnp.int32),
        token_R=token_R,
        expert_NB=jnp.minimum(expert_NB, E - 1).astype(jnp.int32),
        num_blocks=block_end_E[-1].astype(jnp.int32),
        block_end_E=block_end_E.astype(jnp.int32),
    )


# Up to this many experts, the block loop is one loop per expert with the expert's index static, so its
# weights are loop-invariant (read in place, not copied out per block); past it, a loop over experts
# (`chunk_levels` > 1) or over the used blocks (a forward of few rows: decoding).
STATIC_EXPERT_LOOPS = 16
# The widest chunk of an expert's blocks one matmul takes (`chunk_levels`).
MAX_CHUNK_ROWS = 256


def chunk_levels(assignments: int, b: int) -> tuple[int, ...]:
    """Blocks per chunk, largest first, ending in 1: an expert's blocks go the largest chunk at a time
    while that many are left, then the next, so each matmul is as wide as the expert's rows allow
    (a routing's popular experts get up to 16x the average rows) without more padding. Powers of 4 up
    to `MAX_CHUNK_ROWS` rows; (1,) below 2,048 assignments, where the extra loops cost more compile
    time than the wider matmuls save."""
    levels = [1]
    while assignments >= 2048 and levels[-1] * 4 * b <= MAX_CHUNK_ROWS:
        levels.append(levels[-1] * 4)
    return tuple(reversed(levels))


def _for_each_block(layout: BlockLayout, weights: tuple, body, carry, b: int, levels=(1,), acc: tuple = ()):
    """(carry, acc_E): carry, a = body(r, n, carry, a, w) over every used block in order, r its first row
    and n (static) its rows, w the tuple of each [E, ...] array of `weights` at the block's expert. `acc`
    are per-expert sums (a weight's gradient): zeros at each expert's first block, returned stacked
    [E, ...] with its expert's sum in each row.

    Expert by expert, each expert's weights are sliced once and its blocks go in chunks of `levels`
    blocks (n = size·b, largest first): XLA:CPU neither hoists a slice out of a loop nor makes it a
    view, so slicing per block copied the expert's weights for every block (`benchmarks/profile.py`).
    Up to STATIC_EXPERT_LOOPS experts the expert index is static and the slices sit behind a barrier:
    XLA hoists a barrier (never a bare slice) out of an enclosing loop, so a decode step reads
    loop-invariant weights in place. Past it with `levels` (1,) (a forward of a few rows a expert,
    decoding) one loop visits every used block alone, reading its expert's weights."""
    num_experts = weights[0].shape[0]
    zeros = lambda: tuple(jnp.zeros_like(z) for z in acc)

    def expert(start, end, carry, w):
        state = (carry, zeros())
        for size in levels:
            full = (end - start) // size
            run = lambda j, s, st=start, size=size: body((st + j * size) * b, size * b, *s, w)
            state = jax.lax.fori_loop(0, full, run, state)
            start = start + full * size
        return state

    if num_experts <= STATIC_EXPERT_LOOPS:
        sums = []
        for e in range(num_experts):
            w = tuple(jax.lax.optimization_barrier(x[e]) for x in weights)
            carry, a = expert(layout.block_end_E[e - 1] if e else 0, layout.block_end_E[e], carry, w)
            sums.append(a)
        return carry, tuple(jnp.stack(z) for z in zip(*sums)) if acc else ()
    stacks = tuple(jnp.zeros((num_experts, *z.shape), z.dtype) for z in acc)
    if levels == (1,):  # the blocks of "no expert" (index E), if any, are skipped
        end = layout.block_end_E[num_experts - 1]

        def one(i, state):
            e = layout.expert_NB[i]
            carry, a = body(i * b, b, state[0], zeros(), tuple(x[e] for x in weights))
            return carry, tuple(s.at[e].add(z) for s, z in zip(state[1], a))

        return jax.lax.fori_loop(0, end, one, (carry, stacks))

    def each(e, state):
        w = tuple(jax.lax.optimization_barrier(jax.lax.dynamic_index_in_dim(x, e, keepdims=False)) for x in weights)
        start = jnp.where(e > 0, layout.block_end_E[jnp.maximum(e - 1, 0)], 0)
        carry, a = expert(start, layout.block_end_E[e], state[0], w)
        return carry, tuple(jax.lax.dynamic_update_index_in_dim(s, z, e, 0) for s, z in zip(state[1], a))

    return jax.lax.fori_loop(0, num_experts, each, (carry, stacks))


def _rows(x_RD, r, n):
    return jax.lax.dynamic_slice_in_dim(x_RD, r, n)


def _put_rows(x_RD, rows_nD, r):
    return jax.lax.dynamic_update_slice_in_dim(x_RD, rows_nD.astype(x_RD.dtype), r, axis=0)


def _dot(a, b_):
    return jnp.dot(a, b_, preferred_element_type=jnp.float32)


def _lora_dot(x_nX, a_XR, b_RY):
    """(x·A)·B in float32, x·A rounded to x's dtype between (one block's adapter product)."""
    return _dot(_dot(x_nX, a_XR).astype(x_nX.dtype), b_RY)


def _swiglu_blocks(
    layout: BlockLayout, x_RD, w_gate_EDF, w_up_EDF, w_down_EFD, b: int, levels: tuple, keep: bool, adapters=None
):
    """The experts' SwiGLU on every used block: y_R [R, D], and the gate and up pre-activations
    (g_R, u_R [R, F]) when `keep` (the backward pass reads them). Gate and up stay two matmuls on the
    layer's own weights: concatenating them per layer copied every expert's weights once more. With
    `adapters` (`ExpertAdapters`), each projection adds its block's (x·A_e)·B_e."""
    dtype = x_RD.dtype

    def body(r, n, carry, acc, w):
        (y_RD, g_RF, u_RF), (w_gate_DF, w_up_DF, w_down_FD, *a) = carry, w
        x_nD = _rows(x_RD, r, n)
        if a:
            a_gate_DR, b_gate_RF, a_up_DR, b_up_RF, a_down_FR, b_down_RD = a
            g_nF = (_dot(x_nD, w_gate_DF) + _lora_dot(x_nD, a_gate_DR, b_gate_RF)).astype(dtype)
            u_nF = (_dot(x_nD, w_up_DF) + _lora_dot(x_nD, a_up_DR, b_up_RF)).astype(dtype)
            h_nF = jax.nn.silu(g_nF) * u_nF
            y_RD = _put_rows(y_RD, _dot(h_nF, w_down_FD) + _lora_dot(h_nF, a_down_FR, b_down_RD), r)
        else:
            g_nF, u_nF = _dot(x_nD, w_gate_DF).astype(dtype), _dot(x_nD, w_up_DF).astype(dtype)
            y_RD = _put_rows(y_RD, _dot(jax.nn.silu(g_nF) * u_nF, w_down_FD), r)
        if keep:
            g_RF, u_RF = _put_rows(g_RF, g_nF, r), _put_rows(u_RF, u_nF, r)
        return (y_RD, g_RF, u_RF), acc

    R, D = x_RD.shape
    kept = jnp.zeros((R if keep else 0, w_down_EFD.shape[1]), dtype)
    init = (jnp.zeros((R, D), dtype), kept, kept)
    weights = (w_gate_EDF, w_up_EDF, w_down_EFD) + (tuple(adapters) if adapters is not None else ())
    return _for_each_block(layout, weights, body, init, b, levels)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _sparse_experts(
    b: int, levels: tuple, layout: BlockLayout, x_ND, gates_NK, w_gate_EDF, w_up_EDF, w_down_EFD, adapters=None
):
    fwd = _sparse_experts_fwd(b, levels, layout, x_ND, gates_NK, w_gate_EDF, w_up_EDF, w_down_EFD, adapters, keep=False)
    return fwd[0]


def _sparse_experts_fwd(b, levels, layout, x_ND, gates_NK, w_gate_EDF, w_up_EDF, w_down_EFD, adapters, keep=True):
    x_RD = jnp.concatenate([x_ND, jnp.zeros_like(x_ND[:1])])[layout.token_R]
    y_RD, g_RF, u_RF = _swiglu_blocks(layout, x_RD, w_gate_EDF, w_up_EDF, w_down_EFD, b, levels, keep, adapters)
    y_NKD = y_RD[layout.row_NK]
    y_ND = jnp.einsum("nkd,nk->nd", y_NKD, gates_NK, preferred_element_type=jnp.float32).astype(x_ND.dtype)
    return y_ND, (layout, x_RD, g_RF, u_RF, y_NKD, gates_NK, w_gate_EDF, w_up_EDF, w_down_EFD, adapters)


def _sparse_experts_bwd(b, levels, res, dy_ND):
    """The block loop's backward: per block the input gradient, and each expert's weight gradients (the
    adapters' too) summed over its own blocks in a loop carry, written once per expert. A weight
    gradient the caller drops (a frozen base under LoRA) is a dead loop carry that XLA's while-loop
    simplifier removes."""
    layout, x_RD, g_RF, u_RF, y_NKD, gates_NK, w_gate_EDF, w_up_EDF, w_down_EFD, adapters = res
    dtype = x_RD.dtype
    dy_ND = dy_ND.astype(jnp.float32)
    d_gates_NK = jnp.einsum("nkd,nd->nk", y_NKD.astype(jnp.float32), dy_ND).astype(gates_NK.dtype)
    # Each row's output gradient: its token's, times its gate (padding rows read the zero row).
    gate_R = (
        jnp.zeros((x_RD.shape[0],), jnp.float32)
        .at[layout.row_NK.reshape(-1)]
        .set(gates_NK.reshape(-1).astype(jnp.float32), unique_indices=True)
    )
    dy_RD = (jnp.concatenate([dy_ND, jnp.zeros_like(dy_ND[:1])])[layout.token_R] * gate_R[:, None]).astype(dtype)

    def body(r, n, dx_RD, acc, w):
        (dw_gate_DF, dw_up_DF, dw_down_FD, *da), (w_gate_DF, w_up_DF, w_down_FD, *a) = acc, w
        dy_nD, x_nD = _rows(dy_RD, r, n), _rows(x_RD, r, n)
        g_nF, u_nF = _rows(g_RF, r, n).astype(jnp.float32), _rows(u_RF, r, n).astype(jnp.float32)
        sig_nF = jax.nn.sigmoid(g_nF)
        silu_nF = g_nF * sig_nF
        h_nF = (silu_nF * u_nF).astype(dtype)
        dh_nF = _dot(dy_nD, w_down_FD.T)
        if a:
            a_gate_DR, b_gate_RF, a_up_DR, b_up_RF, a_down_FR, b_down_RD = a
            dyb_nR = _dot(dy_nD, b_down_RD.T).astype(dtype)
            dh_nF = dh_nF + _dot(dyb_nR, a_down_FR.T)
        dg_nF = (dh_nF * u_nF * sig_nF * (1 + g_nF * (1 - sig_nF))).astype(dtype)
        du_nF = (dh_nF * silu_nF).astype(dtype)
        dx_nD = _dot(dg_nF, w_gate_DF.T) + _dot(du_nF, w_up_DF.T)
        if a:
            dgb_nR, dub_nR = _dot(dg_nF, b_gate_RF.T).astype(dtype), _dot(du_nF, b_up_RF.T).astype(dtype)
            dx_nD = dx_nD + _dot(dgb_nR, a_gate_DR.T) + _dot(dub_nR, a_up_DR.T)
            xa = lambda x_nX, a_XR: _dot(x_nX, a_XR).astype(dtype).T  # the adapter's inner product, [R, n]
            updates = (
                _dot(x_nD.T, dgb_nR),
                _dot(xa(x_nD, a_gate_DR), dg_nF),
                _dot(x_nD.T, dub_nR),
                _dot(xa(x_nD, a_up_DR), du_nF),
                _dot(h_nF.T, dyb_nR),
                _dot(xa(h_nF, a_down_FR), dy_nD),
            )
            da = [d + u for d, u in zip(da, updates)]
        dx_RD = _put_rows(dx_RD, dx_nD, r)
        dw_gate_DF = dw_gate_DF + _dot(x_nD.T, dg_nF)
        dw_up_DF = dw_up_DF + _dot(x_nD.T, du_nF)
        dw_down_FD = dw_down_FD + _dot(h_nF.T, dy_nD)
        return dx_RD, (dw_gate_DF, dw_up_DF, dw_down_FD, *da)

    weights = (w_gate_EDF, w_up_EDF, w_down_EFD) + (tuple(adapters) if adapters is not None else ())
    sums = tuple(jnp.zeros(w.shape[1:], jnp.float32) for w in weights)
    dx_RD, (dw_gate, dw_up, dw_down, *da) = _for_each_block(
        layout, weights, body, jnp.zeros_like(x_RD), b, levels, sums
    )
    dx_ND = jnp.sum(dx_RD[layout.row_NK].astype(jnp.float32), axis=1).astype(dtype)
    cast = lambda g, like: g.astype(like.dtype)
    d_adapters = None if adapters is None else ExpertAdapters(*map(cast, da, adapters))
    dw = cast(dw_gate, w_gate_EDF), cast(dw_up, w_up_EDF), cast(dw_down, w_down_EFD)
    return None, dx_ND, d_gates_NK, *dw, d_adapters


_sparse_experts.defvjp(_sparse_experts_fwd, _sparse_experts_bwd)


def sparse_experts(
    x_BTD,
    topk_BTK,
    gates_BTK,
    w_gate_EDF,
    w_up_EDF,
    w_down_EFD,
    adapters: ExpertAdapters | None = None,
    *,
    block: int | None = None,
    levels: tuple[int, ...] | None = None,
):
    """Sparse dispatch for CPUs: each token's rows go to an expert-sorted buffer padded per expert to
    blocks of `block` rows (`sparse_block_size` by default), and loops over each expert's blocks run
    their SwiGLU with its weights. Exact and dropless: a token's output is computed from its own row
    only, in k·(useful) FLOPs plus at most `block - 1` padding rows per expert, never E/k times the
    work like the dense path. An expert's blocks go in chunks of `levels` blocks, largest first
    (`chunk_levels` by default): small blocks keep the padding small, chunks keep the matmuls wide.
    The backward pass is hand-written (the same loops, each expert's weight gradients summed in a
    carry; the gathers' transposes are gathers of the inverse permutation, never scatter-adds).
    Adapters run in the same blocks: (x_blk·A_e)·B_e beside x_blk·W_e."""
    B, T, D = x_BTD.shape
    K, E = topk_BTK.shape[-1], w_gate_EDF.shape[0]
    dtype = x_BTD.dtype
    b = block or sparse_block_size(B * T * K, E)
    levels = tuple(levels or chunk_levels(B * T * K, b))
    if levels[-1] != 1 or list(levels) != sorted(levels, reverse=True):
        raise ValueError(f"sparse_experts: levels must be blocks per chunk, largest first, ending in 1, not {levels}")
    # E + 1 groups: rows routed to "no expert" (index E) get blocks of their own that no loop visits.
    layout = block_layout(topk_BTK.reshape(B * T, K).astype(jnp.int32), E + 1, b)
    y_ND = _sparse_experts(
        b,
        levels,
        layout,
        x_BTD.reshape(B * T, D),
        gates_BTK.reshape(B * T, K),
        w_gate_EDF.astype(dtype),
        w_up_EDF.astype(dtype),
        w_down_EFD.astype(dtype),
        cast_adapters(adapters, dtype),
    )
    return y_ND.reshape(B, T, D)

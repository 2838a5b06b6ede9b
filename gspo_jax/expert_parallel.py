"""The experts on a mesh, each in a `jax.shard_map` that sees one device's shapes: expert parallelism
with an explicit all-to-all where the mesh has an "expert" axis (`expert_parallel`), and, without one,
the grouped kernels' per-device run on their own tokens (`batch_parallel`), which XLA cannot partition
itself. `parallel_experts` picks for the mesh a program is traced under. The dispatch paths these wrap
are `gspo_jax/dispatch.py`. Shape letters: `gspo_jax/__init__.py` (E experts, K chosen per token).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from gspo_jax import sharding
from gspo_jax.validation import check


def expert_parallel(experts, mesh, x_BTD, topk_BTK, gates_BTK, w_gate_EDF, w_up_EDF, w_down_EFD, adapters=None):
    """Expert parallelism with an explicit all-to-all (`jax.shard_map` over `mesh`): the tokens are split
    over every data axis (`sharding.DATA_AXES`), the experts over "expert" (S shards of E/S each).

    Each device puts each of its (token, choice) assignments in the slot block of the shard that holds
    the chosen expert, one all-to-all delivers the blocks, `experts` (a dispatch path: dense, ragged or
    sparse) runs the received rows on the device's own experts, a second all-to-all brings the outputs
    home and the gates mix them there. Dropless: a block has room for every assignment of the sender,
    C = tokens × min(K, E/S), so no routing overflows it; a token's output is computed from its own row
    only, as in the single-device paths. Expert weights arrive whole along "fsdp" (gathered at the
    boundary, their gradients reduce-scattered back) and split along "tensor" over F (outputs summed).
    Adapters (`dispatch.ExpertAdapters`) are split like the weights (`_adapter_specs`): each shard runs
    its own experts' adapters on the rows it receives.
    """
    B, T, D = x_BTD.shape
    K, E = topk_BTK.shape[-1], w_gate_EDF.shape[0]
    S = mesh.shape["expert"]
    check(E % S == 0, "expert_parallel", "num_experts", E, f"a multiple of the mesh's expert axis ({S})")
    El = E // S
    x_ND, topk_NK, gates_NK = _split_evenly(mesh, x_BTD, topk_BTK, gates_BTK, E)
    f_ax = _f_axis(mesh, w_gate_EDF.shape[-1])

    def local(x_nD, topk_nK, gates_nK, w_gate, w_up, w_down, *adapters):
        n = x_nD.shape[0]
        C = n * min(K, El)
        expert_A = topk_nK.reshape(-1)
        dest_A = expert_A // El  # S for "no expert"
        # An assignment's slot: its destination's block, then its rank among the assignments sent there.
        rank_A = jnp.cumsum(jax.nn.one_hot(dest_A, S, dtype=jnp.int32), axis=0)
        rank_A = jnp.take_along_axis(rank_A, jnp.minimum(dest_A, S - 1)[:, None], axis=1)[:, 0] - 1
        slot_A = jnp.where(dest_A < S, dest_A * C + rank_A, S * C)  # S·C: nowhere (dropped writes)
        token_R = jnp.full((S * C,), n, jnp.int32).at[slot_A].set(jnp.arange(n * K, dtype=jnp.int32) // K, mode="drop")
        local_R = jnp.full((S * C,), El, jnp.int32).at[slot_A].set(expert_A % El, mode="drop")
        send_RD = jnp.concatenate([x_nD, jnp.zeros_like(x_nD[:1])])[token_R]
        exchange = functools.partial(jax.lax.all_to_all, axis_name="expert", split_axis=0, concat_axis=0, tiled=True)
        recv_RD, recv_R = exchange(send_RD), exchange(local_R)
        y_RD = experts(
            recv_RD[None], recv_R[None, :, None], jnp.ones((1, S * C, 1), jnp.float32), w_gate, w_up, w_down, *adapters
        )
        y_RD = jax.lax.psum(y_RD[0], "tensor") if f_ax else y_RD[0]
        back_RD = exchange(y_RD)
        y_AD = jnp.concatenate([back_RD, jnp.zeros_like(back_RD[:1])])[slot_A]
        y_nD = jnp.einsum("nkd,nk->nd", y_AD.reshape(n, K, D), gates_nK, preferred_element_type=jnp.float32)
        return y_nD.astype(x_nD.dtype)

    y_ND = _per_shard(
        local, mesh, "expert", f_ax, (x_ND, topk_NK, gates_NK), (w_gate_EDF, w_up_EDF, w_down_EFD), adapters
    )
    return y_ND[: B * T].reshape(B, T, D)


def batch_parallel(experts, mesh, x_BTD, topk_BTK, gates_BTK, w_gate_EDF, w_up_EDF, w_down_EFD, adapters=None):
    """The experts on a mesh without expert parallelism, in a `jax.shard_map` over `mesh`: each device
    runs `experts` on its own tokens (split over every data axis, `sharding.DATA_AXES`) with every
    expert's weights, gathered whole along "fsdp" at the boundary (their gradients summed over the data
    axes on the way back) and split along "tensor" over F where it divides (outputs summed). The grouped
    kernels need it: XLA cannot partition a Mosaic kernel's call (TPU or GPU), so it must see one
    device's shapes. Adapters (`dispatch.ExpertAdapters`) go whole too, split over F like the weights."""
    B, T, D = x_BTD.shape
    E = w_gate_EDF.shape[0]
    x_ND, topk_NK, gates_NK = _split_evenly(mesh, x_BTD, topk_BTK, gates_BTK, E)
    f_ax = _f_axis(mesh, w_gate_EDF.shape[-1])

    def local(x_nD, topk_nK, gates_nK, w_gate, w_up, w_down, *adapters):
        y_nD = experts(x_nD[None], topk_nK[None], gates_nK[None], w_gate, w_up, w_down, *adapters)[0]
        return jax.lax.psum(y_nD, "tensor") if f_ax else y_nD

    y_ND = _per_shard(local, mesh, None, f_ax, (x_ND, topk_NK, gates_NK), (w_gate_EDF, w_up_EDF, w_down_EFD), adapters)
    return y_ND[: B * T].reshape(B, T, D)


def _per_shard(local, mesh, e_ax: str | None, f_ax: str | None, rows: tuple, weights: tuple, adapters):
    """`local(x_nD, topk_nK, gates_nK, w_gate, w_up, w_down, *adapters)` in a `jax.shard_map` over `mesh`:
    the `rows` (x_ND, topk_NK, gates_NK) split over every data axis, the `weights` (gate, up [E, D, F],
    down [E, F, D]) over `e_ax` (E) and `f_ax` (F), the adapters alike (`_adapter_args`); y_ND back."""
    tokens = P(sharding.DATA_AXES, None)
    w_in, w_out = P(e_ax, None, f_ax), P(e_ax, f_ax, None)
    extra, extra_specs = _adapter_args(adapters, e_ax, f_ax)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(tokens, tokens, tokens, w_in, w_in, w_out, *extra_specs),
        out_specs=tokens,
        check_vma=False,
    )(*rows, *weights, *extra)


def _adapter_args(adapters, e_ax: str | None, f_ax: str | None) -> tuple[tuple, tuple]:
    """The shard_map arguments and specs of the adapters: () without any; else the adapters themselves,
    split over `e_ax` (E) like the weights and over `f_ax` where an axis is F (B of gate and up, A of
    down: with h split over F, (h·A_down) is a partial sum that the output's psum completes)."""
    if adapters is None:
        return (), ()
    a_in, b_in = P(e_ax, None, None), P(e_ax, None, f_ax)  # a_gate/a_up [E, D, R], b_gate/b_up [E, R, F]
    a_out, b_out = P(e_ax, f_ax, None), P(e_ax, None, None)  # a_down [E, F, R], b_down [E, R, D]
    return (adapters,), (type(adapters)(a_in, b_in, a_in, b_in, a_out, b_out),)


def _split_evenly(mesh, x_BTD, topk_BTK, gates_BTK, num_experts: int):
    """The tokens flattened to rows (x_ND, topk_NK, gates_NK), padded to a multiple of the mesh's data
    ways with rows routed to "no expert" (index E), so a shard_map splits them evenly."""
    (B, T, D), K = x_BTD.shape, topk_BTK.shape[-1]
    pad = ((0, -(B * T) % sharding.data_size(mesh)), (0, 0))
    x_ND = jnp.pad(x_BTD.reshape(B * T, D), pad)
    topk_NK = jnp.pad(topk_BTK.reshape(B * T, K).astype(jnp.int32), pad, constant_values=num_experts)
    return x_ND, topk_NK, jnp.pad(gates_BTK.reshape(B * T, K), pad)


def _f_axis(mesh, F: int) -> str | None:
    """The mesh axis that splits the expert width F: "tensor" where it is larger than 1 and divides F,
    else None (every device holds whole experts)."""
    R = mesh.shape["tensor"]
    return "tensor" if R > 1 and F % R == 0 else None


def parallel_experts(experts, dispatch: str, mesh):
    """`experts` for the mesh a program is traced under (`sharding.under_mesh`): expert-parallel where
    the mesh has an expert axis; in a per-device shard_map (`batch_parallel`) for the grouped kernels
    on any other mesh of several devices; as it is on one device, or for the other dispatches, which
    XLA partitions itself."""
    if mesh.empty:
        return experts
    if mesh.shape["expert"] > 1:
        return functools.partial(expert_parallel, experts, mesh)
    if dispatch == "grouped" and mesh.size > 1:
        return functools.partial(batch_parallel, experts, mesh)
    return experts

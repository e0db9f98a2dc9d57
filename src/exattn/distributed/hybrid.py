"""Sequence parallelism over a 2-D device mesh: Ulysses along one dimension, the ring along the other (USP).

The mesh is (R, U): R ring ranks (across nodes: only neighbours talk, point
to point) by U Ulysses ranks (inside a node: all-to-all over fast links). The
full sequence of N positions is cut first over the ring (layout "zigzag",
balanced for causal, or "contiguous") and each ring shard then contiguously
over the U Ulysses ranks (`mesh_shard`). A call runs:

    all-to-all over the Ulysses group: (N / (R U) positions, H heads) -> (N / R positions, H / U heads)
    ring attention over the ring group on that: the exact output for the ring shard
    all-to-all back: (N / (R U) positions, H heads)

So the Ulysses group must divide the query heads; the ring takes any head count.
U = 1 is plain ring attention, R = 1 plain Ulysses, a 1 x 1 mesh (or `mesh=None`
in a single process) plain `exattn.attention`: one call site from 1 to N GPUs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..attention import attention as local_attention
from .layout import check_layout, shard
from .ledger import MemoryLedger
from ..problem import check_bool
from .ring import ring_call
from .score_rules import refuse_alibi
from .ulysses import ulysses_call

try:
    from torch.distributed.device_mesh import DeviceMesh
except ImportError:  # pragma: no cover - torch without device meshes
    DeviceMesh = None

MESH_DIMS = ("ring", "ulysses")
WHAT = "sequence_parallel_attention"


def mesh_groups(mesh: object, device: torch.device):
    """(ring group, its size, its coordinate), (ulysses group, size, coordinate) of a 2-D mesh, checked."""
    if DeviceMesh is None or not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__} "
            "(make one with init_device_mesh(device, (ring, ulysses), mesh_dim_names=('ring', 'ulysses')))"
        )
    if mesh.ndim != 2:
        raise ValueError(f"mesh must be 2-D (ring, ulysses), got {mesh.ndim}-D with shape {tuple(mesh.shape)}")
    if mesh.device_type != device.type:
        raise ValueError(
            f"mesh is a {mesh.device_type!r} mesh but the tensors are on {device.type!r}: the mesh's "
            "process groups cannot move them (gloo for CPU tensors, nccl for CUDA tensors)"
        )
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("this process is not in the mesh; call sequence_parallel_attention only on its ranks")
    names = mesh.mesh_dim_names or ()
    dims = [names.index(n) for n in MESH_DIMS] if all(n in names for n in MESH_DIMS) else [0, 1]
    return [(mesh.get_group(d), mesh.size(d), coordinate[d]) for d in dims]


def mesh_shard(x: torch.Tensor, mesh, layout: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """The part of the full tensor `x` this process holds in `sequence_parallel_attention` over `mesh`.

    x: (..., N, ...) with the sequence on `dim`. The sequence is sharded over the
    ring dimension with `layout`, then contiguously over the Ulysses dimension:
    returns (..., N / (R U), ...). For rotary positions:
    `mesh_shard(torch.arange(N), mesh, layout, dim=0)`.
    """
    (_, ring, rho), (_, uly, upsilon) = mesh_groups(mesh, x.device)
    return shard(shard(x, rho, ring, layout, dim), upsilon, uly, "contiguous", dim)


def sequence_parallel_attention(q, k, v, *, mesh=None, causal=False, window=None, scale=None, layout="zigzag",
                                return_lse=False, pieces=None, ledger: MemoryLedger | None = None,
                                validate=True, segment_ids=None, prefix=None, softcap=0.0, alibi_slopes=None,
                                sinks=None):
    """Exact attention over a sequence sharded across a 2-D mesh (Ulysses x ring), or one device.

    Args:
        q: (B, Hq, Nq / (R U), D), k: (B, Hk, Nk / (R U), D), v: (B, Hk, Nk / (R U), Dv):
            this process's part (`mesh_shard(x, mesh, layout)`). Hq % U == 0, Hq % Hk == 0.
        mesh: a 2-D `DeviceMesh` of shape (R, U), dims named ("ring", "ulysses") or
            taken in that order; None in a single process (or a world of one): plain
            `exattn.attention` on the whole sequence.
        causal, window, scale: as in `exattn.attention`, over the full sequences.
        layout: how the ring dimension cuts the sequence, "zigzag" (default; balanced
            causal work) or "contiguous".
        return_lse: also return lse (B, Hq, Nq / (R U)), natural log, float32.
        pieces, ledger, validate: as in `ring_attention` (the ledger also records
            the all-to-all buffers; the ring's under "ring.").
        segment_ids: this process's part of the ids, cut like q and k
            (`mesh_shard(ids, mesh, layout, dim=1)`); a pair (q ids, k ids) or one tensor.
        prefix, softcap, sinks: as in `exattn.attention`; sinks whole on every process, whose
            gradient is that of the whole attention on every process.
        alibi_slopes: taken when R == 1 (plain Ulysses); refused (ValueError) with a ring.

    Returns:
        out (B, Hq, Nq / (R U), Dv) in q's dtype, or (out, lse). Differentiable in q, k, v, sinks.
    """
    return_lse = check_bool("return_lse", return_lse)
    layout = check_layout(layout)
    rules = {"segment_ids": segment_ids, "prefix": prefix, "softcap": softcap, "alibi_slopes": alibi_slopes,
             "sinks": sinks}
    if mesh is None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(
                f"mesh is None but torch.distributed runs {dist.get_world_size()} processes: pass the "
                "2-D DeviceMesh the sequence is sharded over (a (1, 1) mesh for one process)"
            )
        out, lse = local_attention(q, k, v, causal=causal, window=window, scale=scale, return_lse=True, **rules)
        return (out, lse) if return_lse else out
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    (ring_group, ring, _), (uly_group, uly, _) = mesh_groups(mesh, q.device)
    ring_args = {"causal": causal, "window": window, "scale": scale, "layout": layout, "pieces": pieces,
                 "validate": validate, "what": WHAT}
    if ring > 1:
        refuse_alibi(WHAT, alibi_slopes)
    if uly == 1:
        out, lse = ring_call(q, k, v, group=ring_group, ledger=ledger, **ring_args, **rules)
        lse = lse.to(torch.float32)
    else:
        local = None
        if ring > 1:
            def local(q_h, k_h, v_h, **head_rules):
                return ring_call(q_h, k_h, v_h, group=ring_group, ledger=ledger, record_inputs=False,
                                 ledger_prefix="ring.", **ring_args, **head_rules)
        out, lse = ulysses_call(q, k, v, causal=causal, window=window, scale=scale, group=uly_group,
                                backend="auto", ledger=ledger, validate=validate, local_kwargs={}, rules=rules,
                                local=local, what=WHAT)
    return (out, lse) if return_lse else out

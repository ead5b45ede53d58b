"""Parallel chunk groups for the KDA chunk walk: how many, and their workspace.

The chunk walk of :func:`kda_engram.kda.chunk.kda_prefill_walk` is serial per
sequence: one program per (sequence, head, V-tile) steps through every 64-token
chunk, so a long prompt on the few heads that tensor parallelism leaves on a GPU
(4-8) occupies a handful of the compute units and the launch is latency-bound
(measured: docs/design/kda_prefill.md). Cutting each sequence into ``G`` contiguous
groups of chunks turns one walk of ``n`` steps into

* **pass one**: every group but the last walks its ``L = n / G`` chunks from a
  zero state, giving its local end state ``H_g`` (V rows) and, with ``u = 0``
  from the identity, its transfer operator
  ``M_g = prod_c (diag(d_c) - w_c^T kg_c)`` (K rows);
* **the scan**: ``S_{g+1} = S_g M_g + H_g`` from the sequence's initial state,
  ``G - 1`` small fp32 products, giving every group its true start state;
* **pass two**: every group walks its chunks again from ``S_g``, writing the
  outputs, the checkpoints in its range and (last group) the final state.

The scan is exact algebra (the transfer operator is the chunk step itself, not
an approximation), so the result equals the serial walk up to rounding; the depth
drops from ``n`` to about ``2 n / G`` steps for about three times the work
(pass one has ``V + K`` rows). That trade pays only where the machine is
otherwise idle, which is what :func:`chunk_groups` decides.

Numerics: the grouped walk stays within the serial walk's error bound, so
``M_g`` is kept in fp32 and the scan's products run as fp32 ``ieee`` (fp32
operands, AMD) or ``tf32x3`` (bf16/fp16 walks on NVIDIA: cheaper than FMAs and far
below the walk's own rounding). Measurements: docs/design/kda_prefill.md; the
bounds are tests in ``tests/kda/test_groups.py``.
"""

from __future__ import annotations

import functools
import math

import torch

from ..constants import CHUNK_SIZE
from ..platform import arch, num_compute_units

__all__ = [
    "MAX_GROUPS",
    "MIN_GROUP_CHUNKS",
    "chunk_groups",
    "group_cost",
    "group_workspace",
    "group_workspace_layout",
    "group_workspace_numel",
    "resolve_groups",
]

# Below this many chunks per group the fixed cost of a group (its start state
# read, its H/M tiles written, one scan step) is no longer small against the
# steps it saves: each of those moves about as many bytes as one chunk step's
# operands (a [BV, K] fp32 tile is 16-32 KiB, a step reads ~60 KiB), so 8 chunks
# keep the overhead around 10 %. Applied per sequence inside the kernels, so a
# short sequence in a ragged batch is never split because a long one is.
MIN_GROUP_CHUNKS = 8
# The scan is serial in groups (one [K, K] x [K, BV] fp32 product per group) and
# the workspace grows with G; past 32 the scan's depth starts to matter.
MAX_GROUPS = 32

# Cost model of chunk_groups, in units of one chunk step of a lone program
# (the measurements that set each: docs/design/kda_prefill.md).
# _OVERLAP: 32-column programs one compute unit runs side by side before they slow
# each other down (partial overlap on NVIDIA; one per AMD CU's 64 KiB LDS).
# _PASS_ONE_STEP: pass one skips the output's two dots and loads (qg, aqk).
# _SCAN_STEP: one scan step (a 64 KiB operator read + a [K, K] x [K, 32] product,
# latency-bound; tf32x3 tensor-core product on NVIDIA, fp32 FMAs on AMD).
# _FIXED: the two extra launches and the group state traffic.
_OVERLAP_NVIDIA = 1.5
_OVERLAP_AMD = 1.0
_PASS_ONE_STEP = 0.6
_SCAN_STEP_NVIDIA = 2.0
_SCAN_STEP_AMD = 3.0
_FIXED = 10.0
# A split must beat the serial walk by this factor in the model: the model is
# coarse, and a near-tie is better left to the single launch.
_MARGIN = 0.9
_GRID_Z = 65535  # launch grid limit on the (sequence x group) axis


def _group_span(chunks: int, groups: int, min_len: int) -> tuple[int, int]:
    """``(L, G_n)``: chunks per group and non-empty groups of one sequence, as the
    kernels compute them: ``L = max(ceil(chunks / groups), min_len)``,
    ``G_n = max(ceil(chunks / L), 1)``."""
    length = max(-(-chunks // groups), min_len, 1)
    return length, max(-(-chunks // length), 1)


def _pass_time(units: float, depth: float, cus: int, overlap: float, weight: float) -> float:
    per_cu = math.ceil(units / cus)
    return depth * weight * max(1.0, per_cu / overlap)


def group_cost(
    groups: int,
    chunks_per_seq: int,
    num_seqs: int,
    num_heads: int,
    device: torch.device | str | None = None,
    *,
    head_k: int = 128,
    head_v: int = 128,
    min_group_chunks: int = MIN_GROUP_CHUNKS,
) -> float:
    """Modelled time of the chunk walk with ``groups`` groups, in chunk steps.

    A pass of ``units`` 32-column programs of depth ``L`` costs
    ``L * weight * max(1, ceil(units / CUs) / overlap)``: latency-bound (``L``)
    while every compute unit has at most ``overlap`` programs, throughput-bound
    beyond. ``G = 1`` is one pass of ``N H V / 32`` units over ``n`` chunks; a
    split adds pass one (``(G - 1) N H (V + K) / 32`` units), the scan
    (``G - 1`` serial steps) and a fixed cost.
    """
    cus = num_compute_units(device)
    on_amd = arch(device).startswith("gfx")
    overlap = _OVERLAP_AMD if on_amd else _OVERLAP_NVIDIA
    scan_step = _SCAN_STEP_AMD if on_amd else _SCAN_STEP_NVIDIA
    nh = max(num_seqs * num_heads, 1)
    chunks = max(chunks_per_seq, 0)
    if groups <= 1:
        return _pass_time(nh * head_v / 32, chunks, cus, overlap, 1.0)
    length, g_eff = _group_span(chunks, groups, min_group_chunks)
    if g_eff <= 1:
        return _pass_time(nh * head_v / 32, chunks, cus, overlap, 1.0) + _FIXED
    two = _pass_time(nh * g_eff * head_v / 32, length, cus, overlap, 1.0)
    one = _pass_time(nh * (g_eff - 1) * (head_v + head_k) / 32, length, cus, overlap, _PASS_ONE_STEP)
    return one + two + (g_eff - 1) * scan_step + _FIXED


@functools.lru_cache(maxsize=256)
def _chunk_groups_cached(chunks_per_seq, num_seqs, num_heads, device, head_k, head_v) -> int:
    serial = group_cost(1, chunks_per_seq, num_seqs, num_heads, device, head_k=head_k, head_v=head_v)
    best_cost, best = _MARGIN * serial, 1
    top = min(MAX_GROUPS, chunks_per_seq // MIN_GROUP_CHUNKS, _GRID_Z // max(num_seqs, 1))
    # G = 2 is depth-neutral (two passes of n/2 steps) and only adds work: never.
    for g in range(4, top + 1):
        cost = group_cost(g, chunks_per_seq, num_seqs, num_heads, device, head_k=head_k, head_v=head_v)
        if cost < best_cost:
            best_cost, best = cost, g
    return best


def chunk_groups(
    chunks_per_seq: int,
    num_seqs: int,
    num_heads: int,
    device: torch.device | str | None = None,
    *,
    head_k: int = 128,
    head_v: int = 128,
) -> int:
    """How many chunk groups to cut each sequence into (1 = the serial walk).

    Chosen from the device's compute-unit count
    (:func:`kda_engram.platform.num_compute_units`) with the cost model of
    :func:`group_cost`, over ``G = 1`` and ``4 <= G <= min(MAX_GROUPS,
    chunks_per_seq // MIN_GROUP_CHUNKS)``:

    * the fill points: while pass two's ``G N H V / 32`` programs (and pass one's
      ``(G - 1) N H (V + K) / 32``) fit the compute units at ``overlap``
      programs each, a larger G shortens the walk at no cost in throughput;
      past them the passes become throughput-bound and the 3x work of the split
      outweighs the shorter depth;
    * ``G = 1`` whenever the serial grid already fills the GPU (16 x 2k or
      64 x 512 at 32 heads on 132 SMs): a split only adds work there;
    * ``G = 2`` is never chosen (depth-neutral), nor groups shorter than
      :data:`MIN_GROUP_CHUNKS` chunks.

    ``chunks_per_seq`` is a static proxy, ``(T // 64) // N`` in
    :func:`~kda_engram.kda.chunk.kda_prefill_walk` (``cu_seqlens`` is never read on
    the host); the kernels apply the minimum group length per sequence, so in a
    ragged batch only the sequences long enough are split.

    The model's picks and the sweeps behind it: docs/design/kda_prefill.md
    ("Chunk groups: the model's picks and the sweeps").
    """
    for name, val in (("chunks_per_seq", chunks_per_seq), ("num_seqs", num_seqs), ("num_heads", num_heads)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 0:
            raise ValueError(f"{name}: expected a non-negative int, got {val!r}")
    dev = torch.device(device) if isinstance(device, str) else device
    return _chunk_groups_cached(chunks_per_seq, num_seqs, num_heads, dev, head_k, head_v)


def group_workspace_layout(groups: int, num_seqs: int, num_heads: int, head_k: int, head_v: int) -> dict:
    """Where each part lives in the flat fp32 workspace: ``{name: (offset, shape)}``.

    * ``"h"``: ``[N, G-1, H, V, K]`` -- pass one's local end states ``H_g`` (walk
      from zero; V-first like every state), fp32.
    * ``"m"``: ``[N, G-1, H, K, K]`` -- pass one's transfer operators ``M_g``
      (right-multiplied: ``S_end = S_start M_g + H_g``), fp32.
    * ``"s"``: ``[N, G, H, V, K]`` -- the scan's start state of every group
      (``S_0`` is the sequence's initial state or zeros), fp32; pass two reads it.

    The last group needs no ``H``/``M`` (nothing follows it). Separate regions,
    so no kernel reads what another program of the same launch writes.
    """
    N, G, H, K, V = num_seqs, groups, num_heads, head_k, head_v
    gm1 = max(G - 1, 0)
    parts = {"h": (N, gm1, H, V, K), "m": (N, gm1, H, K, K), "s": (N, G, H, V, K)}
    out, off = {}, 0
    for name, shape in parts.items():
        out[name] = (off, shape)
        off += math.prod(shape)
    out["numel"] = (off, ())
    return out


def group_workspace_numel(groups: int, num_seqs: int, num_heads: int, head_k: int = 128, head_v: int = 128) -> int:
    """fp32 elements of the group workspace: ``N H ((G-1)(V K + K K) + G V K)``;
    0 for ``G <= 1`` (the serial walk needs none)."""
    if groups <= 1:
        return 0
    return group_workspace_layout(groups, num_seqs, num_heads, head_k, head_v)["numel"][0]


def group_workspace(
    groups: int,
    num_seqs: int,
    num_heads: int,
    head_k: int = 128,
    head_v: int = 128,
    device: torch.device | str | None = None,
) -> torch.Tensor | None:
    """The caller-owned workspace of a grouped walk: a flat fp32 ``torch.empty``
    of :func:`group_workspace_numel` elements (``None`` for ``G <= 1``).

    ``torch.empty`` of the caching allocator, so an engine's memory profiling
    sees it and a CUDA graph can own it; the kernels write every element they
    later read (nothing needs zeroing). Layout: :func:`group_workspace_layout`.
    For 1 x 131072 tokens, H = 4, G = 16 (K = V = 128) it is 11.5 MiB.
    """
    n = group_workspace_numel(groups, num_seqs, num_heads, head_k, head_v)
    if n == 0:
        return None
    return torch.empty(n, dtype=torch.float32, device=device)


def resolve_groups(groups, min_group_chunks, T: int, num_seqs: int, H: int, K: int, V: int,
                   device) -> tuple[int, int]:
    """``(G, min_len)`` of a walk over ``T`` tokens in ``num_seqs`` sequences:
    ``groups`` forced (``min_len`` 1 unless given) or :func:`chunk_groups`' pick with
    ``(T // 64) // num_seqs`` chunks per sequence as the static proxy (``min_len``
    :data:`MIN_GROUP_CHUNKS` unless given). Host facts only, no device read; a
    ``groups`` or ``min_group_chunks`` that is not ``None`` or an int >= 1 is a
    ``ValueError``.

    A forced ``groups`` is clamped to what the sequences can use: no sequence has
    more than ``ceil(T / 64)`` chunks, so none has more than
    ``ceil(ceil(T / 64) / min_len)`` non-empty groups, and a larger ``G`` would
    only launch programs (and scan steps) that walk nothing. The clamp keeps every
    sequence's groups (``L_n``, ``G_n``) and so the results bit for bit, and keeps
    a forced ``G >= 2`` on the grouped walk (never below 2): a forced ``G`` costs
    time with the work, not with ``G``."""
    for name, val in (("groups", groups), ("min_group_chunks", min_group_chunks)):
        if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
            raise ValueError(f"{name}: expected None or an int >= 1, got {val!r}")
    if groups is None:
        if num_seqs == 0:
            return 1, 1
        n = chunk_groups((T // CHUNK_SIZE) // num_seqs, num_seqs, H, device, head_k=K, head_v=V)
        return n, MIN_GROUP_CHUNKS if min_group_chunks is None else min_group_chunks
    min_len = 1 if min_group_chunks is None else min_group_chunks
    usable = -(-(-(-T // CHUNK_SIZE)) // min_len)  # ceil(ceil(T / 64) / min_len)
    return min(groups, max(2, usable)), min_len

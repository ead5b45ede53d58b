"""Parallel chunk groups: the heuristic, the workspace, and the grouped walk of
``kda_prefill_walk`` against the serial walk (G = 1), ``reference.naive_chunk_walk``
(fp64) and ``naive_recurrent_kda``.

CPU (interpreter): fp32 operands, K = V = 16 or 32, few chunks per group. The
inputs use a weak decay (``raw_g`` shifted down, so ``2^g`` stays near 1 over a
chunk) wherever the scan must carry something: with the unit-scale gates of
``test_chunk`` the per-chunk decay underflows to 0 in fp32 and every transfer
operator ``M_g`` is 0, which would hide a wrong scan. GPU: bf16 at real shapes,
up to 131072 tokens; ``-k small`` selects the short cases run under
compute-sanitizer.
"""

import math

import pytest
import torch

import kda_engram.kda.chunk as chunk_mod
import kda_engram.kda.groups as groups_mod
from kda_engram.kda.chunk import kda_prefill_walk
from kda_engram.kda.groups import (
    MAX_GROUPS,
    MIN_GROUP_CHUNKS,
    _group_span,
    chunk_groups,
    group_cost,
    group_workspace,
    group_workspace_layout,
    group_workspace_numel,
    resolve_groups,
)
from kda_engram.kda.prefill import chunk_kda_prefill
from kda_engram.kda.reference import naive_chunk_operands, naive_chunk_walk, naive_recurrent_kda

from ..helpers import OPS, close, make_ops, make_raw, rel_rmse, run_chunk

C = 64
# Error bound of the grouped walk, the same as the serial walk's in test_chunk.
ATOL = 2e-4


def weak_raw(lengths, *, H=1, K=16, V=16, seed=0, device="cpu", strong=False):
    raw, cu = make_raw(lengths, H=H, K=K, V=V, seed=seed, device=device)
    if not strong:
        # 5 sigmoid(~-9): well under 1 % decay per token, and a small beta (the
        # delta rule's own forgetting), so the state and M_g carry over many chunks.
        raw["raw_g"] = raw["raw_g"] * 0.25 - 9.0
        raw["raw_beta"] = raw["raw_beta"] - 3.0
    return raw, cu


def nan_workspace(G, N, H, K, V):
    return torch.full((group_workspace_numel(G, N, H, K, V),), math.nan)


def parts(ws, G, N, H, K, V):
    lay = group_workspace_layout(G, N, H, K, V)
    return {n: ws[o: o + math.prod(s)].view(s) for n, (o, s) in lay.items() if n != "numel"}


class NoLaunch:
    """Stands in for a kernel that must not be launched."""

    def __init__(self, name):
        self.name = name

    def __getitem__(self, grid):
        raise AssertionError(f"{self.name} was launched")


@pytest.fixture
def h200(monkeypatch):
    """The heuristic as it runs on an H200 (132 SMs, sm_90)."""
    monkeypatch.setattr(groups_mod, "num_compute_units", lambda device=None: 132)
    monkeypatch.setattr(groups_mod, "arch", lambda device=None: "sm_90")
    groups_mod._chunk_groups_cached.cache_clear()
    yield
    groups_mod._chunk_groups_cached.cache_clear()


# ----------------------------------------------------------------------------- heuristic and workspace


ANCHOR_SHAPES = {  # name: (sequences, length, heads)
    "1x8k_H32": (1, 8192, 32), "1x32k_H32": (1, 32768, 32), "1x32k_H4": (1, 32768, 4),
    "1x128k_H4": (1, 131072, 4), "16x2k_H32": (16, 2048, 32), "64x512_H32": (64, 512, 32),
    "1x8k_H96": (1, 8192, 96),
}


def test_heuristic_on_h200_shapes(h200):
    picks = {}
    for name, (N, L, H) in ANCHOR_SHAPES.items():
        picks[name] = chunk_groups((N * L // C) // N, N, H, "cuda")
    # Long few-head sequences are split; batches and many heads already fill the GPU.
    assert picks["1x128k_H4"] >= 8 and picks["1x32k_H4"] >= 4, picks
    for name in ("16x2k_H32", "64x512_H32", "1x8k_H96", "1x8k_H32"):
        assert picks[name] == 1, picks
    assert all(g == 1 or 4 <= g <= MAX_GROUPS for g in picks.values()), picks


def test_heuristic_rules(h200, monkeypatch):
    for chunks in range(0, 600, 7):
        for nh in ((1, 1), (1, 4), (2, 8), (4, 32), (64, 32)):
            g = chunk_groups(chunks, *nh, "cuda")
            assert g != 2 and 1 <= g <= MAX_GROUPS
            if g > 1:
                assert chunks // g >= MIN_GROUP_CHUNKS  # groups are never shorter than the minimum
                assert group_cost(g, chunks, *nh, "cuda") < group_cost(1, chunks, *nh, "cuda")
    # Too short to split into 4 groups of the minimum length.
    assert chunk_groups(4 * MIN_GROUP_CHUNKS - 1, 1, 1, "cuda") == 1
    # The count follows the compute units: fewer units, fewer groups (never more).
    many = chunk_groups(2048, 1, 4, "cuda")
    monkeypatch.setattr(groups_mod, "num_compute_units", lambda device=None: 16)
    groups_mod._chunk_groups_cached.cache_clear()
    assert chunk_groups(2048, 1, 4, "cuda") < many
    # AMD: one resident program per CU, its own fit (304 CUs on an MI300X).
    monkeypatch.setattr(groups_mod, "num_compute_units", lambda device=None: 304)
    monkeypatch.setattr(groups_mod, "arch", lambda device=None: "gfx942")
    groups_mod._chunk_groups_cached.cache_clear()
    assert chunk_groups(2048, 1, 4, "cuda") >= 4
    assert chunk_groups(32, 64, 32, "cuda") == 1


def test_heuristic_picks_measured_optima(h200):
    # The H200 sweep in chunk_groups' docstring (tf32x3 scan): the model's pick
    # against the fastest measured G and the runner-up it may take instead.
    fastest = {  # (sequences, length, heads): counts within 8 % of the fastest
        (1, 32768, 4): {16}, (1, 131072, 4): {16, 32}, (1, 262144, 2): {32},
        (1, 32768, 8): {7, 8, 16}, (2, 32768, 4): {7, 8, 16}, (1, 16384, 4): {8, 16},
        (1, 8192, 4): {8, 16}, (1, 65536, 8): {7, 8, 16}, (4, 8192, 8): {1}, (1, 32768, 32): {1, 8},
    }
    for (N, L, H), ok in fastest.items():
        assert chunk_groups(L // C, N, H, "cuda") in ok, (N, L, H)


def test_scan_launch_knobs_leave_the_result_unchanged():
    # The scan's launch knobs change nothing in the result (interpreter, fp32).
    H, K, V = 1, 32, 32
    raw, cu = weak_raw([20 * C], H=H, K=K, V=V, seed=22)
    ops, _ = make_ops(raw, cu, -5.0)
    h0 = torch.randn(1, H, V, K)
    base = run_chunk(ops, cu, 0.2, initial_state=h0, output_final_state=True, groups=5)
    alt = run_chunk(ops, cu, 0.2, initial_state=h0, output_final_state=True, groups=5,
                    config={"BJ_scan": 16, "num_warps_scan": 4, "num_stages_scan": 2, "scan_precision": "ieee"})
    close(alt[0], base[0], 1e-5)
    close(alt[1], base[1], 1e-5)


GROUP_CONFIG_SWEEP = ([("BV_pass1", 16), ("BV_pass1", 32), ("BV_scan", 16), ("BV_scan", 32), ("BJ_scan", 16),
                       ("BJ_scan", 32)]
                      + [(f"num_warps_{p}", w) for p in ("pass1", "scan") for w in (1, 2, 4, 8, 16, 32)]
                      + [(f"num_stages_{p}", n) for p in ("pass1", "scan") for n in range(1, 9)]
                      + [("scan_precision", "ieee")] + [("min_group_chunks", m) for m in (1, 2, 3, 4)])


@pytest.mark.parametrize("name, value", GROUP_CONFIG_SWEEP, ids=[f"{n}={v}" for n, v in GROUP_CONFIG_SWEEP])
def test_every_accepted_grouped_walk_value_matches_the_reference(name, value):
    # Issue 54: each accepted value of the grouped walk's tuning keys against the
    # reference (scan_precision "tf32x3" / "tf32" exist on NVIDIA only; the
    # interpreter computes "ieee"), min_group_chunks any int >= 1.
    H, K, V = 1, 32, 32
    raw, cu = weak_raw([5 * C + 3, 2 * C], H=H, K=K, V=V, seed=54)
    ops, ref_ops = make_ops(raw, cu, -5.0)
    h0 = torch.randn(2, H, V, K, generator=torch.Generator().manual_seed(54))
    kw = dict(min_group_chunks=value) if name == "min_group_chunks" else dict(config={name: value})
    o, f = run_chunk(ops, cu, 0.2, initial_state=h0, output_final_state=True, groups=3, **kw)
    o_ref, f_ref, _ = naive_chunk_walk(ref_ops, cu_seqlens=cu, scale=0.2, initial_state=h0, groups=3)
    close(o, o_ref, ATOL)
    close(f, f_ref, ATOL)


def test_heuristic_bad_arguments():
    with pytest.raises(ValueError, match="num_heads"):
        chunk_groups(10, 1, -1)
    with pytest.raises(ValueError, match="chunks_per_seq"):
        chunk_groups(1.5, 1, 1)


def test_group_span_and_workspace():
    assert _group_span(10, 4, 1) == (3, 4)
    assert _group_span(9, 4, 1) == (3, 3)  # ceil: the last group may stay empty
    assert _group_span(2, 4, 3) == (3, 1)  # short sequence: one group
    assert _group_span(0, 4, 1) == (1, 1)  # empty sequence: one (pass-through) group
    G, N, H, K, V = 5, 3, 2, 16, 32
    n = group_workspace_numel(G, N, H, K, V)
    assert n == N * H * ((G - 1) * (V * K + K * K) + G * V * K)
    lay = group_workspace_layout(G, N, H, K, V)
    spans = sorted((o, o + math.prod(s)) for name, (o, s) in lay.items() if name != "numel")
    assert spans[0][0] == 0 and spans[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # disjoint and dense
    assert lay["h"][1] == (N, G - 1, H, V, K) and lay["m"][1] == (N, G - 1, H, K, K)
    assert lay["s"][1] == (N, G, H, V, K)
    ws = group_workspace(G, N, H, K, V, "cpu")
    assert ws.dtype == torch.float32 and ws.numel() == n
    assert group_workspace(1, N, H, K, V) is None and group_workspace_numel(1, N, H) == 0


# ----------------------------------------------------------------------------- grouped walk on the CPU


# chunks per sequence: 10 (split), 3 (split by forced G), 0, 1 (one chunk), 2.
RAGGED = [9 * C + 5, 3 * C, 0, 1, 2 * C]


@pytest.mark.parametrize("G", [1, 2, 4, 8])
def test_forced_groups_match_serial_and_reference(G):
    H, K, V = 2, 16, 16
    raw, cu = weak_raw(RAGGED, H=H, K=K, V=V, seed=11)
    ops, ref_ops = make_ops(raw, cu, -5.0)
    N = len(RAGGED)
    h0 = torch.randn(N, H, V, K)
    scale = 0.3
    o1, f1 = run_chunk(ops, cu, scale, initial_state=h0, output_final_state=True, groups=1)
    ws = nan_workspace(G, N, H, K, V) if G > 1 else None  # every element read must have been written
    o, f = run_chunk(ops, cu, scale, initial_state=h0, output_final_state=True, groups=G, group_workspace=ws)
    close(o, o1, atol=1e-5)
    close(f, f1, atol=1e-5)
    o_ref, f_ref, _ = naive_chunk_walk(ref_ops, cu_seqlens=cu, scale=scale, initial_state=h0, groups=G)
    close(o, o_ref, ATOL)
    close(f, f_ref, ATOL)
    o_nv, f_nv, _ = naive_recurrent_kda(**raw, lower_bound=-5.0, cu_seqlens=cu, initial_state=h0, scale=scale,
                                        output_final_state=True)
    close(o, o_nv, ATOL)
    close(f, f_nv, ATOL)
    if G > 1:
        p = parts(ws, G, N, H, K, V)
        # The 10-chunk sequence really went through the scan: its operators are not trivial.
        assert p["m"][0, 0].abs().max() > 1e-2
        assert torch.equal(p["s"][0, 0], h0[0])  # S_0 is the initial state


def test_strong_decay_and_softplus_gate():
    # Operators that underflow to exactly 0 (unit-scale gates) and the unbounded gate.
    H, K, V = 1, 16, 16
    lengths = [8 * C, 5 * C + 3]
    for lower_bound, strong in ((-5.0, True), (None, False)):
        raw, cu = weak_raw(lengths, H=H, K=K, V=V, seed=12, strong=strong)
        ops, ref_ops = make_ops(raw, cu, lower_bound)
        h0 = torch.randn(2, H, V, K)
        o, f = run_chunk(ops, cu, 0.25, initial_state=h0, output_final_state=True, groups=4)
        o_ref, f_ref, _ = naive_chunk_walk(ref_ops, cu_seqlens=cu, scale=0.25, initial_state=h0)
        assert torch.isfinite(o).all() and torch.isfinite(f).all()
        close(o, o_ref, ATOL)
        close(f, f_ref, ATOL)


def test_state_cache_mixed_rows_and_sentinels():
    H, K, V = 1, 32, 32
    lengths = [7 * C + 9, 4 * C, 0, 6 * C, C + 1, 0]
    N = len(lengths)
    raw, cu = weak_raw(lengths, H=H, K=K, V=V, seed=13)
    cu = cu.to(torch.int32)
    ops, ref_ops = make_ops(raw, cu, -5.0)
    h0 = torch.randn(N, H, V, K)
    slots = 10
    cache = torch.full((slots, H, V, K), math.nan)  # NaN sentinels: unread rows stay NaN, has=False rows are never read
    idx = torch.tensor([4, -1, 7, 0, 2, 9])
    has = torch.tensor([True, True, False, False, True, True])
    for n in range(N):
        if idx[n] >= 0 and has[n]:
            cache[int(idx[n])] = h0[n]
    o, final = run_chunk(ops, cu, 0.2, state_cache=cache, state_indices=idx, has_initial_state=has, groups=4)
    assert final is None
    start = torch.where((has & (idx >= 0))[:, None, None, None], h0, torch.zeros_like(h0))
    o_ref, f_ref, _ = naive_chunk_walk(ref_ops, cu_seqlens=cu, scale=0.2, initial_state=start)
    close(o, o_ref, ATOL)
    for n in range(N):
        if idx[n] >= 0:
            close(cache[int(idx[n])], f_ref[n], ATOL)  # written back, once, by the last group
    assert torch.isnan(cache[[1, 3, 5, 6, 8]]).all()  # rows no sequence owns


def aligned(length):
    return list(range(C, length + 1, C))


@pytest.mark.parametrize("dest", ["staging", "paged"])
def test_checkpoints_in_every_group_and_on_boundaries(dest):
    # 12 chunks, G = 4: groups of 3 chunks, boundaries at 192, 384, 576 tokens.
    # One sequence per offset (same length), so one launch covers all of them:
    # offsets inside every group, on every boundary, and at the end.
    H, K, V = 1, 16, 16
    length = 12 * C
    offsets = aligned(length)
    N = len(offsets)
    raw, cu = weak_raw([length] * N, H=H, K=K, V=V, seed=14)
    ops, ref_ops = make_ops(raw, cu, -5.0)
    offs = torch.tensor(offsets, dtype=torch.int32)
    h0 = torch.randn(N, H, V, K)
    ws = nan_workspace(4, N, H, K, V)
    if dest == "staging":
        ck = torch.full((N, H, V, K), math.nan)
        o, f = run_chunk(ops, cu, 0.2, initial_state=h0, output_final_state=True, groups=4,
                         checkpoint_state=ck, checkpoint_offsets=offs, group_workspace=ws)
        rows = list(range(N))
    else:
        slots = 2 * N + 2
        ck = torch.full((slots, H, V, K), math.nan)
        ck[:N] = h0
        rows = [N + 1 + n for n in range(N)]
        rows[5] = -1  # one sequence exports to no row
        o, f = run_chunk(ops, cu, 0.2, groups=4, group_workspace=ws, checkpoint_state=ck, checkpoint_offsets=offs,
                         checkpoint_state_indices=torch.tensor(rows), state_cache=ck,
                         state_indices=torch.arange(N), has_initial_state=torch.ones(N, dtype=torch.bool))
    o_ref, f_ref, c_ref = naive_chunk_walk(ref_ops, cu_seqlens=cu, scale=0.2, initial_state=h0, checkpoint_offsets=offs)
    close(o, o_ref, ATOL)
    for n in range(N):
        if rows[n] >= 0:
            close(ck[rows[n]], c_ref[n], ATOL)
        close(ck[n] if dest == "paged" else f[n], f_ref[n], ATOL)
    if dest == "paged":
        assert torch.isnan(ck[[N, N + 1 + 5]]).all()
    # A snapshot on a boundary (sequence 2: 192 tokens = 3 chunks, the end of
    # group 0) is the scan's start state of the next group.
    for n, g in ((2, 1), (5, 2), (8, 3)):
        if rows[n] >= 0:
            close(ck[rows[n]], parts(ws, 4, N, H, K, V)["s"][n, g], 1e-5)


def test_ragged_short_sequences_are_not_split():
    # groups=4 with a 3-chunk minimum: 12 chunks -> 4 groups, 5 -> 2, 2 / 1 / 0 -> one.
    H, K, V = 1, 16, 16
    lengths = [12 * C, 2 * C, 5 * C - 7, C, 0]
    N = len(lengths)
    raw, cu = weak_raw(lengths, H=H, K=K, V=V, seed=15)
    ops, ref_ops = make_ops(raw, cu, -5.0)
    h0 = torch.randn(N, H, V, K)
    ws = nan_workspace(4, N, H, K, V)
    o, f = run_chunk(ops, cu, 0.2, initial_state=h0, output_final_state=True, groups=4, min_group_chunks=3,
                     group_workspace=ws)
    o_ref, f_ref, _ = naive_chunk_walk(ref_ops, cu_seqlens=cu, scale=0.2, initial_state=h0)
    close(o, o_ref, ATOL)
    close(f, f_ref, ATOL)
    p = parts(ws, 4, N, H, K, V)
    live_h = [[not bool(torch.isnan(p["h"][n, g]).all()) for g in range(3)] for n in range(N)]
    # Pass one ran only for the split sequences' non-last groups.
    assert live_h == [[True, True, True], [False] * 3, [True, False, False], [False] * 3, [False] * 3]
    live_s = [[not bool(torch.isnan(p["s"][n, g]).all()) for g in range(4)] for n in range(N)]
    assert live_s == [[True] * 4, [True, False, False, False], [True, True, False, False],
                      [True, False, False, False], [True, False, False, False]]


def test_error_bound_vs_fp64():
    # One 64-chunk sequence: the grouped walk's error against the fp64 chunk walk
    # stays at the serial walk's (measured: 1.2e-7 to 1.8e-7 on outputs and
    # states for G = 1, 4, 8, 32 alike, far inside the 2e-4 bound of every
    # chunk-kernel test; the numbers are in kda_engram.kda.groups' docstring).
    H, K, V = 1, 16, 16
    length = 64 * C
    raw, cu = weak_raw([length], H=H, K=K, V=V, seed=16)
    ops, _ = make_ops(raw, cu, -5.0)
    raw64 = {n: t.double() for n, t in raw.items()}
    ref64 = naive_chunk_operands(**raw64, cu_seqlens=cu, lower_bound=-5.0)
    h0 = torch.randn(1, H, V, K, dtype=torch.float64)
    o64, f64, _ = naive_chunk_walk(ref64, cu_seqlens=cu, scale=0.25, initial_state=h0)
    errs = {}
    for G in (1, 4, 8, 32):
        o, f = run_chunk(ops, cu, 0.25, initial_state=h0.float(), output_final_state=True, groups=G)
        errs[G] = ((o.double() - o64).abs().max().item(), (f.double() - f64).abs().max().item())
    for G, (eo, ef) in errs.items():
        assert eo < ATOL and ef < ATOL, errs
        assert eo <= 4 * errs[1][0] + 1e-6 and ef <= 4 * errs[1][1] + 1e-6, errs


def test_heuristic_path_splits_on_the_interpreter():
    # CPU_COMPUTE_UNITS = 8: one 40-chunk sequence at one head is split by default,
    # and the result is the serial walk's.
    H, K, V = 1, 16, 16
    length = 40 * C
    assert chunk_groups(length // C, 1, H, "cpu", head_k=K, head_v=V) >= 4
    raw, cu = weak_raw([length], H=H, K=K, V=V, seed=17)
    ops, ref_ops = make_ops(raw, cu, None)
    o, f = run_chunk(ops, cu, 0.25, output_final_state=True)
    o_ref, f_ref, _ = naive_chunk_walk(ref_ops, cu_seqlens=cu, scale=0.25)
    close(o, o_ref, ATOL)
    close(f, f_ref, ATOL)


def test_serial_walk_is_one_launch(monkeypatch):
    monkeypatch.setattr(chunk_mod, "_kda_group_pass_one_kernel", NoLaunch("pass one"))
    monkeypatch.setattr(chunk_mod, "_kda_group_scan_kernel", NoLaunch("scan"))
    raw, cu = weak_raw([3 * C, 70], H=1, K=16, V=16, seed=18)
    ops, ref_ops = make_ops(raw, cu, -5.0)
    for groups in (1, None):  # None: the heuristic keeps short batches serial
        o, f = run_chunk(ops, cu, 0.2, output_final_state=True, groups=groups)
        o_ref, f_ref, _ = naive_chunk_walk(ref_ops, cu_seqlens=cu, scale=0.2)
        close(o, o_ref, ATOL)
    with pytest.raises(AssertionError, match="pass one"):
        run_chunk(ops, cu, 0.2, groups=4)


def test_a_forced_group_count_is_clamped_to_what_the_sequences_can_use():
    # Issue 54: groups=1000 at T = 70 launched 1000 groups per sequence and a
    # 999-step scan (196 s in the interpreter) for two chunks of work.
    T = 70  # no sequence has more than two chunks
    assert resolve_groups(1000, None, T, 2, 1, 16, 16, "cpu") == (2, 1)
    assert resolve_groups(1000, 1, 10 * C, 1, 1, 16, 16, "cpu") == (10, 1)
    assert resolve_groups(1000, 3, 10 * C, 1, 1, 16, 16, "cpu") == (4, 3)  # ceil(10 / 3) groups of 3
    assert resolve_groups(3, None, 10, 1, 1, 16, 16, "cpu") == (2, 1)  # a forced split stays grouped
    assert resolve_groups(1, None, 10 * C, 1, 1, 16, 16, "cpu") == (1, 1)
    assert resolve_groups(7, None, 10 * C, 1, 1, 16, 16, "cpu") == (7, 1)  # within reach: as forced


def test_a_huge_forced_group_count_launches_the_usable_groups_with_the_same_results(monkeypatch):
    raw, cu = weak_raw([70, 3], H=1, K=16, V=16, seed=54)
    ops, _ = make_ops(raw, cu, -5.0)
    o2, f2 = run_chunk(ops, cu, 0.3, output_final_state=True, groups=2)
    grids = []

    class Recording:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            grids.append(grid)
            return self.kernel[grid]

    monkeypatch.setattr(chunk_mod, "_kda_chunk_walk_kernel", Recording(chunk_mod._kda_chunk_walk_kernel))
    o, f = run_chunk(ops, cu, 0.3, output_final_state=True, groups=10**6)
    assert grids == [(1, 1, 2 * 2)]  # N x G programs with G = 2, not 10**6
    assert torch.equal(o, o2) and torch.equal(f, f2)
    o_nv, f_nv, _ = naive_recurrent_kda(**raw, lower_bound=-5.0, cu_seqlens=cu, scale=0.3, output_final_state=True)
    close(o, o_nv, ATOL)
    close(f, f_nv, ATOL)


def test_prefill_passes_groups():
    H, K, V = 1, 16, 16
    lengths = [9 * C + 1, 40]
    raw, cu = weak_raw(lengths, H=H, K=K, V=V, seed=19)
    h0 = torch.randn(2, H, V, K)
    kw = dict(lower_bound=-5.0, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    o1, f1 = chunk_kda_prefill(**raw, **kw, groups=1)
    o4, f4 = chunk_kda_prefill(**raw, **kw, groups=4)
    close(o4, o1, 1e-5)
    close(f4, f1, 1e-5)
    o_nv, f_nv, _ = naive_recurrent_kda(**raw, **kw)
    close(o4, o_nv, ATOL)
    close(f4, f_nv, ATOL)


def test_empty_sequences_pass_state_through():
    H, K, V = 1, 16, 16
    lengths = [0, 0, 2 * C]
    raw, cu = weak_raw(lengths, H=H, K=K, V=V, seed=20)
    ops, _ = make_ops(raw, cu, -5.0)
    h0 = torch.randn(3, H, V, K)
    cache = torch.full((3, H, V, K), math.nan)
    cache[0] = h0[0]
    o, _ = run_chunk(ops, cu, 0.2, state_cache=cache, state_indices=torch.tensor([0, 1, 2]),
                     has_initial_state=torch.tensor([True, False, False]), groups=4)
    assert torch.equal(cache[0], h0[0])  # zero tokens: the state is unchanged
    assert torch.equal(cache[1], torch.zeros_like(h0[1]))  # has_initial_state False: starts (and ends) at zero
    assert torch.isfinite(cache[2]).all()


@pytest.mark.parametrize(
    "change, exc, msg",
    [
        (dict(groups=0), ValueError, "groups"),
        (dict(groups=-3), ValueError, "groups"),
        (dict(groups=2.0), ValueError, "groups"),
        (dict(groups=True), ValueError, "groups"),
        (dict(groups=4, min_group_chunks=0), ValueError, "min_group_chunks"),
        (dict(groups=4, group_workspace=torch.zeros(10)), ValueError, "at least"),
        (dict(groups=4, group_workspace="f64"), TypeError, "group_workspace"),
        (dict(groups=4, group_workspace="strided"), ValueError, "not contiguous"),
        (dict(groups=4, config={"BV_pass1": 24}), ValueError, "BV_pass1"),
        (dict(groups=4, config={"BV_scan": 8}), ValueError, "BV_scan"),
        (dict(groups=4, config={"BJ_scan": 24}), ValueError, "BJ_scan"),
        (dict(groups=4, config={"scan_precision": "bf16"}), ValueError, "scan_precision"),
    ],
    ids=["zero", "negative", "float", "bool", "min_len", "ws_small", "ws_dtype", "ws_strided", "bv1", "bvs",
         "bj", "precision"],
)
def test_bad_group_arguments(change, exc, msg):
    H, K, V = 1, 16, 16
    raw, cu = weak_raw([3 * C], H=H, K=K, V=V, seed=21)
    ops, _ = make_ops(raw, cu, -5.0)
    need = group_workspace_numel(4, 1, H, K, V)
    change = dict(change)
    if change.get("group_workspace") == "f64":
        change["group_workspace"] = torch.zeros(need, dtype=torch.float64)
    elif change.get("group_workspace") == "strided":
        change["group_workspace"] = torch.zeros(2 * need)[::2]
    with pytest.raises(exc, match=msg):
        run_chunk(ops, cu, 0.2, **change)


def test_a_group_grid_past_the_launch_limit_is_refused():
    # 1100 sequences, one of 60 chunks: G clamps to 60, and N x G = 66000 > 65535.
    raw, cu = weak_raw([60 * C] + [0] * 1099, seed=22)
    ops, _ = make_ops(raw, cu, -5.0)
    with pytest.raises(ValueError, match=r"^groups: N x G must be at most 65535 \(grid\), got N=1100, G=60$"):
        run_chunk(ops, cu, 0.2, groups=70000)


# ----------------------------------------------------------------------------- GPU


def gpu_ops(lengths, heads, device, *, seed=0, lower_bound=-5.0, strong=False):
    raw, cu = weak_raw(lengths, H=heads, K=128, V=128, seed=seed, device=device, strong=strong)
    ops, ref_ops = make_ops(raw, cu, lower_bound, dtype=torch.bfloat16)
    return raw, cu, ops, ref_ops


@pytest.mark.gpu
@pytest.mark.parametrize("G", [1, 4, 8, 32])
def test_gpu_small_groups_match_reference(gpu, G):
    lengths = [1, 63, 64, 65, 3000, 5000, 0]
    heads = 4
    raw, cu, ops, ref_ops = gpu_ops(lengths, heads, gpu, seed=1)
    N = len(lengths)
    h0 = torch.randn(N, heads, 128, 128, device=gpu) * 0.1
    o1, f1 = run_chunk(ops, cu, 128**-0.5, initial_state=h0, output_final_state=True, groups=1)
    o, f = run_chunk(ops, cu, 128**-0.5, initial_state=h0, output_final_state=True, groups=G)
    assert torch.isfinite(o).all() and torch.isfinite(f).all()
    o_ref, f_ref, _ = naive_chunk_walk(ref_ops, cu_seqlens=cu, scale=128**-0.5, initial_state=h0)  # fp32 operands
    e1 = (rel_rmse(o1, o_ref), rel_rmse(f1, f_ref))
    e = (rel_rmse(o, o_ref), rel_rmse(f, f_ref))
    # bf16 dots: the serial walk's own error is the yardstick (the weak decay here
    # keeps more tokens in the state than test_chunk's inputs, hence 2e-2).
    assert e[0] < 2e-2 and e[1] < 2e-2, (e, e1)
    assert e[0] <= 1.5 * e1[0] + 1e-3 and e[1] <= 1.5 * e1[1] + 1e-3, (e, e1)
    assert rel_rmse(o, o1) < 1e-2 and rel_rmse(f, f1) < 1e-2


@pytest.mark.gpu
def test_gpu_scan_precision(gpu):
    # The default tf32x3 scan against the fp32 FMA (ieee) one, on the same pass-one
    # operators: the start states of all 32 groups (fp32) must agree to about
    # fp32 rounding, far below the bf16 walk's own error (~1e-3 relative).
    heads, G = 2, 32
    lengths = [G * 8 * C]
    raw, cu, ops, _ = gpu_ops(lengths, heads, gpu, seed=5)
    h0 = torch.randn(1, heads, 128, 128, device=gpu) * 0.1
    starts = {}
    for prec in ("ieee", "tf32x3", "tf32"):
        ws = group_workspace(G, 1, heads, 128, 128, gpu)
        run_chunk(ops, cu, 128**-0.5, initial_state=h0, output_final_state=True, groups=G,
                  group_workspace=ws, config={"scan_precision": prec})
        starts[prec] = parts(ws, G, 1, heads, 128, 128)["s"].clone()
    ref = starts["ieee"]
    assert ref[:, -1].abs().max() > 1e-2  # the weak decay carries state to the last group
    assert rel_rmse(starts["tf32x3"], ref) < 5e-6, rel_rmse(starts["tf32x3"], ref)
    # Plain tf32 (10-bit mantissa) is measurably coarser: the test can tell them apart.
    assert rel_rmse(starts["tf32"], ref) > 4 * rel_rmse(starts["tf32x3"], ref)
    default_ws = group_workspace(G, 1, heads, 128, 128, gpu)
    run_chunk(ops, cu, 128**-0.5, initial_state=h0, output_final_state=True, groups=G, group_workspace=default_ws)
    assert torch.equal(parts(default_ws, G, 1, heads, 128, 128)["s"], starts["tf32x3"])


@pytest.mark.gpu
def test_gpu_small_groups_cache_checkpoints(gpu):
    heads = 2
    lengths = [40 * C, 64, 0, 17 * C + 5, 1]
    N = len(lengths)
    raw, cu, ops, ref_ops = gpu_ops(lengths, heads, gpu, seed=2)
    h0 = torch.randn(N, heads, 128, 128, device=gpu) * 0.1
    cache = torch.full((16, heads, 128, 128), math.nan, device=gpu)
    idx = torch.tensor([3, -1, 5, 0, 7], device=gpu, dtype=torch.int32)
    has = torch.tensor([True, True, False, False, True], device=gpu)
    for n in (0, 4):
        cache[int(idx[n])] = h0[n]
    # 40 chunks / 8 groups = 5: 320 is a boundary, 1088 inside group 3.
    offs = torch.tensor([320, 64, 0, 1088, 0], dtype=torch.int32, device=gpu)
    ck_rows = torch.tensor([9, -1, -1, 10, 11], dtype=torch.int32, device=gpu)
    o, final = run_chunk(ops, cu, 128**-0.5, state_cache=cache, state_indices=idx, has_initial_state=has,
                         checkpoint_state=cache, checkpoint_offsets=offs, checkpoint_state_indices=ck_rows, groups=8)
    assert final is None
    start = torch.where((has & (idx >= 0))[:, None, None, None], h0, torch.zeros_like(h0))
    o_ref, f_ref, c_ref = naive_chunk_walk(ref_ops, cu_seqlens=cu, scale=128**-0.5, initial_state=start,
                                     checkpoint_offsets=offs)
    assert rel_rmse(o, o_ref) < 2e-2
    for n, r in ((0, 3), (2, 5), (3, 0), (4, 7)):
        assert rel_rmse(cache[r], f_ref[n]) < 2e-2, n
    for n, r in ((0, 9), (3, 10)):
        assert rel_rmse(cache[r], c_ref[n]) < 2e-2, n
    assert torch.isnan(cache[[1, 2, 4, 6, 8, 11, 12, 13, 14, 15]]).all()


@pytest.mark.gpu
def test_gpu_small_groups_cuda_graph(gpu):
    heads = 4
    lengths = [64 * C, 100]
    raw, cu, ops, _ = gpu_ops(lengths, heads, gpu, seed=3)
    h0 = torch.randn(2, heads, 128, 128, device=gpu) * 0.1
    out = torch.empty_like(ops["u"])
    ws = group_workspace(8, 2, heads, 128, 128, gpu)

    def step():
        return run_chunk(ops, cu, 0.1, out=out, initial_state=h0, output_final_state=True, groups=8,
                         group_workspace=ws, check_inputs=False)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, final_g = step()
    graph.replay()
    torch.cuda.synchronize()
    o_e, f_e = run_chunk(ops, cu, 0.1, initial_state=h0, output_final_state=True, groups=8)
    assert torch.equal(out, o_e)
    assert torch.equal(final_g, f_e)


@pytest.mark.gpu
@pytest.mark.gpu_mem(10)  # the fp32 reference operands of 131072 tokens: about 4 GiB
def test_gpu_groups_131072_tokens(gpu):
    # The long few-head case the groups are for: 1 x 131072 tokens, H = 4, end to
    # end through chunk_kda_prefill (bf16), every forced G against G = 1, and the
    # heuristic's pick; then the fp32 chunk walk as the reference.
    heads, length = 4, 131072
    raw, cu = weak_raw([length], H=heads, K=128, V=128, seed=4, device=gpu)
    x = {n: (t.to(torch.bfloat16) if n not in ("A_log", "dt_bias") else t) for n, t in raw.items()}
    h0 = torch.randn(1, heads, 128, 128, device=gpu) * 0.1
    kw = dict(lower_bound=-5.0, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    res = {G: chunk_kda_prefill(**x, **kw, groups=G) for G in (1, 4, 8, 32, None)}
    raw32 = {n: t.float() for n, t in x.items()}
    ref_ops = naive_chunk_operands(**raw32, cu_seqlens=cu, lower_bound=-5.0)
    o_ref, f_ref, _ = naive_chunk_walk(ref_ops, cu_seqlens=cu, scale=128**-0.5, initial_state=h0)
    e1 = (rel_rmse(res[1][0], o_ref), rel_rmse(res[1][1], f_ref))
    for G, (o, f) in res.items():
        assert torch.isfinite(o).all() and torch.isfinite(f).all(), G
        e = (rel_rmse(o, o_ref), rel_rmse(f, f_ref))
        assert e[0] < 2e-2 and e[1] < 2e-2, (G, e, e1)
        assert e[0] <= 1.5 * e1[0] + 1e-3 and e[1] <= 1.5 * e1[1] + 1e-3, (G, e, e1)
        assert rel_rmse(o, res[1][0]) < 2e-2 and rel_rmse(f, res[1][1]) < 2e-2, G

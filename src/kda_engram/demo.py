"""``kda-engram demo``: the system end to end on an embedded configuration.

Every stage prints what it checked (max error against the plain-PyTorch
reference, with the bound it must meet) and how long it took; the exit status is
non-zero if any check fails.
"""

from __future__ import annotations

import os

import torch


def _pick_device(device: str | None) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cpu":
        # Kernels run under the Triton interpreter on the CPU; this must be set
        # before any kernel module is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return dev


def run_demo(device: str | None = None, seed: int = 0) -> int:
    from kda_engram.cli import Checks, Stage
    from kda_engram.engram.reference import engram_gate_sharded_ref, engram_post_wkv_ref
    from kda_engram.kda.metadata import prepare_chunk_indices
    from kda_engram.kda.reference import naive_chunk_kda, naive_recurrent_kda

    dev = _pick_device(device)
    torch.manual_seed(seed)
    checks = Checks()
    lengths = [1, 63, 64, 65, 200]
    H, K = 2, 32
    print(f"kda-engram demo on {dev}: KDA prompts of lengths {lengths}, H={H}, K=V={K}; Engram dim 64, hc 4")

    T = sum(lengths)
    cu = torch.tensor([0] + lengths, device=dev).cumsum(0)
    f64 = dict(dtype=torch.float64, device=dev)
    q, k, raw_g = (torch.randn(1, T, H, K, **f64) for _ in range(3))
    v = torch.randn(1, T, H, K, **f64)
    raw_beta = torch.randn(1, T, H, **f64)
    A_log, dt_bias = torch.randn(H, **f64) * 0.5, torch.randn(H * K, **f64)
    h0 = torch.randn(len(lengths), H, K, K, **f64)
    ckpt = torch.tensor([0, 0, 64, 64, 128], device=dev)
    kw = dict(lower_bound=-5.0, cu_seqlens=cu, initial_state=h0, output_final_state=True, checkpoint_offsets=ckpt)

    with Stage("chunk metadata on the device"):
        idx = prepare_chunk_indices(cu, total_tokens=T)
        print(f"  {int((idx[:, 0] >= 0).sum())} chunks in {idx.shape[0]} rows (static bound T//64 + N)")
    with Stage("KDA reference: recurrent vs chunked vs 4 chunk groups (fp64)"):
        o_r, f_r, c_r = naive_recurrent_kda(q, k, v, raw_g, raw_beta, A_log, dt_bias, **kw)
        for groups in (1, 4):
            o_c, f_c, c_c = naive_chunk_kda(q, k, v, raw_g, raw_beta, A_log, dt_bias, groups=groups, **kw)
            checks.error(f"chunked (groups={groups}) output vs recurrent", o_c, o_r, 1e-10)
            checks.error(f"chunked (groups={groups}) final state vs recurrent", f_c, f_r, 1e-10)
            checks.error(f"chunked (groups={groups}) checkpoints vs recurrent", c_c, c_r, 1e-10)
    with Stage("Engram gate reference: dim-sharded over 4 ranks vs one rank"):
        Te, hc, dim = 16, 4, 64
        hidden = torch.randn(Te, hc, dim, **f64)
        kv = torch.randn(Te, (hc + 1) * dim, **f64)
        qw, kw_ = torch.randn(hc, dim, **f64), torch.randn(hc, dim, **f64)
        full = engram_post_wkv_ref(hidden, kv, qw, kw_, eps=1e-6)
        sharded = engram_gate_sharded_ref(hidden, kv, qw, kw_, tp_size=4, eps=1e-6)
        checks.error("sharded gate vs unsharded gate", sharded, full, 1e-12)

    if checks.failed:
        print(f"demo FAILED: {len(checks.failed)} check(s) out of bounds: {', '.join(checks.failed)}")
        return 1
    print("demo passed: every check within its bound")
    return 0

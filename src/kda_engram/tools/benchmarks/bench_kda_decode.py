"""KDA decode, ours vs fla-core's ``fused_recurrent_kda``, side by side in one process.

    python -m kda_engram.tools.benchmarks.bench_kda_decode                 # the issue's cases + one multi-token case
    python -m kda_engram.tools.benchmarks.bench_kda_decode --sweep         # also time every (BLOCK_V, num_warps)
    python -m kda_engram.tools.benchmarks.bench_kda_decode --cases 256x32 --no-peer
    python -m kda_engram.tools.benchmarks.bench_kda_decode --no-layer      # skip the layer-decode rows
    kda-engram bench kda-decode                                            # the same rows through the CLI

Inputs (the anchor setting): bf16 q, k, v, raw gate, raw beta, ``[B, H, 128]``;
fp32 ``A_log [H]``, ``dt_bias [H*128]``; ``lower_bound = -5``; in-kernel L2 norm,
gate and beta sigmoid; fp32 state, 64 KiB per head. Times are
``triton.testing.do_bench`` medians (it flushes L2 between runs), under
``torch.inference_mode()``.

The peer is timed two ways and the faster one counts (``peer_ms``):

* ``fla_api`` -- the public ``fused_recurrent_kda(..., initial_state=h0,
  output_final_state=True)`` with a K-first ``[B, H, K, V]`` ``h0``; it reads h0 and
  writes a new final-state tensor (the same bytes as in place). This is how
  the anchor measurement gave fla (0.389 ms at B = 256, H = 32).
* ``fla_inplace`` -- fla's continuous-batching path (``fused_recurrent_kda_fwd``
  with ``ssm_state_indices``, ``inplace_final_state=True``, ``state_v_first=True``):
  the same V-first paged cache, the same indices and the same in-place update as
  ours, so it is the exact like-for-like comparison; its outputs and states are
  also checked against ours (``max_abs_diff``, ``max_abs_diff_state``).

Ours runs with ``check_inputs=False`` (as an engine does inside a CUDA graph),
with an fp32 state cache (``ours_ms``) and a bf16 one (``ours_bf16_ms``); fla's
in-place path is also offered a bf16 cache (``fla_inplace_bf16_ms``, or the
reason it was skipped in ``peer_note``). Every row also times the default
``check_inputs=True`` call, the same way in the same process: ``checked_ms``
(fp32 state) and ``checked_bf16_ms`` (bf16 state), each with
``within_check_bound`` / ``within_check_bound_bf16``: the default call costs at
most the no-check call + max(0.02 ms, 3%). The one-token cases call
``kda_decode``, the ``_S*`` case ``kda_decode_multi``. HBM floor = (state read + state write(s) + inputs +
outputs) / copy bandwidth, each row against its own floor (a bf16 state moves
half the state bytes), the bandwidth measured here with a 1 GiB device-to-device
copy (read + write counted).

Layer-decode rows (``layer_B*_H*``): ``KimiDeltaAttention``'s decode rows from the
projection output to the ``o_proj`` input at Kimi-Linear sizes (hidden 2304, 32
heads of 128, low-rank gates of rank 128, conv 4, bf16, fp32 state): the fused
one-launch step (``ours_ms``) against the current multi-launch step (conv launch,
``kda_decode``, PyTorch gated RMSNorm; ``peer_ms``), and the whole layer forward
both ways (``layer_fused_ms`` / ``layer_unfused_ms``, projections included). The
fused step's default call is ``checked_ms`` (bound as above), the layer forward's
``layer_fused_checked_ms`` (bound ``within_check_bound_layer``).
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from ...kda.decode import decode_tiling, kda_decode, kda_decode_multi, launch_decode
from .common import bench_ms as bench
from .common import copy_bandwidth, default_check_bound_ms, no_gpu_exit, random_kda_inputs, write_json

K = V = 128
LOWER_BOUND = -5.0
# (B, H, S): S = None is the one-token decode; S > 1 the speculative multi-token variant.
CASES = [(64, 32, None), (256, 32, None), (1024, 8, None), (256, 32, 4)]
QUICK_CASES = CASES[:3]
SWEEP = [(bv, nw) for bv in (16, 32, 64) for nw in (2, 4, 8)]
# A bf16 tile is half the bytes of an fp32 one: the bf16 sweep also tries 128 rows,
# and the hardware conversion (``native``) against the integer RTNE.
SWEEP_BF16 = [(bv, nw, native) for bv in (16, 32, 64, 128) for nw in (2, 4, 8) for native in (True, False)]


def case_name(B, H, S=None):
    return f"B{B}_H{H}" + (f"_S{S}" if S else "")


def parse_case(text: str):
    parts = text.lower().replace("x", " ").replace("s", " ").split()
    B, H = int(parts[0]), int(parts[1])
    return B, H, (int(parts[2]) if len(parts) > 2 else None)


# ----------------------------------------------------------------------- peers


def load_peer():
    """``(api_fn, inplace_fn, note)``; functions are None when fla is missing."""
    try:
        from fla.ops.kda import fused_recurrent_kda
    except Exception as exc:  # ImportError, or fla failing at import on this machine
        return None, None, f"fla-core not importable ({type(exc).__name__}: {exc})"
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except Exception as exc:
        return fused_recurrent_kda, None, f"fla in-place path not importable ({type(exc).__name__}: {exc})"
    import fla

    return fused_recurrent_kda, fused_recurrent_kda_fwd, f"fla-core {getattr(fla, '__version__', '?')}"


def make_case(B, H, S, device, seed=0, state_dtype=torch.float32):
    gen = torch.Generator(device=device).manual_seed(seed)
    lead = (B,) if S is None else (B, S)
    rnd = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    bf = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = random_kda_inputs(rnd, lead, H, K, V, bf)
    steps = S or 1
    slots = B * steps
    perm = torch.randperm(slots, generator=gen, device=device).to(torch.int32)
    idx = perm[:B].contiguous() if S is None else perm.view(B, S).contiguous()
    cache = (0.5 * rnd(slots, H, V, K)).to(state_dtype)  # V-first
    return x, idx, cache


def hbm_bytes(B, H, S, state_bytes=4):
    steps = S or 1
    state = B * H * V * K * state_bytes * (1 + steps)  # read once, write after each token
    inputs = B * steps * H * (3 * K + V + 1) * 2  # q, k, raw_g, v, raw_beta in bf16
    outputs = B * steps * H * V * 2
    return state + inputs + outputs + B * steps * 4 + H * (K + 1) * 4


def _as_fla(x, S):
    """fla's shapes: [B, T, H, *] contiguous (T = 1 for one-token decode)."""
    t = (lambda a: a[:, None].contiguous()) if S is None else (lambda a: a.contiguous())
    return t(x["q"]), t(x["k"]), t(x["v"]), t(x["raw_g"]), t(x["raw_beta"])


def ours_fn(x, idx, cache, S, out, block_v=None, num_warps=None, check_inputs=False, native_round=None):
    if block_v is not None:
        init = idx if S is None else idx[:, 0]
        strides = (idx.stride(0), 0) if S is None else idx.stride()
        return lambda: launch_decode(
            *x.values(), cache, init, idx, out, None, LOWER_BOUND, steps=S or 1,
            init_stride=init.stride(0), idx_strides=strides, block_v=block_v, num_warps=num_warps,
            native_round=native_round,
        )
    if S is None:
        return lambda: kda_decode(**x, state_cache=cache, state_indices=idx, lower_bound=LOWER_BOUND,
                                  out=out, check_inputs=check_inputs)
    return lambda: kda_decode_multi(**x, state_cache=cache, state_indices=idx, lower_bound=LOWER_BOUND,
                                    out=out, check_inputs=check_inputs)


def fla_api_fn(api, x, idx, cache, S):
    q, k, v, g, beta = _as_fla(x, S)
    rows = (idx if S is None else idx[:, 0]).long()
    h0 = cache[rows].transpose(-1, -2).contiguous()  # [B, H, K, V], fla's default layout
    kw = dict(A_log=x["A_log"], dt_bias=x["dt_bias"], initial_state=h0, output_final_state=True,
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              lower_bound=LOWER_BOUND)
    return lambda: api(q, k, v, g, beta, **kw)


def fla_inplace_fn(fwd, x, idx, cache, S, out):
    q, k, v, g, beta = _as_fla(x, S)
    kw = dict(A_log=x["A_log"], dt_bias=x["dt_bias"], initial_state=cache, inplace_final_state=True,
              state_v_first=True, ssm_state_indices=idx, use_qk_l2norm_in_kernel=True,
              use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=LOWER_BOUND, out=out)
    return lambda: fwd(q, k, v, g, beta, **kw)


def compare_with_fla(fwd, x, idx, cache, S):
    """Max |ours - fla in-place| over outputs and written state rows, one step
    from the same start state."""
    ours_cache, fla_cache = cache.clone(), cache.clone()
    out = torch.empty(x["v"].shape, dtype=x["v"].dtype, device=cache.device)
    ours_fn(x, idx, ours_cache, S, out)()
    fla_out = torch.empty(_as_fla(x, S)[2].shape, dtype=x["v"].dtype, device=cache.device)
    fla_inplace_fn(fwd, x, idx, fla_cache, S, fla_out)()
    fla_o = fla_out[:, 0] if S is None else fla_out
    rows = idx.reshape(-1).long()
    d_out = (out.float() - fla_o.float()).abs().max().item()
    d_state = (ours_cache[rows] - fla_cache[rows]).abs().max().item()
    return d_out, d_state


# --------------------------------------------------------------------- timing


def run(cases=None, peers=True, quick=False, sweep=False, layer=True) -> list[dict]:
    """Time every case; rows ``{case, ours_ms, peer_ms, ratio, hbm_floor_ms,
    floor_fraction, ours_bf16_ms, floor_fraction_bf16, max_abs_diff, ...}``
    (``ratio`` = peer_ms / ours_ms, > 1 means ours is faster; ``floor_fraction`` =
    hbm_floor_ms / ours_ms), then the layer-decode rows (default cases only)."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench_kda_decode needs a GPU")
    device = torch.device("cuda")
    default_cases = cases is None  # the layer rows run with the default cases only
    cases = (QUICK_CASES if quick else CASES) if cases is None else [c if len(c) == 3 else (*c, None) for c in cases]
    api, fwd, note = load_peer() if peers else (None, None, "peer not requested")
    if peers and api is None:
        print(f"[bench_kda_decode] {note}: peer columns left empty")
    bw = copy_bandwidth(device)
    rows = []
    with torch.inference_mode():
        for B, H, S in cases:
            x, idx, cache = make_case(B, H, S, device)
            out = torch.empty(x["v"].shape, dtype=x["v"].dtype, device=device)
            row = dict(case=case_name(B, H, S), peer=None, peer_note=note, copy_gbps=bw / 1e9,
                       tiling=decode_tiling(B, H, V, device, S or 1))
            row["ours_ms"] = bench(ours_fn(x, idx, cache, S, out))
            timings = {}
            if api is not None:
                try:
                    timings["fla_api"] = bench(fla_api_fn(api, x, idx, cache, S))
                except Exception as exc:
                    row["peer_note"] += f"; fla_api failed: {type(exc).__name__}: {exc}"
            if fwd is not None:
                try:
                    row["max_abs_diff"], row["max_abs_diff_state"] = compare_with_fla(fwd, x, idx, cache, S)
                    fla_out = torch.empty(_as_fla(x, S)[2].shape, dtype=x["v"].dtype, device=device)
                    timings["fla_inplace"] = bench(fla_inplace_fn(fwd, x, idx, cache, S, fla_out))
                except Exception as exc:
                    row["peer_note"] += f"; fla_inplace failed: {type(exc).__name__}: {exc}"
            for name, ms in timings.items():
                row[f"{name}_ms"] = ms
            if timings:
                row["peer"] = min(timings, key=timings.get)
                row["peer_ms"] = timings[row["peer"]]
                row["ratio"] = row["peer_ms"] / row["ours_ms"]
            else:
                row["peer_ms"] = row["ratio"] = None
            row["hbm_floor_ms"] = hbm_bytes(B, H, S) / bw * 1e3
            row["floor_fraction"] = row["hbm_floor_ms"] / row["ours_ms"]
            # The default call (host rules, the index rules' launch, the deferred verdict).
            row.update(bound_fields(bench(ours_fn(x, idx, cache, S, out, check_inputs=True)), row["ours_ms"]))
            # bf16 state cache: ours, and fla's in-place path if it takes one.
            x16, idx16, cache16 = make_case(B, H, S, device, state_dtype=torch.bfloat16)
            row["ours_bf16_ms"] = bench(ours_fn(x16, idx16, cache16, S, out))
            row.update(bound_fields(bench(ours_fn(x16, idx16, cache16, S, out, check_inputs=True)),
                                    row["ours_bf16_ms"], "_bf16"))
            row["tiling_bf16"] = decode_tiling(B, H, V, device, S or 1, state_dtype=torch.bfloat16)
            if sweep:
                row["sweep_bf16_ms"] = {
                    f"bv{bv}_w{nw}_{'cvt' if nat else 'int'}": bench(ours_fn(x16, idx16, cache16, S, out, bv, nw,
                                                                            native_round=nat))
                    for bv, nw, nat in SWEEP_BF16
                }
            row["hbm_floor_bf16_ms"] = hbm_bytes(B, H, S, state_bytes=2) / bw * 1e3
            row["floor_fraction_bf16"] = row["hbm_floor_bf16_ms"] / row["ours_bf16_ms"]
            row["bf16_speedup"] = row["ours_ms"] / row["ours_bf16_ms"]
            if fwd is not None:
                try:
                    fla_out = torch.empty(_as_fla(x16, S)[2].shape, dtype=x16["v"].dtype, device=device)
                    probe = cache16.clone()
                    fla_inplace_fn(fwd, x16, idx16, probe, S, fla_out)()
                    torch.cuda.synchronize()
                    if probe.dtype != torch.bfloat16:
                        raise TypeError(f"the cache came back as {probe.dtype}")
                    row["fla_inplace_bf16_ms"] = bench(fla_inplace_fn(fwd, x16, idx16, cache16, S, fla_out))
                except Exception as exc:
                    row["peer_note"] += f"; fla bf16 state skipped: {type(exc).__name__}: {str(exc)[:120]}"
            del x16, idx16, cache16
            if sweep:
                row["sweep_ms"] = {
                    f"bv{bv}_w{nw}": bench(ours_fn(x, idx, cache, S, out, bv, nw)) for bv, nw in SWEEP
                }
            rows.append(row)
            del x, idx, cache, out
            torch.cuda.empty_cache()
        if layer and default_cases:
            rows += run_layer(device, bw, sweep=sweep)
    return rows


def bound_fields(checked_ms, nocheck_ms, tag: str = "") -> dict:
    """``checked{tag}_ms`` (the default call) and whether it is within no-check +
    max(0.02 ms, 3%) (:func:`kda_engram.tools.benchmarks.common.default_check_bound_ms`)."""
    return {f"checked{tag}_ms": checked_ms,
            f"within_check_bound{tag}": checked_ms - nocheck_ms <= default_check_bound_ms(nocheck_ms)}


# Kimi-Linear's KDA layer: hidden 2304, 32 heads of 128, low-rank gates (rank 128), conv 4.
LAYER_HIDDEN, LAYER_HEADS, LAYER_RANK = 2304, 32, 128
LAYER_BATCHES = (64, 256)


def layer_hbm_bytes(B, H, state_bytes=4):
    """The decode mixer's bytes: state read + write, projection bands read (bf16),
    conv windows read + write and weights, o_proj input written."""
    C = 3 * H * K
    state = 2 * B * H * V * K * state_bytes
    proj = B * (C + H * K + H + H * V) * 2
    conv = 2 * B * C * 3 * 2 + C * 4 * 2
    return state + proj + conv + B * H * V * 2


def run_layer(device, bw, batches=LAYER_BATCHES, sweep=False) -> list[dict]:
    """Layer-decode rows: fused step vs the multi-launch step (see the module doc),
    with an fp32 and a bf16 state cache; both steps call the kernels with
    ``check_inputs=False`` (like for like: an engine's graph-captured step).
    ``sweep`` also times the fused kernel at every (BLOCK_V, num_warps)."""
    from ...kda.conv import kda_conv_decode
    from ...kda.fused_decode import kda_layer_decode_step
    from ...launch_config import device_arch, fused_decode_tiling_for
    from ...layers.kda import KDABatch, KimiDeltaAttention

    rows = []
    layer = KimiDeltaAttention(LAYER_HIDDEN, LAYER_HEADS, K, gate_low_rank_dim=LAYER_RANK,
                               output_gate_low_rank_dim=LAYER_RANK, lower_bound=LOWER_BOUND,
                               dtype=torch.bfloat16, device=device)
    layer.reset_parameters(torch.Generator().manual_seed(0))
    H, C, b = layer.local_heads, layer.conv_channels, layer.bands
    tiling = fused_decode_tiling_for(device_arch(device), V)
    fused_tiling = (tiling.block_v, tiling.num_warps)
    for state_dtype in (torch.float32, torch.bfloat16):
        for B in batches:
            gen = torch.Generator(device=device).manual_seed(B)
            hs = torch.randn(B, LAYER_HIDDEN, device=device, generator=gen).to(torch.bfloat16)
            sc, cs = layer.allocate_cache(B, state_dtype=state_dtype)
            sc.copy_(torch.randn(sc.shape, device=device, generator=gen) * 0.3)
            cs.normal_(generator=gen)
            idx = torch.randperm(B, device=device, generator=gen)
            batch = KDABatch.from_query_lens(torch.ones(B, dtype=torch.int64, device=device), idx, num_decode=B)
            proj = layer.in_proj(hs)
            raw_g = layer.f_b_proj(proj[:, b["gate"][0]: b["gate"][1]])
            raw_beta = proj[:, b["beta"][0]: b["beta"][1]]
            g_out = layer.g_b_proj(proj[:, b["g_out"][0]: b["g_out"][1]])
            out = torch.empty(B, H * V, dtype=torch.bfloat16, device=device)

            def fused(block_v=None, num_warps=4, check_inputs=False):
                return kda_layer_decode_step(
                    proj[:, :C], raw_g, raw_beta, g_out, layer.conv_weight, cs, idx, layer.A_log, layer.dt_bias,
                    layer.o_norm_weight, sc, idx, scale=layer.scale, lower_bound=LOWER_BOUND,
                    norm_eps=layer.norm_eps, out=out, block_v=block_v, num_warps=num_warps,
                    check_inputs=check_inputs)

            def unfused():
                conv = kda_conv_decode(proj[:, :C], layer.conv_weight, cs, idx, out_dtype=torch.float32,
                                       check_inputs=False)
                o = kda_decode(conv[:, : H * K].view(B, H, K), conv[:, H * K: 2 * H * K].view(B, H, K),
                               conv[:, 2 * H * K:].view(B, H, V), raw_g.view(B, H, K), raw_beta, layer.A_log,
                               layer.dt_bias, sc, idx, scale=layer.scale, lower_bound=LOWER_BOUND,
                               check_inputs=False)
                return layer._output_gate(o.to(torch.bfloat16), g_out.view(B, H, V)).reshape(B, H * V)

            tag = "" if state_dtype == torch.float32 else "_bf16state"
            row = dict(case=f"layer_B{B}_H{H}{tag}", peer="multi-launch step", peer_note="ours = fused one-launch step",
                       copy_gbps=bw / 1e9, tiling=fused_tiling)
            with torch.inference_mode():
                sc0, cs0 = sc.clone(), cs.clone()
                y_fused = fused().float()
                sc.copy_(sc0)
                cs.copy_(cs0)
                row["max_abs_diff"] = (y_fused - unfused().float()).abs().max().item()  # one step from one start
                row["ours_ms"] = bench(fused)
                row.update(bound_fields(bench(lambda: fused(check_inputs=True)), row["ours_ms"]))
                row["peer_ms"] = bench(unfused)
                row["ratio"] = row["peer_ms"] / row["ours_ms"]
                row["hbm_floor_ms"] = layer_hbm_bytes(B, H, state_bytes=sc.element_size()) / bw * 1e3
                row["floor_fraction"] = row["hbm_floor_ms"] / row["ours_ms"]
                if sweep:
                    row["sweep_ms"] = {f"bv{bv}_w{nw}": bench(lambda bv=bv, nw=nw: fused(bv, nw)) for bv, nw in SWEEP}
                for name, flag in (("layer_fused_ms", True), ("layer_unfused_ms", False)):
                    layer.fused_decode = flag
                    row[name] = bench(lambda: layer(hs, batch, sc, cs, check_inputs=False))
                layer.fused_decode = True
                layer_checked = bench(lambda: layer(hs, batch, sc, cs))  # the default call
                row.update({"layer_fused_checked_ms": layer_checked, "within_check_bound_layer": bound_fields(
                    layer_checked, row["layer_fused_ms"])["within_check_bound"]})
            rows.append(row)
    return rows


def print_rows(rows):
    if rows:
        print(f"copy bandwidth (read + write): {rows[0]['copy_gbps']:.0f} GB/s; peer: {rows[0]['peer_note']}")
    fmt = lambda v, spec: "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)  # noqa: E731
    head = (f"{'case':<14} {'ours ms':>8} {'fla api':>8} {'fla inpl':>8} {'ratio':>6} {'floor ms':>8} "
            f"{'of floor':>8} {'tiling':>8} {'|d out|':>9} {'|d state|':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['case']:<14} {fmt(r['ours_ms'], '.4f'):>8} {fmt(r.get('fla_api_ms'), '.4f'):>8} "
            f"{fmt(r.get('fla_inplace_ms'), '.4f'):>8} {fmt(r.get('ratio'), '.2f'):>6} "
            f"{fmt(r['hbm_floor_ms'], '.4f'):>8} {fmt(r['floor_fraction'], '.0%'):>8} "
            f"{'%dx%d' % r['tiling']:>8} {fmt(r.get('max_abs_diff'), '.2e'):>9} {fmt(r.get('max_abs_diff_state'), '.2e'):>9}"
        )
        for key in ("sweep_ms", "sweep_bf16_ms"):
            if key in r:
                best = min(r[key], key=r[key].get)
                cells = "  ".join(f"{k}={v:.4f}" for k, v in r[key].items())
                print(f"    {key} (best {best}): {cells}")
    extra = [r for r in rows if "ours_bf16_ms" in r]
    if extra:
        print(f"\nbf16 state cache (own floor: half the state bytes){'':<4}")
        head = (f"{'case':<14} {'fp32 ms':>8} {'bf16 ms':>8} {'speedup':>7} {'floor ms':>8} {'of floor':>8} "
                f"{'fla bf16':>8} {'checked':>8}")
        print(head)
        print("-" * len(head))
        for r in extra:
            print(f"{r['case']:<14} {fmt(r['ours_ms'], '.4f'):>8} {fmt(r['ours_bf16_ms'], '.4f'):>8} "
                  f"{fmt(r['bf16_speedup'], '.2f'):>7} {fmt(r['hbm_floor_bf16_ms'], '.4f'):>8} "
                  f"{fmt(r['floor_fraction_bf16'], '.0%'):>8} {fmt(r.get('fla_inplace_bf16_ms'), '.4f'):>8} "
                  f"{fmt(r.get('checked_ms'), '.4f'):>8}")
    layer_rows = [r for r in rows if "layer_fused_ms" in r]
    for r in layer_rows:
        print(f"{r['case']}: layer forward fused {r['layer_fused_ms']:.4f} ms vs unfused {r['layer_unfused_ms']:.4f} "
              f"ms (decode mixer: fused {r['ours_ms']:.4f} vs multi-launch {r['peer_ms']:.4f} ms, "
              f"{r['ratio']:.2f}x, {r['floor_fraction']:.0%} of floor)")
    print_check_bound(rows)
    print("ratio = fastest fla variant / ours (> 1: ours faster); tiling = BLOCK_V x num_warps; "
          "checked = default check_inputs=True call")


def print_check_bound(rows) -> None:
    """The default call (checked) beside the no-check call for every row and state
    dtype, and whether it is within no-check + max(0.02 ms, 3%)."""
    pairs = [("", "ours_ms", "checked_ms", "within_check_bound"),
             ("bf16 state", "ours_bf16_ms", "checked_bf16_ms", "within_check_bound_bf16"),
             ("layer forward", "layer_fused_ms", "layer_fused_checked_ms", "within_check_bound_layer")]
    lines = []
    for r in rows:
        for tag, plain, checked, ok in pairs:
            if r.get(checked) is not None:
                added = r[checked] - r[plain]
                lines.append((f"{r['case']} {tag}".strip(), r[checked], r[plain], added,
                              default_check_bound_ms(r[plain]), r[ok]))
    if not lines:
        return
    print(f"\n{'default call vs no-check':<34} {'checked':>8} {'no-check':>8} {'added':>8} {'bound':>8} {'ok':>5}")
    for name, c, n, a, b, ok in lines:
        print(f"{name:<34} {c:>8.4f} {n:>8.4f} {a:>+8.4f} {b:>8.4f} {str(ok):>5}")
    misses = [x[0] for x in lines if not x[5]]
    print(f"within no-check + max(0.02 ms, 3%): {len(lines) - len(misses)}/{len(lines)}"
          + (f"; MISSES: {', '.join(misses)}" if misses else ""))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", help="comma-separated BxH or BxHxS, e.g. 64x32,256x32x4")
    p.add_argument("--no-peer", action="store_true", help="time ours only")
    p.add_argument("--quick", action="store_true", help="the three one-token cases only")
    p.add_argument("--sweep", action="store_true", help="also time every (BLOCK_V, num_warps) of ours")
    p.add_argument("--no-layer", action="store_true", help="skip the layer-decode rows")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = p.parse_args(argv)
    if (code := no_gpu_exit("bench_kda_decode")) is not None:
        return code
    cases = [parse_case(c) for c in args.cases.split(",")] if args.cases else None
    rows = run(cases, peers=not args.no_peer, quick=args.quick, sweep=args.sweep, layer=not args.no_layer)
    print_rows(rows)
    if args.json:
        write_json(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Every kernel compiled for an H100/H200 (sm_90) on the CPU, without a GPU.

The interpreter runs the kernels' Python, not Triton's compiler, so a kernel that
cannot compile (a constexpr reassigned in a static loop, a type mismatch between
branches, a shape the layouts reject) passes every CPU test and fails on the first
GPU call. This test closes that gap: a child process (no ``TRITON_INTERPRET``)
replaces every ``*_kernel`` of the package by a recorder, drives the real entry
points on CPU tensors with the demo's production configuration (bf16, K = V = 128,
Engram dim 5120 x hc 4; the GPU-only launch choices switched on), and then compiles
each recorded launch with Triton's own pipeline down to a cubin (ptxas ships with
the triton wheel), its arguments specialised by Triton's launch binder exactly as
on the GPU (alignment and unit-stride facts decide vectorisation, so registers and
spills are the real kernel's). It also reports each kernel's registers and spill
stack (``cuobjdump --dump-resource-usage``), and fails on one that spills more
than ``MAX_SPILL_STACK_BYTES`` per thread.

Only what the compiler checks is tested here; values are the other tests' job.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import triton

NVIDIA_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
MAX_SPILL_STACK_BYTES = 1024


def _compile_in_child(tmp_path, *mode):
    if not (NVIDIA_BIN / "ptxas").exists():
        pytest.fail("the triton wheel ships no ptxas: cannot compile for sm_90 here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, __file__, str(report), *mode], env=env, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads(report.read_text())


def _assert_state_kernels(rows):
    """The bf16/fp32 state variants and the fused layer decode step were compiled,
    without heavy spills (checked for every row by the callers)."""
    assert "_conv_decode_kernel" in {r["kernel"] for r in rows}
    got = {(r["kernel"], r["constexprs"].get("STATE_BF16"), r["constexprs"].get("S")) for r in rows}
    for s in (1, 4):
        for bf16 in (False, True):
            assert ("_kda_decode_kernel", bf16, s) in got, got
            assert ("_fused_kda_decode_kernel", bf16, s) in got, got
    walk = {(r["constexprs"].get("OUT_BF16"), r["constexprs"].get("CKPT_BF16"), r["constexprs"].get("GROUPED"))
            for r in rows if r["kernel"] == "_kda_chunk_walk_kernel"}
    assert {(True, True, False), (True, False, True)} <= walk, walk


def test_state_dtype_and_fused_decode_kernels_compile_for_sm90(tmp_path):
    """Only the kernels with a bf16/fp32 state variant and the fused decode step
    (fast: ``-k state_dtype``)."""
    rows = _compile_in_child(tmp_path, "state")
    _assert_state_kernels(rows)
    heavy = [(r["kernel"], r["constexprs"], r["registers"], r["spill_stack_bytes"]) for r in rows
             if r["spill_stack_bytes"] > 0]
    # The decode kernels hold a [BLOCK_V, K] fp32 tile: no spill at all is the bar.
    assert not [h for h in heavy if "decode" in h[0]], heavy
    assert not [h for h in heavy if h[3] > MAX_SPILL_STACK_BYTES], heavy


def test_every_kernel_compiles_for_sm90(tmp_path):
    rows = _compile_in_child(tmp_path)
    compiled = {r["kernel"] for r in rows}
    # Every kernel family the package launches was reached and compiled.
    for name in ("_kda_prologue_intra_kernel", "_kda_prologue_solve_kernel", "_kda_chunk_walk_kernel",
                 "_kda_group_pass_one_kernel", "_kda_group_scan_kernel", "_kda_decode_kernel", "_conv_decode_kernel", "_conv_prefill_kernel",
                 "_conv_checkpoint_kernel", "_engram_post_wkv_kernel", "_engram_gate_partials_kernel",
                 "_engram_gate_finish_kernel", "_engram_gather_kernel", "_ngram_hash_kernel", "_next_history_kernel",
                 "_history_copy_kernel", "_history_checkpoint_kernel", "_fused_kda_decode_kernel"):
        assert name in compiled, f"{name} was never launched by the driver"
    _assert_state_kernels(rows)
    geoms = {(r["constexprs"].get("LOOP"), r["constexprs"].get("HEAD")) for r in rows
             if r["kernel"] == "_engram_post_wkv_kernel"}
    assert {(True, 16), (False, 4096), (False, 2048), (False, 1024)} <= geoms, geoms
    persistent = {r["constexprs"].get("HEAD") for r in rows
                  if r["kernel"] == "_engram_post_wkv_kernel" and r["constexprs"].get("PERSISTENT")}
    assert persistent == {4096, 2048}, persistent
    assert {r["constexprs"].get("NATIVE_FP8") for r in rows if r["kernel"] == "_engram_gather_kernel"} >= {True, False}
    assert all(r["registers"] > 0 for r in rows)
    # Spills: the largest stack of the tuned kernels is 160 B per thread (the
    # prologue's intra launch, 255 registers). A kernel far past it has lost its
    # register budget (the conv-state prologue once compiled to 32 registers and
    # 11.9 KB of stack, and ran 2x slower).
    heavy = [(r["kernel"], r["options"], r["registers"], r["spill_stack_bytes"]) for r in rows
             if r["spill_stack_bytes"] > MAX_SPILL_STACK_BYTES]
    assert not heavy, f"kernels spilling more than {MAX_SPILL_STACK_BYTES} B per thread: {heavy}"


# --------------------------------------------------------------------------- child


class _Recorder:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` records the call."""

    def __init__(self, name, fn, calls):
        self.name, self.fn, self.calls = name, fn, calls

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((self.name, self.fn, args, kwargs))

        return launch


def _specialize(fn, args, kwargs, backend):
    """``(signature, constexprs, attrs, options)`` of the compile that
    ``fn[grid](*args, **kwargs)`` would start on the GPU. Triton's own launch
    binder specialises the arguments as at a real launch: integers equal to 1
    become constexprs, pointers and integers divisible by 16 carry that fact
    (which is what lets the compiler vectorise loads and stores). Without it the
    compile is of a kernel no launch runs: all loads scalar, register and spill
    counts far from the real ones. (``create_function_from_signature`` and
    ``_pack_args`` are Triton's internals; triton is pinned to 3.6.0.)"""
    from triton.runtime.jit import create_function_from_signature

    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return signature, constexprs, attrs, options


def _resources(cubin: bytes) -> tuple[int, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        text = subprocess.run([str(NVIDIA_BIN / "cuobjdump"), "--dump-resource-usage", fh.name],
                              capture_output=True, text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", text)
    stack = re.search(r"STACK:(\d+)", text)
    return int(regs.group(1)) if regs else 0, int(stack.group(1)) if stack else 0


def _install_recorders(calls):
    modules = [m for n, m in sys.modules.items() if n.startswith("kda_engram") and m is not None]
    for module in modules:
        for name, obj in list(vars(module).items()):
            if isinstance(obj, triton.runtime.jit.JITFunction) and name.endswith("_kernel"):
                setattr(module, name, _Recorder(name, obj, calls))
            # The launch choices the package makes on an H200 rather than on the CPU.
            if name == "is_gpu":
                setattr(module, name, lambda device=None: True)
            if name == "num_compute_units":
                setattr(module, name, lambda device=None: 132)


def _drive_state(calls, install=True):
    """The bf16/fp32 state-cache variants (decode, multi-token decode, prefill walk
    with bf16 cache and checkpoints, grouped walk with a bf16 cache) and the fused
    layer decode step, at the production shapes (bf16 inputs, K = V = 128)."""
    import torch

    import kda_engram.kda.chunk  # noqa: F401
    import kda_engram.kda.decode  # noqa: F401
    import kda_engram.kda.fused_decode  # noqa: F401
    import kda_engram.kda.prologue  # noqa: F401

    if install:
        _install_recorders(calls)
    from kda_engram.kda.conv import kda_conv_decode
    from kda_engram.kda.decode import kda_decode, kda_decode_multi
    from kda_engram.kda.fused_decode import fused_kda_decode_step
    from kda_engram.kda.prefill import chunk_kda_prefill

    dt, B, H, D = torch.bfloat16, 4, 32, 128
    with torch.no_grad():
        for sd in (torch.float32, dt):
            for S in (None, 4):
                lead = (B,) if S is None else (B, S)
                x = {n: torch.zeros(*lead, H, D, dtype=dt) for n in ("q", "k", "v", "raw_g")}
                idx = torch.arange(B * (S or 1), dtype=torch.int32).view(*lead)
                cache = torch.zeros(B * (S or 1), H, D, D, dtype=sd)
                fn = kda_decode if S is None else kda_decode_multi
                fn(**x, raw_beta=torch.zeros(*lead, H, dtype=dt), A_log=torch.zeros(H), dt_bias=torch.zeros(H * D),
                   state_cache=cache, state_indices=idx, lower_bound=-5.0, check_inputs=False)
                # The fused step reads strided bands of one projection row (Kimi-Linear layout).
                C = 3 * H * D
                proj = torch.zeros(*lead, C + H * D + H + H * D, dtype=dt)
                fused_kda_decode_step(
                    proj[..., :C], proj[..., C: C + H * D], proj[..., C + H * D: C + H * D + H],
                    proj[..., C + H * D + H:], torch.zeros(C, 4, dtype=dt),
                    torch.zeros(B * (S or 1), C, 3, dtype=dt), idx, torch.zeros(H), torch.zeros(H * D),
                    torch.ones(D, dtype=dt), cache, idx, lower_bound=-5.0, check_inputs=False)
                if S is None:  # the layer's unfused decode step (fused_decode=False) still runs the conv launch
                    kda_conv_decode(proj[:, :C], torch.zeros(C, 4, dtype=dt), torch.zeros(B, C, 3, dtype=dt), idx,
                                    out_dtype=torch.float32, check_inputs=False)
        Hp, T = 4, 4096
        x = {n: torch.zeros(1, T, Hp, D, dtype=dt) for n in ("q", "k", "v", "raw_g")}
        common = dict(raw_beta=torch.zeros(1, T, Hp, dtype=dt), A_log=torch.zeros(Hp), dt_bias=torch.zeros(Hp * D),
                      lower_bound=-5.0, cu_seqlens=torch.tensor([0, T // 2, T], dtype=torch.int32),
                      check_inputs=False)
        cache = torch.zeros(6, Hp, D, D, dtype=dt)
        state = dict(state_cache=cache, state_indices=torch.tensor([0, 1]),
                     has_initial_state=torch.ones(2, dtype=torch.bool))
        # Serial walk: bf16 cache row and bf16 checkpoints into the cache.
        chunk_kda_prefill(**x, **common, **state, checkpoint_state=cache,
                          checkpoint_offsets=torch.tensor([1024, 2048]), checkpoint_state_indices=torch.tensor([2, 3]),
                          groups=1)
        # Grouped walk (pass one, scan, pass two) on a bf16 cache.
        chunk_kda_prefill(**x, **common, **state, groups=4)


def _drive(calls):
    """Run the package's entry points on CPU tensors with the recorders in place."""
    import torch

    import kda_engram.demo as demo
    import kda_engram.engram.hashing  # noqa: F401  (every kernel module, before the recorders go in)
    import kda_engram.kda.chunk  # noqa: F401
    import kda_engram.kda.conv  # noqa: F401
    import kda_engram.kda.decode  # noqa: F401
    import kda_engram.kda.fused_decode  # noqa: F401
    import kda_engram.kda.prologue  # noqa: F401
    import kda_engram.layers  # noqa: F401
    import kda_engram.ops  # noqa: F401
    from kda_engram.engram import engram_gate_finish, engram_gate_partials, engram_post_wkv
    from kda_engram.engram.reference import shard_kv_by_dim
    from kda_engram.engram.table import EngramTable
    from kda_engram.kda.prefill import chunk_kda_prefill

    _install_recorders(calls)
    dev, dt = torch.device("cpu"), torch.bfloat16
    with torch.no_grad():
        # The demo's production configuration end to end: the Engram layer (hashing,
        # table, gate, history) and the KDA layer (prologue with the conv, chunk walk
        # with state cache and checkpoints, decode, conv decode and checkpoint).
        cfg = demo.REAL
        run = demo._Run(cfg, dev, dt, 0)
        demo._GateCheck(cfg, dev, dt, 0).kernels()
        run.prefill()
        run.resume()
        run.decode()
        # Gate geometries the demo's batch may not reach: the wide single pass
        # (dims 5120 and 2560), two passes (dim 6144), the register row (dim 1024).
        for T, dim in ((64, 5120), (4096, 2560), (64, 6144), (64, 1024)):
            hidden = torch.zeros(T, 4, dim, dtype=dt)
            kv = torch.zeros(T, 5 * dim, dtype=dt)
            w = torch.ones(4, dim, dtype=dt)
            engram_post_wkv(hidden, kv, w, w, eps=1e-6, token_mask=torch.ones(T, dtype=torch.bool))
        # The persistent single pass (its grid is sized from a compiled kernel on a
        # GPU; here forced to 4 programs per SM of 132).
        for dim in (5120, 2560):
            hidden, kv, w = torch.zeros(4096, 4, dim, dtype=dt), torch.zeros(4096, 5 * dim, dtype=dt), torch.ones(4, dim, dtype=dt)
            engram_post_wkv(hidden, kv, w, w, eps=1e-6, programs=528)
        hidden, kv = torch.zeros(64, 4, 5120, dtype=dt), torch.zeros(64, 5 * 5120, dtype=dt)
        w = torch.ones(4, 5120, dtype=dt)
        local = shard_kv_by_dim(kv, 4, 4)[0].contiguous()
        send = engram_gate_partials(hidden, local, w, w, rank=0, tp_size=4)
        engram_gate_finish(hidden, torch.cat([send] * 4), tp_size=4, eps=1e-6)
        # Both fp8 decodes of the table gather, and a parallel-group prefill.
        for decode in ("native", "integer"):
            table = EngramTable([1009, 1013], 256, storage="fp8", device=dev)
            table.fp8_decode = decode
            table.lookup(torch.tensor([[0, 1009]] * 8, dtype=torch.int32))  # a row of each column's table
        H, K, T = 4, 128, 4096
        x = {n: torch.zeros(1, T, H, K, dtype=dt) for n in ("q", "k", "v", "raw_g")}
        chunk_kda_prefill(x["q"], x["k"], x["v"], x["raw_g"], torch.zeros(1, T, H, dtype=dt), torch.zeros(H),
                          torch.zeros(H * K), lower_bound=-5.0, cu_seqlens=torch.tensor([0, T], dtype=torch.int32),
                          initial_state=torch.zeros(1, H, K, K), output_final_state=True, groups=4,
                          check_inputs=False)
    _drive_state(calls, install=False)


def main(report_path: str, mode: str = "all") -> int:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    calls = []
    (_drive_state if mode == "state" else _drive)(calls)
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    seen, rows, failures = set(), [], []
    for name, fn, args, kwargs in calls:
        signature, constexprs, attrs, options = _specialize(fn, args, dict(kwargs), backend)
        const = {fn.arg_names[path[0]]: value for path, value in constexprs.items() if len(path) == 1}
        key = (name, repr(signature), repr(sorted((k, repr(v)) for k, v in constexprs.items())),
               repr(sorted(attrs.items())), repr(options))
        if key in seen:
            continue
        seen.add(key)
        try:
            kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                                    target=target, options=options.__dict__)
        except Exception as exc:  # noqa: BLE001 - every failure is reported, then the run fails
            cause = exc.__cause__ or exc.__context__
            failures.append(f"{name} {const}: {type(exc).__name__}: {str(exc)[-2000:]}"
                            + (f" (caused by {type(cause).__name__}: {str(cause)[-1500:]})" if cause else ""))
            continue
        regs, stack = _resources(kernel.asm["cubin"])
        const_json = {k: (v if isinstance(v, (int, float, bool, str)) or v is None else str(v)) for k, v in const.items()}
        launch = dict(num_warps=options.num_warps, num_stages=options.num_stages, maxnreg=options.maxnreg)
        rows.append(dict(kernel=name, constexprs=const_json, options=launch, registers=regs, spill_stack_bytes=stack))
        print(f"{name:<34} warps {options.num_warps:>2}  regs {regs:>3}  stack {stack:>5} B  "
              + " ".join(f"{k}={v}" for k, v in const_json.items() if k.isupper()), flush=True)
    with open(report_path, "w") as fh:
        json.dump(rows, fh, indent=1)
    for failure in failures:
        print("FAILED", failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))

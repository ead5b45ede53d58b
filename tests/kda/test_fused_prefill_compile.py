"""The fused chunk-16 KDA prefill compiled for sm_90a on the CPU: registers and spills.

The interpreter runs the kernel's Python, not Triton's compiler, so this test
compiles the real launches (bf16, K = V = 128, H = 32, the launch binder's
specialisation of every argument as on a GPU) down to a cubin with the ptxas
shipped in the triton wheel, prints each configuration's registers and spill
stack (``cuobjdump --dump-resource-usage``) and fails on a compile error or on
more than ``MAX_SPILL_STACK_BYTES`` of stack per thread.

``python tests/kda/test_fused_prefill_compile.py --sweep`` prints the whole
table (BV 32/64/128 x 4/8 warps x 1/2/3 stages) that picked the benchmark
grid ``kda_engram.kda.fused_prefill.BENCH_CONFIGS`` (which ``benchmarks/sweep_kda_fused.py``
times and this test compiles).
"""

from __future__ import annotations

import itertools
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
# The whole table of --sweep.
SWEEP_CONFIGS = tuple({"BV": bv, "num_warps": nw, "num_stages": ns}
                      for bv, nw, ns in itertools.product((32, 64, 128), (4, 8), (1, 2, 3)))


def test_fused_prefill_compiles_for_sm90(tmp_path):
    if not (NVIDIA_BIN / "ptxas").exists():
        pytest.fail("the triton wheel ships no ptxas: cannot compile for sm_90 here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, __file__, str(report)], env=env, capture_output=True, text=True,
                          timeout=1800)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    rows = json.loads(report.read_text())
    # Every benchmark config, plus the state-cache + checkpoint build of the default.
    from kda_engram.kda.fused_prefill import BENCH_CONFIGS

    assert len(rows) == len(BENCH_CONFIGS) + 1, rows
    assert all(r["registers"] > 0 for r in rows)
    heavy = [r for r in rows if r["spill_stack_bytes"] > MAX_SPILL_STACK_BYTES]
    assert not heavy, f"configs spilling more than {MAX_SPILL_STACK_BYTES} B per thread: {heavy}"


# --------------------------------------------------------------------------- child


def _specialize(fn, args, kwargs, backend):
    """Triton's own launch binder (as ``tests/test_compile_sm90.py`` does): the
    arguments are specialised exactly as at a GPU launch (divisibility by 16,
    integers equal to 1), so registers and spills are the real kernel's."""
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


def _record(configs):
    """Drive the entry point on CPU tensors with the kernel replaced by a recorder."""
    import torch

    import kda_engram.kda.fused_prefill as fp

    if configs is None:
        configs = fp.BENCH_CONFIGS
        with_cache = True
    else:
        with_cache = False
    calls = []
    kernel = fp._kda_fused_c16_kernel

    class Recorder:
        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((a, kw))

    fp._kda_fused_c16_kernel = Recorder()
    try:
        H, K, T, N = 32, 128, 256, 2
        dt = torch.bfloat16
        x = {n: torch.zeros(1, T, H, K, dtype=dt) for n in ("q", "k", "v")}
        proj = torch.zeros(1, T, H * K + H + 8, dtype=dt)  # raw_g and raw_beta as slices of one projection
        raw_g, raw_beta = proj[..., : H * K].view(1, T, H, K), proj[..., H * K: H * K + H]
        cu = torch.tensor([0, 100, T], dtype=torch.int32)
        common = dict(lower_bound=-5.0, cu_seqlens=cu)
        for cfg in configs:
            fp.fused_kda_prefill_c16(x["q"], x["k"], x["v"], raw_g, raw_beta, torch.zeros(H), torch.zeros(H * K),
                                     **common, initial_state=torch.zeros(N, H, K, K), output_final_state=True,
                                     config=dict(cfg))
        if with_cache:
            cache = torch.zeros(8, H, K, K)
            fp.fused_kda_prefill_c16(x["q"], x["k"], x["v"], raw_g, raw_beta, torch.zeros(H), torch.zeros(H * K),
                                     **common, state_cache=cache, state_indices=torch.tensor([3, -1]),
                                     has_initial_state=torch.tensor([True, False]), checkpoint_state=cache,
                                     checkpoint_offsets=torch.tensor([64, 128]),
                                     checkpoint_state_indices=torch.tensor([5, 6]))
    finally:
        fp._kda_fused_c16_kernel = kernel
    return kernel, calls


def main(report_path: str | None, configs) -> int:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    fn, calls = _record(configs)
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    rows, failures = [], []
    for args, kwargs in calls:
        signature, constexprs, attrs, options = _specialize(fn, args, dict(kwargs), backend)
        const = {fn.arg_names[path[0]]: value for path, value in constexprs.items() if len(path) == 1}
        tag = dict(BV=const["BV"], num_warps=options.num_warps, num_stages=options.num_stages,
                   maxnreg=options.maxnreg, INV_PREC=const["INV_PREC"], PIPELINE=const["PIPELINE"],
                   LOAD_STATE=const["LOAD_STATE"], HAS_CKPT=const["HAS_CKPT"])
        try:
            kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                                    target=target, options=options.__dict__)
        except Exception as exc:  # noqa: BLE001 - every failure is reported, then the run fails
            failures.append(f"{tag}: {type(exc).__name__}: {str(exc)[:2000]}")
            continue
        regs, stack = _resources(kernel.asm["cubin"])
        smem = kernel.metadata.shared
        rows.append(dict(**tag, registers=regs, spill_stack_bytes=stack, shared_bytes=smem))
        print(f"BV {tag['BV']:>3}  warps {tag['num_warps']}  stages {tag['num_stages']}  maxnreg {tag['maxnreg']}  "
              f"inv {tag['INV_PREC']:<6}  pipe {int(tag['PIPELINE'])}  "
              f"LOAD_STATE {tag['LOAD_STATE']} CKPT {int(tag['HAS_CKPT'])}:  regs {regs:>3}  "
              f"stack {stack:>5} B  smem {smem:>6} B", flush=True)
    if report_path:
        with open(report_path, "w") as fh:
            json.dump(rows, fh, indent=1)
    for failure in failures:
        print("FAILED", failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    if "--sweep" in sys.argv:
        sys.exit(main(None, SWEEP_CONFIGS))
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None, None))

"""Compile a Gluon kernel for sm_90a on a CPU-only machine and read its resources.

Technique (same idea as the portable kernels' compile test, rewritten here):
  1. Triton's launch binder specialises the real call arguments (CPU tensors and
     gluon TensorDescriptors stand in for device ones), giving signature,
     constexprs, attrs and options exactly as a launch on the GPU would.
  2. triton.compile(GluonASTSource(...), target=GPUTarget("cuda", 90, 32)) runs the
     whole pipeline (ttgir -> llir -> ptx -> cubin); ptxas comes with the wheel.
     The third field of GPUTarget is the WARP SIZE (32), not the thread count.
  3. Resources: the wheel's ptxas is re-run with -v on the PTX (registers, spill
     stores/loads, stack frame, static smem) and cuobjdump --dump-resource-usage on
     the cubin; triton's own dynamic shared memory is compiled.metadata.shared.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

NVIDIA_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
SM90 = GPUTarget("cuda", 90, 32)


def specialize(fn, args, kwargs, backend):
    from triton.runtime.jit import create_function_from_signature

    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return signature, constexprs, attrs, options


def compile_sm90(fn, args, kwargs, target=SM90):
    """Compile ``fn[grid](*args, **kwargs)`` for ``target``; returns the CompiledKernel."""
    from triton.compiler.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource

    backend = make_backend(target)
    signature, constexprs, attrs, options = specialize(fn, args, dict(kwargs), backend)
    src = GluonASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=target, options=options.__dict__)


def ptxas_report(ptx: str, arch: str = "sm_90a") -> dict:
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.ptx")
        with open(p, "w") as fh:
            fh.write(ptx)
        out = subprocess.run([str(NVIDIA_BIN / "ptxas"), "-v", f"--gpu-name={arch}", p, "-o", p + ".o"],
                             capture_output=True, text=True)
        log = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", log)
    stack = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    smem = re.search(r"(\d+) bytes smem", log)
    return dict(registers=int(regs.group(1)) if regs else None,
                stack_frame=int(stack.group(1)) if stack else None,
                spill_stores=int(stack.group(2)) if stack else None,
                spill_loads=int(stack.group(3)) if stack else None,
                static_smem=int(smem.group(1)) if smem else 0, log=log)


def cuobjdump_usage(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        return subprocess.run([str(NVIDIA_BIN / "cuobjdump"), "--dump-resource-usage", fh.name],
                              capture_output=True, text=True).stdout


def resources(kernel) -> dict:
    r = ptxas_report(kernel.asm["ptx"])
    r.pop("log")
    r["dyn_smem_triton"] = kernel.metadata.shared
    r["num_warps"] = kernel.metadata.num_warps
    usage = cuobjdump_usage(kernel.asm["cubin"])
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", usage)
    if m:
        r["cuobjdump"] = dict(REG=int(m.group(1)), STACK=int(m.group(2)), SHARED=int(m.group(3)))
    ptx = kernel.asm["ptx"]
    r["wgmma_instrs"] = len(re.findall(r"wgmma\.mma_async", ptx))
    r["wgmma_shapes"] = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)))
    r["tma_loads"] = len(re.findall(r"cp\.async\.bulk\.tensor", ptx))
    r["ldmatrix_or_stmatrix"] = len(re.findall(r"ldmatrix|stmatrix", ptx))
    r["ld_st_shared"] = len(re.findall(r"\b(?:ld|st)\.shared", ptx))
    return r

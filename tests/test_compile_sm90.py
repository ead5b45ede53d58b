"""Every kernel compiled for an H100/H200 (sm_90) on the CPU, without a GPU.

The interpreter runs the kernels' Python, not Triton's compiler, so a kernel that
cannot compile (a constexpr reassigned in a static loop, a type mismatch between
branches, a shape the layouts reject) passes every CPU test and fails on the first
GPU call. This test closes that gap: a child process (no ``TRITON_INTERPRET``)
replaces every ``*_kernel`` of the package by a recorder, drives the real entry
points on CPU tensors with the demo's production configuration (bf16, K = V = 128,
Engram dim 5120 x hc 4) and an H200's device facts (sm_90, 132 SMs: the GPU-only
launch choices switched on; ``tests/compile_support.py``), and then compiles
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
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the child and pytest import compile_support alike

import compile_support  # noqa: E402

NVIDIA_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
MAX_SPILL_STACK_BYTES = 1024
#: Shared memory one CTA may use on an H100/H200 (227 KB). Triton compiles a
#: kernel past it without a word (a 3-stage walk needed 237,592 B); the launch fails.
MAX_SHARED_BYTES = 232_448


def test_every_kernel_compiles_for_sm90(tmp_path):
    if not (NVIDIA_BIN / "ptxas").exists():
        pytest.fail("the triton wheel ships no ptxas: cannot compile for sm_90 here")
    report = tmp_path / "report.json"
    proc = compile_support.run_child(__file__, [report], tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    report = json.loads(report.read_text())
    rows = report["rows"]
    compiled = {r["kernel"] for r in rows}
    never = sorted(set(report["defined"]) - compiled)
    assert not never, f"kernels the driver never launched (add a call to compile_support.drive): {never}"
    # Every kernel family the package launches was reached and compiled.
    for name in ("_chunk_metadata_kernel", "_kda_prologue_intra_kernel", "_kda_prologue_solve_kernel", "_kda_chunk_walk_kernel",
                 "_kda_group_pass_one_kernel", "_kda_group_scan_kernel", "_kda_decode_kernel", "_index_rules_kernel", "_cu_seqlens_rules_kernel", "_state_rules_kernel", "_decode_multi_rules_kernel", "_kda_batch_rules_kernel",
                 "_conv_decode_kernel", "_conv_prefill_kernel",
                 "_conv_checkpoint_kernel", "_engram_post_wkv_kernel", "_engram_gate_partials_kernel",
                 "_engram_gate_finish_kernel", "_engram_gather_kernel", "_ngram_hash_kernel", "_next_history_kernel",
                 "_history_copy_kernel", "_history_checkpoint_kernel", "_vllm_engram_hash_kernel"):
        assert name in compiled, f"{name} was never launched by the driver"
    geoms = {(r["constexprs"].get("LOOP"), r["constexprs"].get("HEAD")) for r in rows
             if r["kernel"] == "_engram_post_wkv_kernel"}
    assert {(True, 16), (False, 4096), (False, 2048), (False, 1024)} <= geoms, geoms
    persistent = {r["constexprs"].get("HEAD") for r in rows
                  if r["kernel"] == "_engram_post_wkv_kernel" and r["constexprs"].get("PERSISTENT")}
    assert persistent == {4096, 2048}, persistent
    assert {r["constexprs"].get("NATIVE_FP8") for r in rows if r["kernel"] == "_engram_gather_kernel"} >= {True, False}
    assert all(r["registers"] > 0 for r in rows)
    # Spills: the largest stack of the tuned kernels is 160 B per thread (the
    # prologue's intra launch, 255 registers); its unbounded-gate variants, whose
    # sub-chunks check their span and may take the exact diagonal sums (an eighth
    # of the channels at a time), 824 B. A kernel far past the bound has lost its
    # register budget (the conv-state prologue once compiled to 32 registers and
    # 11.9 KB of stack, and ran 2x slower).
    heavy = [(r["kernel"], r["options"], r["registers"], r["spill_stack_bytes"]) for r in rows
             if r["spill_stack_bytes"] > MAX_SPILL_STACK_BYTES]
    assert not heavy, f"kernels spilling more than {MAX_SPILL_STACK_BYTES} B per thread: {heavy}"
    big = [(r["kernel"], compile_support.shape_label(r), r["shared_bytes"]) for r in rows
           if r["shared_bytes"] > MAX_SHARED_BYTES]
    assert not big, f"kernels needing more than {MAX_SHARED_BYTES} B of shared memory per CTA: {big}"
    # The Hopper path: every variant reached, none spilling (the fused kernel's exact
    # diagonal blocks and its two-producer form within their own bounds, below).
    hopper = [r for r in rows if r["kernel"] in compile_support.HOPPER_KERNELS]
    walk = {(r["constexprs"]["LOAD_STATE"], r["constexprs"]["STORE_STATE"], r["constexprs"]["HAS_CKPT"])
            for r in hopper if r["kernel"] == "_folded_walk_kernel"}
    assert {(0, 0, False), (1, 1, False), (2, 2, True)} <= walk, walk
    spilling = [(r["kernel"], compile_support.shape_label(r), r["spill_stack_bytes"]) for r in hopper
                if r["spill_stack_bytes"] > _hopper_spill_bound(r["constexprs"])]
    assert not spilling, f"the Hopper path spills: {spilling}"


#: The Gluon prologue's budget (sm_90a): no spill, and room for two CTAs per SM in
#: shared memory (2 x 113 KB of the 228 KB an SM has).
GLUON_PROLOGUE_MAX_SHARED_BYTES = 113 * 1024


def test_gluon_prologue_compiles_for_sm90(tmp_path):
    """The Gluon folded prologue alone (quick: ``-k gluon_prologue``): every input form
    compiles for sm_90a with no spill and fits shared memory; the registers and shared
    memory are printed (``-s``)."""
    if not (NVIDIA_BIN / "ptxas").exists():
        pytest.fail("the triton wheel ships no ptxas: cannot compile for sm_90 here")
    report = tmp_path / "report.json"
    proc = compile_support.run_child(__file__, [report, "--gluon-prologue"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    print(proc.stdout)
    rows = json.loads(report.read_text())["rows"]
    assert {r["kernel"] for r in rows} == {"_gluon_prologue_kernel"}
    forms = {(r["constexprs"]["QK_L2NORM"], r["constexprs"]["BETA_SIGMOID"]) for r in rows}
    assert {(True, True), (False, False)} <= forms, forms
    for r in rows:
        assert r["spill_stack_bytes"] == 0, r
        assert 0 < r["registers"] <= 255, r
        assert r["shared_bytes"] <= GLUON_PROLOGUE_MAX_SHARED_BYTES, r


#: The fused prefill with the exact diagonal blocks (unbounded gates): its producer holds
#: the exact blocks' addresses beside the chunk's tiles and spills 24-88 B per thread at
#: 168 registers (docs/design/kda_fused_prefill.md); the bounded gate's kernel spills
#: nothing. A bound, so that a lost register budget still fails.
FUSED_EXACT_DIAG_MAX_SPILL_BYTES = 128
#: Two producer warpgroups (``producer_warps=8``) at 88 registers each: the producer
#: spills shared-memory addresses (80-88 B per thread); an option under measurement,
#: bounded so that a lost budget still fails.
FUSED_TWO_PRODUCERS_MAX_SPILL_BYTES = 96


def _hopper_spill_bound(constexprs) -> int:
    """The spill (B per thread) a Hopper-path kernel may have: 0, except the fused
    kernel's two-producer form and its exact-diagonal kernels (their bounds above)."""
    if constexprs.get("PW") == 8:
        return FUSED_TWO_PRODUCERS_MAX_SPILL_BYTES
    return FUSED_EXACT_DIAG_MAX_SPILL_BYTES if constexprs.get("EXACT_DIAG") else 0


def test_fused_prefill_compiles_for_sm90(tmp_path):
    """The fused Hopper prefill alone (quick: ``-k fused_prefill``): every state and
    input form compiles for sm_90a with no spill (the exact-diagonal kernels of the
    unbounded gates and the two-producer kernel within their bounds) and within the
    shared memory a CTA may take; the producer and consumer register counts
    (``setmaxnreg``) are the launch's split of the register file, the consumers (the
    walk) keeping the 168 its state tiles need (at 160 the checkpointing walk spills)."""
    if not (NVIDIA_BIN / "ptxas").exists():
        pytest.fail("the triton wheel ships no ptxas: cannot compile for sm_90 here")
    report = tmp_path / "report.json"
    proc = compile_support.run_child(__file__, [report, "--fused"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    print(proc.stdout)
    rows = json.loads(report.read_text())["rows"]
    assert {r["kernel"] for r in rows} == {"_fused_prefill_kernel"}
    forms = {(r["constexprs"]["LOAD_STATE"], r["constexprs"]["HAS_CKPT"], r["constexprs"]["QK_L2NORM"]) for r in rows}
    assert {(0, False, True), (1, False, False), (2, True, True)} <= forms, forms
    gates = {(r["constexprs"]["GATE"], r["constexprs"]["EXACT_DIAG"]) for r in rows}
    assert {(1, False), (0, True), (2, True), (1, True)} <= gates, gates
    assert {r["constexprs"]["PW"] for r in rows} == {4, 8}
    for r in rows:
        c = r["constexprs"]
        assert r["spill_stack_bytes"] <= _hopper_spill_bound(c), r
        assert r["shared_bytes"] <= MAX_SHARED_BYTES, r
        producer, consumers = r["setmaxnreg"]["producer"], r["setmaxnreg"]["consumers"]
        assert producer == c["PRODUCER_REGS"], r
        assert 32 * c["PW"] * producer + 256 * consumers <= 65536, r
        assert consumers >= 168, r


# --------------------------------------------------------------------------- child


def _resources(kernel, options) -> dict:
    """Registers and spill stack per thread (``cuobjdump --dump-resource-usage``)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(kernel.asm["cubin"])
        fh.flush()
        text = subprocess.run([str(NVIDIA_BIN / "cuobjdump"), "--dump-resource-usage", fh.name],
                              capture_output=True, text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", text)
    stack = re.search(r"STACK:(\d+)", text)
    row = dict(registers=int(regs.group(1)) if regs else 0, spill_stack_bytes=int(stack.group(1)) if stack else 0,
               shared_bytes=int(kernel.metadata.shared))
    if kernel.name == "_fused_prefill_kernel":
        # The partitions' registers inside the warp-specialised region: the producer's
        # increase and the default (consumer) partition's decrease from the launch's cap.
        ptx = kernel.asm["ptx"]
        inc = [int(v) for v in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+);", ptx)]
        dec = [int(v) for v in re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+);", ptx)]
        row["setmaxnreg"] = dict(producer=min(inc), consumers=max(dec))
    return row


def main(report_path: str, only: str | None = None) -> int:
    from triton.backends.compiler import GPUTarget

    calls = []
    if only == "--gluon-prologue":
        defined = compile_support.patch_device(calls, "sm_90", 132)
        compile_support.drive_gluon_prologue_variants()
    elif only == "--fused":
        defined = compile_support.patch_device(calls, "sm_90", 132)
        compile_support.drive_fused_variants()
    else:
        defined = compile_support.drive(calls, "sm_90", 132)

    def show(row):
        print(f"{row['kernel']:<34} warps {row['options']['num_warps']:>2}  regs {row['registers']:>3}  "
              f"stack {row['spill_stack_bytes']:>5} B  smem {row['shared_bytes']:>6} B  "
              f"{compile_support.shape_label(row)}", flush=True)

    rows, failures = compile_support.compile_calls(calls, GPUTarget("cuda", 90, 32), _resources, show)
    with open(report_path, "w") as fh:
        json.dump(dict(rows=rows, defined=sorted(defined)), fh, indent=1)
    for failure in failures:
        print("FAILED", failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))

"""Every kernel compiled for AMD Instinct MI300X (gfx942) and MI355X (gfx950) on the CPU.

The package claims one Triton code base for AMD and NVIDIA, but what fits a
Hopper SM need not fit a CDNA compute unit: 64 KiB of LDS on gfx942 and 160 KiB
on gfx950 (228 KiB of shared memory on an H200), 64-lane wavefronts, a 512-entry
unified VGPR/AGPR file per SIMD lane. A kernel that does not fit fails only on
the user's machine. The Triton wheel carries the AMD backend: LLVM and the LLD
linker built into ``libtriton`` (``amd.link_hsaco``) and the ROCm device
libraries (``ocml.bc``, ``ockl.bc``), so a CPU-only machine produces gfx942/gfx950
code objects.

A child process (no ``TRITON_INTERPRET``) drives the package's entry points with
the device facts of each target patched in (``tests/compile_support.py``: arch,
compute units 304 / 256, a compiled GPU), so every launcher picks the launch
configuration it picks on that part (:mod:`kda_engram.launch_config`), then
compiles each recorded launch to a code object with its arguments specialised
by Triton's launch binder. Per kernel it prints VGPRs, AGPRs, SGPRs, scratch
(spill) bytes per lane, LDS bytes per workgroup and the waves per SIMD they
allow, and fails on a kernel that needs more LDS than the target has or spills
past :data:`MAX_SCRATCH_BYTES`. A deliberately oversized walk tile is compiled
too, and the checker must reject it.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the child and pytest import compile_support alike

import compile_support  # noqa: E402

from kda_engram.launch_config import ARCH_FACTS, walk_programs_per_cu  # noqa: E402

TARGETS = ("gfx942", "gfx950")

# Scratch (private segment) bytes per lane a kernel may use for spills. Every kernel
# compiles with none on both targets today (the table in the README); past 1 KiB per
# lane a kernel has lost its register budget (the same bound as the sm_90 test's
# stack: the conv-state prologue once spilled 11.9 KB on sm_90 and ran 2x slower).
MAX_SCRATCH_BYTES = 1024

# CDNA3/4: 4 SIMDs per CU, at most 8 waves per SIMD; 512 VGPRs (arch + acc) per
# lane of a SIMD, allocated in granules of 8.
SIMDS_PER_CU = 4
MAX_WAVES_PER_SIMD = 8
VGPRS_PER_SIMD_LANE = 512
VGPR_GRANULE = 8

# The oversized configuration the checker must reject: the walk at BV = 128 and
# three pipeline stages stages far more operand tiles than gfx942's 64 KiB.
OVERSIZED = {"BV": 128, "num_stages": 3}

KERNELS = ("_chunk_metadata_kernel", "_kda_prologue_intra_kernel", "_kda_prologue_solve_kernel", "_kda_chunk_walk_kernel",
           "_kda_group_pass_one_kernel", "_kda_group_scan_kernel", "_kda_decode_kernel", "_index_rules_kernel",
           "_cu_seqlens_rules_kernel", "_state_rules_kernel", "_decode_multi_rules_kernel", "_kda_batch_rules_kernel",
           "_conv_decode_kernel",
           "_conv_prefill_kernel", "_conv_checkpoint_kernel", "_engram_post_wkv_kernel",
           "_engram_gate_partials_kernel", "_engram_gate_finish_kernel", "_engram_gather_kernel",
           "_ngram_hash_kernel", "_next_history_kernel", "_history_copy_kernel", "_history_checkpoint_kernel")


def _field(text: str, key: str) -> int | None:
    m = re.search(rf"^\s*-?\s*\.{key}:\s*(\d+)", text, re.M)
    return int(m.group(1)) if m else None


def amd_resources(kernel, options) -> dict:
    """Resource usage from the code object's metadata notes (the ``amdgcn`` text
    carries them as YAML: ``.vgpr_count`` is all VGPRs allocated, arch + acc,
    ``.agpr_count`` the acc part; ``.private_segment_fixed_size`` the scratch per lane) plus Triton's dynamic LDS (``metadata.shared``: Triton allocates
    its shared memory at launch, so ``.group_segment_fixed_size`` alone misses it)."""
    text = kernel.asm["amdgcn"]
    vgpr, agpr, sgpr = _field(text, "vgpr_count"), _field(text, "agpr_count"), _field(text, "sgpr_count")
    scratch, static_lds = _field(text, "private_segment_fixed_size"), _field(text, "group_segment_fixed_size")
    if None in (vgpr, sgpr, scratch, static_lds):
        raise RuntimeError(f"no resource notes in the amdgcn of {kernel.metadata.name}")
    llvm_occ = re.search(r"; Occupancy: (\d+)", text)
    return dict(vgpr=vgpr, agpr=agpr or 0, sgpr=sgpr, vgpr_spill=_field(text, "vgpr_spill_count") or 0,
                sgpr_spill=_field(text, "sgpr_spill_count") or 0, scratch_bytes=scratch,
                lds_bytes=static_lds + int(kernel.metadata.shared),
                llvm_occupancy=int(llvm_occ.group(1)) if llvm_occ else MAX_WAVES_PER_SIMD)


def waves_per_simd(row, arch: str) -> int:
    """Waves of this kernel one SIMD holds at once: the least of what the VGPRs
    (and SGPRs, in LLVM's own count, which ignores Triton's dynamic LDS) and the
    LDS allow; 0 when one workgroup does not fit the LDS at all."""
    lds_cu = ARCH_FACTS[arch].shared_bytes
    granules = -(-max(row["vgpr"], 1) // VGPR_GRANULE) * VGPR_GRANULE
    fits = [MAX_WAVES_PER_SIMD, VGPRS_PER_SIMD_LANE // granules, row["llvm_occupancy"]]
    if row["lds_bytes"]:
        groups = lds_cu // row["lds_bytes"]
        fits.append(-(-groups * row["options"]["num_warps"] // SIMDS_PER_CU))
    return max(0, min(fits))


def budget_violations(rows, arch: str) -> list[str]:
    """What breaks the target's budgets: LDS past the CU's, scratch past
    :data:`MAX_SCRATCH_BYTES`, or a workgroup that cannot be resident at all."""
    lds_cu = ARCH_FACTS[arch].shared_bytes
    bad = []
    for r in rows:
        tag = f"{r['kernel']} ({compile_support.shape_label(r)}, warps {r['options']['num_warps']})"
        if r["lds_bytes"] > lds_cu:
            bad.append(f"{tag}: LDS {r['lds_bytes']} B > {lds_cu} B of {arch}")
        if r["scratch_bytes"] > MAX_SCRATCH_BYTES:
            bad.append(f"{tag}: scratch {r['scratch_bytes']} B per lane > {MAX_SCRATCH_BYTES} B")
        if waves_per_simd(r, arch) < 1:
            bad.append(f"{tag}: not one workgroup fits a CU")
    return bad


def _launch_labels(rows) -> list[str]:
    """Per row, the constexprs that tell apart the launches of the same kernel."""
    varying = {}
    for r in rows:
        for k, v in r["constexprs"].items():
            if k.isupper() and k not in ("INTERPRET",):
                varying.setdefault(r["kernel"], {}).setdefault(k, set()).add(repr(v))
    return [" ".join(f"{k}={v}" for k, v in r["constexprs"].items()
                     if len(varying.get(r["kernel"], {}).get(k, ())) > 1) or "-" for r in rows]


def table(rows, arch: str) -> str:
    """The per-kernel table the test prints (and the README shows); ``launch``
    names only what differs between the launches of one kernel."""
    lines = [f"{arch} ({ARCH_FACTS[arch].compute_units} CUs, {ARCH_FACTS[arch].shared_bytes // 1024} KiB LDS)",
             "| kernel | launch | warps | VGPR | AGPR | SGPR | scratch B | LDS B | waves/SIMD |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r, label in sorted(zip(rows, _launch_labels(rows)), key=lambda x: x[0]["kernel"]):
        line = (f"| {r['kernel']} | {label} | {r['options']['num_warps']} | {r['vgpr']} | {r['agpr']} | "
                f"{r['sgpr']} | {r['scratch_bytes']} | {r['lds_bytes']} | {waves_per_simd(r, arch)} |")
        if line not in lines:  # launches told apart only by argument alignment, compiled alike
            lines.append(line)
    return "\n".join(lines)


def summary(report) -> str:
    """One row per kernel (with its number of distinct launches on the first
    target), per target the worst of its launches: most VGPRs (arch + acc, as
    allocated; with the AGPRs and SGPRs of that launch), most scratch, most LDS,
    fewest waves per SIMD. (What the README shows.)"""
    head = "| kernel (launches) | " + " | ".join(f"{a} VGPR/AGPR/SGPR | scratch B | LDS B | waves/SIMD"
                                                 for a in TARGETS) + " |"
    lines = [head, "|---|" + "---|---|---|---|" * len(TARGETS)]
    for name in sorted({r["kernel"] for a in TARGETS for r in report[a]}):
        cells = []
        for a in TARGETS:
            rows = [r for r in report[a] if r["kernel"] == name]
            top = max(rows, key=lambda r: r["vgpr"])
            cells.append(f"{top['vgpr']}/{top['agpr']}/{top['sgpr']} | {max(r['scratch_bytes'] for r in rows)} | "
                         f"{max(r['lds_bytes'] for r in rows)} | {min(waves_per_simd(r, a) for r in rows)}")
        launches = sum(r["kernel"] == name for r in report[TARGETS[0]])
        lines.append(f"| `{name}` ({launches}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def amd_report(tmp_path_factory):
    """The child's report, compiled once per test session: ``{arch: rows,
    "oversized": rows}``."""
    tmp = tmp_path_factory.mktemp("amd")
    report = tmp / "report.json"
    proc = compile_support.run_child(__file__, [report], tmp)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads(report.read_text())


@pytest.mark.parametrize("arch", TARGETS)
def test_every_kernel_compiles_within_budget(amd_report, arch):
    rows = amd_report[arch]
    print("\n" + table(rows, arch))
    compiled = {r["kernel"] for r in rows}
    missing = [k for k in (*KERNELS, *amd_report["defined"]) if k not in compiled]
    assert not missing, f"never launched by the driver on {arch} (add a call to compile_support.drive): {missing}"
    # The launch choices of this architecture reached the compile (launch_config):
    # the walk single-staged, the scan's products at ieee (no tf32x3 on CDNA).
    walks = [r for r in rows if r["kernel"] == "_kda_chunk_walk_kernel"]
    assert walks and all(r["options"]["num_stages"] == 1 for r in walks), [r["options"] for r in walks]
    assert {r["constexprs"]["PRECISION"] for r in rows if r["kernel"] == "_kda_group_scan_kernel"} == {"ieee"}
    assert all(r["vgpr"] > 0 and r["sgpr"] > 0 for r in rows)
    # The walk's resident programs per CU that the tile choice assumes
    # (launch_config.WALK_PROGRAMS_PER_CU) are what the compiled registers allow.
    for r in walks:
        per_cu = waves_per_simd(r, arch) * SIMDS_PER_CU // r["options"]["num_warps"]
        assert per_cu == walk_programs_per_cu(arch, r["constexprs"]["BV"]), (compile_support.shape_label(r), r["vgpr"])
    bad = budget_violations(rows, arch)
    assert not bad, "\n".join(bad)


def test_summary_covers_every_kernel(amd_report):
    text = summary(amd_report)
    print("\n" + text)
    assert all(f"`{k}`" in text for k in KERNELS)


def test_checker_flags_each_budget():
    ok = dict(kernel="k", constexprs={"BV": 32}, options=dict(num_warps=4), vgpr=128, agpr=0, sgpr=40,
              scratch_bytes=0, lds_bytes=16384, llvm_occupancy=8)
    assert waves_per_simd(ok, "gfx942") == 4 and budget_violations([ok], "gfx942") == []
    spill = {**ok, "scratch_bytes": MAX_SCRATCH_BYTES + 4}
    assert [b for b in budget_violations([spill], "gfx950") if "scratch" in b]
    # 96 KiB of LDS: too much for gfx942, one workgroup per CU on gfx950.
    big = {**ok, "lds_bytes": 96 * 1024}
    assert [b for b in budget_violations([big], "gfx942") if "LDS" in b]
    assert budget_violations([big], "gfx950") == [] and waves_per_simd(big, "gfx950") == 1


def test_oversized_walk_is_flagged(amd_report):
    rows = amd_report["oversized"]
    assert [r["kernel"] for r in rows] == ["_kda_chunk_walk_kernel"]
    print("\n" + table(rows, "gfx942"))
    bad = budget_violations(rows, "gfx942")
    assert any("LDS" in b for b in bad), (rows, bad)


# --------------------------------------------------------------------------- child


def main(report_path: str) -> int:
    from triton.backends.compiler import GPUTarget

    report, failures = {}, []
    for arch in TARGETS:
        facts = ARCH_FACTS[arch]
        calls = []
        report["defined"] = sorted(compile_support.drive(calls, arch, facts.compute_units))
        target = GPUTarget("hip", arch, facts.warp_size)

        def show(row, arch=arch):
            print(f"{arch} {row['kernel']:<34} warps {row['options']['num_warps']:>2}  vgpr {row['vgpr']:>3} "
                  f"agpr {row['agpr']:>3} sgpr {row['sgpr']:>3} scratch {row['scratch_bytes']:>5} B "
                  f"lds {row['lds_bytes']:>6} B  {compile_support.shape_label(row)}", flush=True)

        rows, fails = compile_support.compile_calls(calls, target, amd_resources, show)
        report[arch] = rows
        failures += [f"{arch} {f}" for f in fails]
        if arch == "gfx942":
            walk = next(c for c in calls if c[0] == "_kda_chunk_walk_kernel")
            big = [(walk[0], walk[1], walk[2], {**walk[3], **OVERSIZED})]
            report["oversized"], fails = compile_support.compile_calls(big, target, amd_resources, show)
            failures += [f"oversized {f}" for f in fails]
    with open(report_path, "w") as fh:
        json.dump(report, fh, indent=1)
    for failure in failures:
        print("FAILED", failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

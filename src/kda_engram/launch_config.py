"""Typed, validated launch configurations of the KDA kernels, chosen per architecture.

Every tile width, warp count, pipeline depth and product precision the package
launches with is a field of a frozen dataclass here, checked once in
``__post_init__`` (a one-line ``ValueError`` naming the field), and picked for an
architecture string (``"sm_90"``, ``"gfx942"``, ``"gfx950"``, ``"cpu"``) and a
compute-unit count by a plain function, so the per-architecture choices live in
one file instead of in the kernels' launchers. Why each choice is what it is is
written beside it in a line; the measurements behind the NVIDIA defaults are in
docs/design/ (``kda_prefill.md``, ``kda_decode.md``, ``kda_bf16_state.md``).

* :class:`ChunkConfig`: a user's partial override of the chunk walk (what
  ``kda_prefill_walk(config=...)`` takes; a dict of the same keys converts).
* :class:`ChunkLaunch`: the resolved walk / pass-one / scan launch, bound to the
  head dims and the architecture (checks that need them: divisibility and the
  Triton 3.6 miscompiles).
* :class:`DecodeTiling`, :class:`PrologueWarps`: the decode and prologue launches.
* :class:`ArchFacts`: what a target has (wavefront, LDS/shared memory per unit,
  compute units); the AMD compile test (``tests/test_compile_amd.py``) checks
  every kernel against it.

Bottom layer: imports only torch and :mod:`kda_engram.platform`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch

from . import platform

__all__ = [
    "ARCH_FACTS",
    "ArchFacts",
    "ChunkConfig",
    "ChunkLaunch",
    "DecodeTiling",
    "GateGeometry",
    "PrologueWarps",
    "arch_facts",
    "chunk_config",
    "chunk_launch",
    "decode_tiling_for",
    "fused_decode_tiling_for",
    "device_arch",
    "is_pow2",
    "prologue_warps_for",
    "scan_precision_for",
    "walk_programs_per_cu",
    "walk_tile",
]

SCAN_PRECISIONS = ("ieee", "tf32x3", "tf32")


@dataclass(frozen=True)
class ArchFacts:
    """What a target offers a program: lanes per warp/wavefront, shared memory
    (LDS) per compute unit in bytes, compute units of the reference part, and the
    input precisions its ``tl.dot`` accepts for fp32 operands (Triton 3.6)."""

    name: str
    warp_size: int
    shared_bytes: int
    compute_units: int
    dot_precisions: tuple[str, ...]


# Reference parts: H100/H200 (132 SMs, 228 KiB shared memory per SM), MI300X (304
# CUs, 64 KiB LDS), MI355X (256 CUs, 160 KiB LDS); the CPU is the interpreter.
ARCH_FACTS = {
    "sm_90": ArchFacts("sm_90", 32, 228 * 1024, 132, ("ieee", "tf32x3", "tf32")),
    "gfx942": ArchFacts("gfx942", 64, 64 * 1024, 304, ("ieee", "tf32")),
    "gfx950": ArchFacts("gfx950", 64, 160 * 1024, 256, ("ieee",)),
    "cpu": ArchFacts("cpu", 32, 1 << 40, platform.CPU_COMPUTE_UNITS, ("ieee", "tf32x3", "tf32")),
}


def arch_facts(arch: str) -> ArchFacts:
    """Facts of ``arch``; an unlisted NVIDIA part is taken as sm_90, an unlisted AMD
    one as gfx942 (the smaller LDS: a launch that fits it fits the others)."""
    if arch in ARCH_FACTS:
        return ARCH_FACTS[arch]
    return ARCH_FACTS["gfx942" if arch.startswith("gfx") else "sm_90"]


def device_arch(device: torch.device | str | None) -> str:
    """The architecture string whose launch choices apply to ``device``: ``"cpu"``
    under the interpreter (whatever the tensors' device), else :func:`platform.arch`."""
    if platform.interpreting():
        return "cpu"
    return platform.arch(device)


def _is_amd(arch: str) -> bool:
    return arch.startswith("gfx")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_pow2(x) -> bool:
    """Whether ``x`` is an int (not a bool) and a positive power of two."""
    return _is_int(x) and x > 0 and (x & (x - 1)) == 0


def check_block_override(name: str, value, dim: int, dim_name: str) -> None:
    """A tile-size launch override (``None``: the package's pick): a power of two
    dividing ``dim`` (so at most ``dim``), else a one-line ``ValueError`` naming it."""
    if value is not None and not (is_pow2(value) and dim % value == 0):
        raise ValueError(f"{name}: expected a power of two dividing {dim_name}={dim} (1 to {dim}) or None, "
                         f"got {value!r}")


def check_warps_override(name: str, value, high: int = 32) -> None:
    """A warps launch override (``None``: the package's pick): a power of two in
    ``[1, high]``, else a one-line ``ValueError`` naming it."""
    if value is not None and not (is_pow2(value) and value <= high):
        raise ValueError(f"{name}: expected a power of two in [1, {high}] or None, got {value!r}")


def _check_tile(name: str, value, lo: int = 16) -> None:
    if value is not None and not (is_pow2(value) and value >= lo):
        raise ValueError(f"config: {name} must be a power of two >= {lo}, got {value!r}")


def _check_warps(name: str, value) -> None:
    if value is not None and not (is_pow2(value) and value <= 32):
        raise ValueError(f"config: {name} must be a power of two in [1, 32], got {value!r}")


def _check_stages(name: str, value) -> None:
    if value is not None and not (_is_int(value) and 1 <= value <= 8):
        raise ValueError(f"config: {name} must be an int in [1, 8], got {value!r}")


# --------------------------------------------------------------------------------------
# Chunk walk (kda/chunk.py)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChunkConfig:
    """A partial override of the chunk launch (``None`` = the package's pick):
    the walk's ``BV``/``num_warps``/``num_stages``, the grouped walk's pass one
    (``*_pass1``) and scan (``BV_scan``, ``BJ_scan`` the contraction block of the
    scan's product, ``num_warps_scan``, ``num_stages_scan``, ``scan_precision``)."""

    BV: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    BV_pass1: int | None = None
    num_warps_pass1: int | None = None
    num_stages_pass1: int | None = None
    BV_scan: int | None = None
    BJ_scan: int | None = None
    num_warps_scan: int | None = None
    num_stages_scan: int | None = None
    scan_precision: str | None = None

    def __post_init__(self):
        for name in ("BV", "BV_pass1", "BV_scan", "BJ_scan"):
            _check_tile(name, getattr(self, name))
        for name in ("num_warps", "num_warps_pass1", "num_warps_scan"):
            _check_warps(name, getattr(self, name))
        for name in ("num_stages", "num_stages_pass1", "num_stages_scan"):
            _check_stages(name, getattr(self, name))
        if self.scan_precision is not None and self.scan_precision not in SCAN_PRECISIONS:
            raise ValueError(f"config: scan_precision must be 'ieee', 'tf32x3' or 'tf32', got {self.scan_precision!r}")

    @classmethod
    def of(cls, config) -> ChunkConfig:
        """``config`` as a :class:`ChunkConfig`: ``None``, a ``ChunkConfig`` or a dict
        of its field names (an unknown key is a ``ValueError``)."""
        if config is None:
            return _NO_CHUNK_OVERRIDE
        if isinstance(config, cls):
            return config
        if not isinstance(config, dict):
            raise TypeError(f"config: expected None, a dict or a ChunkConfig, got {type(config).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"config: unknown keys {unknown}; expected some of {sorted(known)}")
        return cls(**config)


_NO_CHUNK_OVERRIDE = ChunkConfig()  # every field the package's pick (frozen: one shared instance)


@dataclass(frozen=True)
class ChunkLaunch:
    """The resolved chunk launch, bound to the head dims ``K``, ``V``, the
    architecture and whether the interpreter runs it. ``BV_pass1`` tiles the
    ``V + K`` rows of pass one (it must divide both); the scan's ``BV_scan`` tiles
    ``V`` and ``BJ_scan`` its contraction over ``K``."""

    K: int
    V: int
    arch: str
    interpret: bool
    BV: int
    num_warps: int
    num_stages: int
    BV_pass1: int
    num_warps_pass1: int
    num_stages_pass1: int
    BV_scan: int
    BJ_scan: int
    num_warps_scan: int
    num_stages_scan: int
    scan_precision: str
    facts: ArchFacts = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "facts", arch_facts(self.arch))
        ChunkConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ChunkConfig)})  # ranges, types
        K, V, compiled = self.K, self.V, not self.interpret
        for name, dims in (("BV", (V,)), ("BV_pass1", (V, K)), ("BV_scan", (V,))):
            bv = getattr(self, name)
            if any(d % bv for d in dims):
                tiled = f"V={V} and K={K}" if len(dims) > 1 else f"V={V}"
                raise ValueError(f"config: {name} must be an int >= 16 dividing {tiled}, got {bv!r}")
            # Triton 3.6 miscompiles 16-column state tiles on the GPU (NaN outputs; the
            # interpreter computes them correctly): docs/design/kda_prefill.md.
            if compiled and bv < 32 and min(dims + (V,)) >= 32:
                raise ValueError(f"config: {name}={bv} is miscompiled by Triton 3.6 on the GPU (NaN outputs); use 32 or 64")
        if K % self.BJ_scan:
            raise ValueError(f"config: BJ_scan must be an int >= 16 dividing K={K}, got {self.BJ_scan!r}")
        if compiled and not _is_amd(self.arch) and self.BV == 32 and self.num_stages < 2:
            # Triton 3.6: out-of-bounds shared-memory read (compute-sanitizer): docs/design/kda_prefill.md.
            raise ValueError(f"config: BV=32 with num_stages={self.num_stages} is miscompiled by Triton 3.6 on "
                             "NVIDIA GPUs (illegal memory access); use num_stages=2 or BV=64")
        if compiled and self.scan_precision not in self.facts.dot_precisions:
            raise ValueError(f"config: scan_precision={self.scan_precision!r} does not exist on {self.arch} "
                             f"(Triton 3.6 offers {list(self.facts.dot_precisions)})")
        if compiled and _is_amd(self.arch):
            # A workgroup is at most 1024 lanes: 16 wavefronts of 64.
            for name in ("num_warps", "num_warps_pass1", "num_warps_scan"):
                if getattr(self, name) * self.facts.warp_size > 1024:
                    raise ValueError(f"config: {name}={getattr(self, name)} exceeds 1024 lanes per workgroup on {self.arch}")

    def walk_dict(self) -> dict:
        """``{"BV", "num_warps", "num_stages"}`` of the walk (what ``chunk_config`` returns)."""
        return {"BV": self.BV, "num_warps": self.num_warps, "num_stages": self.num_stages}


# Walk programs one CU holds at once on AMD, per tile width, from the compile
# (tests/test_compile_amd.py, Triton 3.6, K = V = 128, bf16, 4 wavefronts):
# registers, not LDS, set it. A program of 4 wavefronts puts one on each SIMD,
# so programs per CU = waves per SIMD = 512 // VGPRs (arch + acc, granules of 8).
#   gfx942: BV 32 -> 284-306 VGPRs, BV 64 -> 300: one program (LDS 16 / 32 KiB).
#   gfx950: BV 32 -> 244-256 VGPRs: two programs; BV 64 -> 288: one.
WALK_PROGRAMS_PER_CU = {"gfx942": {32: 1, 64: 1}, "gfx950": {32: 2, 64: 1}}


def walk_programs_per_cu(arch: str, bv: int) -> int:
    """Walk programs of width ``bv`` resident per compute unit: two per Hopper SM
    (one stage of operands is about 60 KiB of the 228 KiB shared memory); on AMD the compiled
    register count decides (:data:`WALK_PROGRAMS_PER_CU`; an unlisted CDNA part
    takes one, the least of the two)."""
    if _is_amd(arch):
        return WALK_PROGRAMS_PER_CU.get(arch, {}).get(bv, 1)
    return 2


def walk_tile(programs_per_bv, head_v: int, arch: str, compute_units: int) -> dict:
    """``{"BV", "num_warps", "num_stages"}`` of a walk over ``head_v`` rows where a
    ``BV``-wide tile gives ``programs_per_bv(BV)`` programs (see :func:`chunk_config`'s
    docstring for the model: fewest waves of resident programs, then the narrowest).

    * Resident programs per unit: :func:`walk_programs_per_cu` (two per Hopper SM;
      on CDNA the registers allow one, or two at BV = 32 on gfx950).
    * NVIDIA: double-staged where one program per SM is all the grid has; BV = 32
      only where it fits one program per SM (Triton 3.6 miscompiles it
      single-staged there).
    * AMD CDNA3/4: single-staged. Two stages fit the LDS (48 KiB at BV 32 and 64,
      against 64 KiB on gfx942) but raise the walk from ~300 to ~400 VGPRs and were
      never timed on AMD hardware; one stage is the build with the fewest registers.
    * 4 warps everywhere: at 8 wavefronts of 64 lanes LLVM caps the walk at 256
      VGPRs and it spills (56-400 B per lane on gfx942, the compile test).
    * BV = 16 never on a compiled target with V >= 32 (NaN outputs on the H200).
    """
    amd = _is_amd(arch)
    best = None
    for bv in (64, 32):
        if bv > head_v or head_v % bv:
            continue
        programs = programs_per_bv(bv)
        if bv == 32 and not amd and programs > compute_units:
            continue
        waves = -(-programs // (walk_programs_per_cu(arch, bv) * compute_units))
        if best is None or waves <= best[0]:
            best = (waves, bv)
    bv = best[1] if best else min(head_v, 32)
    programs = programs_per_bv(bv)
    stages = 2 if not amd and (programs <= compute_units or bv == 32) else 1
    return {"BV": bv, "num_warps": 4, "num_stages": stages}


def chunk_config(num_seqs: int, num_heads: int, head_v: int, device: torch.device | str | None = None) -> dict:
    """Launch configuration of the chunk walk (:func:`kda_engram.kda.chunk.kda_prefill_walk`,
    one chunk group) of ``num_seqs`` sequences of ``num_heads`` heads on ``device``: the
    V-tile width ``BV``, ``num_warps``, ``num_stages``, as ``{"BV", "num_warps",
    "num_stages"}`` (what a ``config=`` of the walk overrides; the benchmarks print it).

    The grid is ``(V / BV) x H x N`` programs and each walks its sequence's
    chunks serially, so a program's run time is set by the chunk count times the
    latency of one chunk step, and the launch takes ``waves`` such runs, with
    ``waves = ceil(programs / resident programs)``. One stage of operands
    (qg, w, kg_t: 16 KiB each, aqk, u) is about 60 KiB of shared memory, so two
    programs fit a Hopper SM single-staged; the width is the one with the fewest
    waves, and among those the narrowest (a narrower tile is a shorter step).
    Wide tiles (BV = 64) also halve the re-reads of ``w``/``qg``/``kg_t``/``aqk``
    (one per V-tile, mostly from L2), which is what the many-wave batched cases
    need; narrow ones fill the machine when ``N x H`` is small (1 x 8k x 32 heads
    on 132 SMs). Software pipelining (``num_stages = 2``) doubles the staging, so
    it is taken only where one program per unit is all the grid has anyway. On
    AMD CDNA the walk is single-staged and the programs a CU holds are set by its
    compiled registers (one on gfx942, two BV = 32 walks on gfx950). The
    per-architecture rule is :func:`walk_tile`.

    BV = 16 is never picked, and BV = 32 only where its grid fits one program per
    SM (double-staged): Triton 3.6 miscompiles both otherwise on NVIDIA (the
    record: docs/design/kda_prefill.md, "The chunk walk's launch").
    """
    nh = max(num_seqs * num_heads, 1)
    return walk_tile(lambda bv: nh * (head_v // bv), head_v, platform.arch(device), platform.num_compute_units(device))


def scan_precision_for(ieee_operands: bool, arch: str) -> str:
    """The group scan's product precision: ``tf32x3`` on NVIDIA with bf16/fp16
    operands (a fraction of the FMA product's time at about fp32 rounding, far below
    the walk's bf16 rounding; numbers in ``docs/design/kda_prefill.md``); ``ieee`` for
    fp32 operands (the tests' exact path), on the CPU, and on AMD (Triton 3.6 has no
    ``tf32x3`` there, and gfx950 no ``tf32`` at all). ``config={"scan_precision": ...}``
    overrides it."""
    if ieee_operands or arch == "cpu" or _is_amd(arch):
        return "ieee"
    return "tf32x3"


def chunk_launch(config, *, num_seqs: int, n_groups: int, num_heads: int, head_k: int, head_v: int,
                 ieee_operands: bool, arch: str, compute_units: int, interpret: bool) -> ChunkLaunch:
    """The chunk launch for ``num_seqs`` sequences cut into ``n_groups`` groups of
    ``num_heads`` heads: the package's picks (:func:`walk_tile`, the scan's
    defaults below) with ``config`` (dict or :class:`ChunkConfig`) on top.

    Scan defaults: ``BV_scan = min(32, V)`` and ``BJ_scan = min(32, K)`` (a 32 x 32
    fp32 product block per step keeps the ``[K, BV]`` state and one block of ``M``
    in registers), 8 warps and one stage (a single serial chain per program: more
    lanes per step, nothing to pipeline across steps). Pass one takes the walk's
    rule over its ``V + K`` rows, halved until the tile divides both ``V`` and ``K``.
    """
    return _resolved_chunk_launch(ChunkConfig.of(config), num_seqs, n_groups, num_heads, head_k, head_v,
                                  bool(ieee_operands), arch, compute_units, bool(interpret))


@functools.lru_cache(maxsize=1024)
def _resolved_chunk_launch(over: ChunkConfig, num_seqs: int, n_groups: int, num_heads: int, head_k: int,
                           head_v: int, ieee_operands: bool, arch: str, compute_units: int,
                           interpret: bool) -> ChunkLaunch:
    """:func:`chunk_launch`, memoised: a pure function of hashable arguments (the
    override is a frozen :class:`ChunkConfig`), so a serving step's repeated batch
    shapes resolve and validate their launch once, not on every call."""
    nh = max(num_seqs * n_groups * num_heads, 1)
    walk = walk_tile(lambda bv: nh * (head_v // bv), head_v, arch, compute_units)
    nh1 = max(num_seqs * (n_groups - 1) * num_heads, 1)
    rows1 = head_v + head_k
    one = walk_tile(lambda bv: nh1 * (rows1 // bv), rows1, arch, compute_units)
    bv1 = one["BV"]
    while bv1 > 16 and (head_v % bv1 or head_k % bv1):
        bv1 //= 2
    pick = lambda name, default: default if getattr(over, name) is None else getattr(over, name)  # noqa: E731
    return ChunkLaunch(
        K=head_k, V=head_v, arch=arch, interpret=interpret,
        BV=pick("BV", walk["BV"]), num_warps=pick("num_warps", walk["num_warps"]),
        num_stages=pick("num_stages", walk["num_stages"]),
        BV_pass1=pick("BV_pass1", bv1), num_warps_pass1=pick("num_warps_pass1", one["num_warps"]),
        num_stages_pass1=pick("num_stages_pass1", one["num_stages"]),
        BV_scan=pick("BV_scan", min(32, head_v)), BJ_scan=pick("BJ_scan", min(32, head_k)),
        num_warps_scan=pick("num_warps_scan", 8), num_stages_scan=pick("num_stages_scan", 1),
        scan_precision=pick("scan_precision", scan_precision_for(ieee_operands, "cpu" if interpret else arch)),
    )


# --------------------------------------------------------------------------------------
# Decode (kda/decode.py) and prologue (kda/prologue.py)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeTiling:
    """Rows of the ``[V, K]`` state per decode program (``block_v``) and its warps."""

    block_v: int
    num_warps: int

    def __post_init__(self):
        if not is_pow2(self.block_v):
            raise ValueError(f"block_v: expected a power of two, got {self.block_v!r}")
        if not (is_pow2(self.num_warps) and self.num_warps <= 32):
            raise ValueError(f"num_warps: expected a power of two in [1, 32], got {self.num_warps!r}")


def decode_tiling_for(arch: str, v_dim: int, steps: int = 1, state_dtype=None) -> DecodeTiling:
    """The decode tiling (the sweeps: docs/design/kda_decode.md, kda_bf16_state.md).

    * 16 rows per program: a 16-row tile of a 128-wide fp32 state is 8 KiB, so more
      programs keep more bytes in flight.
    * fp32 state: 4 warps for one token, 2 for several (the tile stays live across
      the steps and each thread then does more independent work per load).
    * bf16 state, one token: the whole head (128 rows) and 8 warps. Several tokens:
      32 rows and 2 warps.
    * On AMD the same choices: at 4 wavefronts of 64 lanes a one-token program holds
      8 state elements per lane and the compile shows no spills
      (tests/test_compile_amd.py).
    """
    del arch  # the same on every target until an AMD sweep says otherwise
    if state_dtype == torch.bfloat16:
        return DecodeTiling(block_v=min(128, v_dim), num_warps=8) if steps == 1 else \
            DecodeTiling(block_v=min(32, v_dim), num_warps=2)
    return DecodeTiling(block_v=min(16, v_dim), num_warps=4 if steps == 1 else 2)


def fused_decode_tiling_for(arch: str, v_dim: int, state_dtype=None) -> DecodeTiling:
    """The fused layer decode step's tiling (``kda/fused_decode.py``): one program
    per (sequence, head) walks the head's ``V`` rows in ``block_v`` tiles, two
    tiles live at a time (the next one's load in flight). 16 rows x 4 warps; 64 x 2
    spills once double-buffered (the sweep: docs/design/kda_bf16_state.md)."""
    del arch, state_dtype  # one choice so far for both state dtypes and every target
    return DecodeTiling(block_v=min(16, v_dim), num_warps=4)


@dataclass(frozen=True)
class PrologueWarps:
    """Warps per program of the prologue's two launches (intra-chunk, solve)."""

    intra: int
    solve: int

    def __post_init__(self):
        for name in ("intra", "solve"):
            w = getattr(self, name)
            if not (is_pow2(w) and w <= 16):
                raise ValueError(f"num_warps: expected powers of two in [1, 16], got {name}={w!r}")


@functools.lru_cache(maxsize=64)
def prologue_warps_for(arch: str, head_k: int, head_v: int) -> PrologueWarps:
    """The prologue's warps (the sweep: docs/design/kda_prefill.md, "Prologue warps").

    * Compiled, K or V >= 128: (4, 2); both kernels hold 255 registers per thread at
      any width, so narrower solve programs give more independent programs per SM.
      The same on AMD, where 4 and 2
      wavefronts are 256 and 128 lanes (the compile test reports the spills).
    * Interpreter or small heads: (4, 4) (only speed differs).
    """
    if arch != "cpu" and max(head_k, head_v) >= 128:
        return PrologueWarps(4, 2)
    return PrologueWarps(4, 4)


# --------------------------------------------------------------------------------------
# Engram gate (engram/gate.py, engram/sharded_gate.py)
# --------------------------------------------------------------------------------------

GATE_EVICTION_HINTS = ("", "evict_last", "evict_first")


@dataclass(frozen=True)
class GateGeometry:
    """Constexprs and warps of a gate program (the choices are ``engram/gate.py:
    launch_geometry`` and ``post_wkv_launch``, with their measurements): a ``dim`` row
    held as two power-of-two register blocks ``HEAD`` + ``TAIL`` (single pass), or
    streamed in ``CHUNK``-wide blocks (``LOOP``, two passes; then ``HEAD = 16``,
    ``TAIL = 0``). ``KEEP``/``LAST_USE`` (L2 eviction hints) and ``PERSISTENT`` are
    the single-rank gate's only (``None`` = not a constexpr of the kernel)."""

    HEAD: int
    TAIL: int
    CHUNK: int
    LOOP: bool
    num_warps: int
    KEEP: str | None = None
    LAST_USE: str | None = None
    PERSISTENT: bool | None = None

    def __post_init__(self):
        for name in ("HEAD", "CHUNK"):
            if not (is_pow2(getattr(self, name)) and getattr(self, name) >= 16):
                raise ValueError(f"gate geometry: {name} must be a power of two >= 16, got {getattr(self, name)!r}")
        if self.TAIL != 0 and not (is_pow2(self.TAIL) and self.TAIL >= 16):
            raise ValueError(f"gate geometry: TAIL must be 0 or a power of two >= 16, got {self.TAIL!r}")
        if not (is_pow2(self.num_warps) and self.num_warps <= 32):
            raise ValueError(f"num_warps: expected a power of two in [1, 32], got {self.num_warps!r}")
        if self.LOOP and (self.HEAD, self.TAIL) != (16, 0):
            raise ValueError(f"gate geometry: LOOP streams CHUNK-wide blocks, HEAD/TAIL must be 16/0, "
                             f"got {self.HEAD}/{self.TAIL}")
        for name in ("KEEP", "LAST_USE"):
            if getattr(self, name) not in (None, *GATE_EVICTION_HINTS):
                raise ValueError(f"gate geometry: {name} must be one of {GATE_EVICTION_HINTS}, got {getattr(self, name)!r}")
        if self.PERSISTENT and self.LOOP:
            raise ValueError("gate geometry: the persistent grid runs the single pass only (LOOP=True)")

    def as_dict(self) -> dict:
        """The launch keywords (constexprs and ``num_warps``), ``None`` fields left out."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


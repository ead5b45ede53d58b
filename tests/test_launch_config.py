"""The typed launch configuration: validation, the per-architecture picks, and
``kda_prefill_walk(config=...)`` taking a dict or the dataclass."""

import dataclasses

import pytest
import torch

from kda_engram.kda.chunk import chunk_config, kda_prefill_walk
from kda_engram.kda.reference import naive_chunk_operands, naive_chunk_walk
from kda_engram.launch_config import (
    ARCH_FACTS,
    ChunkConfig,
    ChunkLaunch,
    DecodeTiling,
    PrologueWarps,
    arch_facts,
    chunk_launch,
    decode_tiling_for,
    prologue_warps_for,
    scan_precision_for,
    walk_programs_per_cu,
    walk_tile,
)


def _launch(arch, *, interpret=False, config=None, N=1, G=1, H=4, K=128, V=128, ieee=False, cus=None):
    return chunk_launch(config, num_seqs=N, n_groups=G, num_heads=H, head_k=K, head_v=V, ieee_operands=ieee,
                        arch=arch, compute_units=cus or arch_facts(arch).compute_units, interpret=interpret)


def test_arch_facts():
    assert arch_facts("gfx942").shared_bytes == 64 * 1024 and arch_facts("gfx942").compute_units == 304
    assert arch_facts("gfx950").shared_bytes == 160 * 1024 and arch_facts("gfx950").compute_units == 256
    assert arch_facts("gfx942").warp_size == arch_facts("gfx950").warp_size == 64
    assert arch_facts("sm_90").warp_size == 32
    assert arch_facts("gfx90a") is ARCH_FACTS["gfx942"]  # an unlisted CDNA part: the smaller LDS
    assert arch_facts("sm_100") is ARCH_FACTS["sm_90"]


@pytest.mark.parametrize("bad, field", [
    (dict(BV=24), "BV"), (dict(BV=8), "BV"), (dict(BV=True), "BV"), (dict(BV_pass1=48), "BV_pass1"),
    (dict(BJ_scan=24), "BJ_scan"), (dict(num_warps=3), "num_warps"), (dict(num_warps_scan=64), "num_warps_scan"),
    (dict(num_stages=0), "num_stages"), (dict(num_stages_pass1=1.0), "num_stages_pass1"),
    (dict(scan_precision="bf16"), "scan_precision"),
])
def test_chunk_config_field_checks(bad, field):
    with pytest.raises(ValueError, match=f"config: {field}\\b"):
        ChunkConfig(**bad)


def test_chunk_config_of():
    assert ChunkConfig.of(None) == ChunkConfig()
    cfg = ChunkConfig(BV=32)
    assert ChunkConfig.of(cfg) is cfg
    assert ChunkConfig.of({"BV": 64, "num_warps_scan": 4}) == ChunkConfig(BV=64, num_warps_scan=4)
    with pytest.raises(ValueError, match=r"config: unknown keys \['bv'\]"):
        ChunkConfig.of({"bv": 64})
    with pytest.raises(TypeError, match="config"):
        ChunkConfig.of([("BV", 64)])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.BV = 64


def test_bound_checks():
    with pytest.raises(ValueError, match="config: BV must be an int >= 16 dividing V=32"):
        _launch("cpu", interpret=True, config={"BV": 64}, K=32, V=32)
    with pytest.raises(ValueError, match="BV_pass1 must be an int >= 16 dividing V=64 and K=32"):
        _launch("cpu", interpret=True, config={"BV_pass1": 64}, K=32, V=64)
    with pytest.raises(ValueError, match="BJ_scan must be an int >= 16 dividing K=32"):
        _launch("cpu", interpret=True, config={"BJ_scan": 64}, K=32, V=32)
    # Triton 3.6 miscompiles, refused on compiled targets only.
    with pytest.raises(ValueError, match="BV=16 is miscompiled"):
        _launch("sm_90", config={"BV": 16})
    assert _launch("cpu", interpret=True, config={"BV": 16}).BV == 16
    with pytest.raises(ValueError, match="num_stages=1"):
        _launch("sm_90", config={"BV": 32, "num_stages": 1})
    assert _launch("gfx942", config={"BV": 32, "num_stages": 1}).BV == 32  # NVIDIA-only miscompile
    # Products that do not exist on a target.
    with pytest.raises(ValueError, match="scan_precision='tf32x3' does not exist on gfx942"):
        _launch("gfx942", config={"scan_precision": "tf32x3"})
    with pytest.raises(ValueError, match="scan_precision='tf32' does not exist on gfx950"):
        _launch("gfx950", config={"scan_precision": "tf32"})
    assert _launch("gfx942", config={"scan_precision": "tf32"}).scan_precision == "tf32"
    # 16 wavefronts of 64 lanes fill a workgroup; 32 do not fit.
    with pytest.raises(ValueError, match="num_warps_scan=32 exceeds 1024 lanes"):
        _launch("gfx950", config={"num_warps_scan": 32})
    assert _launch("sm_90", config={"num_warps_scan": 32}).num_warps_scan == 32


def test_launch_picks_per_architecture():
    # CDNA: single-staged walks, ieee scan products; the tile follows the resident
    # programs the compiled registers allow (two BV = 32 walks per CU on gfx950).
    for arch in ("gfx942", "gfx950"):
        for N, H in ((1, 1), (1, 4), (1, 32), (16, 32), (64, 32)):
            got = _launch(arch, N=N, H=H)
            assert got.num_stages == got.num_stages_pass1 == 1 and got.num_warps == 4, (arch, N, H)
            assert got.scan_precision == "ieee"
    assert walk_programs_per_cu("gfx942", 32) == 1 and walk_programs_per_cu("gfx950", 32) == 2
    assert walk_programs_per_cu("gfx950", 64) == 1 and walk_programs_per_cu("sm_90", 64) == 2
    # 1 x 32 heads: 64 programs at BV = 64 or 128 at BV = 32, one wave either way: the narrower.
    assert _launch("gfx942", H=32).BV == 32
    # 4 x 32 heads at BV = 32 is 512 programs: two waves of 304 on gfx942, one of
    # 2 x 256 on gfx950; at BV = 64, 256 programs, one wave on both.
    assert _launch("gfx942", N=4, H=32).BV == 64
    assert _launch("gfx950", N=4, H=32).BV == 32
    # NVIDIA keeps its measured rule (double-staged where one program per SM fits).
    assert _launch("sm_90", H=4).walk_dict() == {"BV": 32, "num_warps": 4, "num_stages": 2}
    assert _launch("sm_90", N=16, H=32).walk_dict() == {"BV": 64, "num_warps": 4, "num_stages": 1}
    assert _launch("sm_90", H=4).scan_precision == "tf32x3"
    assert _launch("sm_90", H=4, ieee=True).scan_precision == "ieee"
    assert _launch("sm_90", H=4, interpret=True).scan_precision == "ieee"
    # The walk rule behind chunk_config.
    assert walk_tile(lambda bv: 8 * 128 // bv, 128, "cpu", 8) == chunk_config(1, 8, 128, "cpu")


def test_scan_precision_rule():
    assert scan_precision_for(False, "sm_90") == "tf32x3"
    assert scan_precision_for(True, "sm_90") == "ieee"
    for arch in ("gfx942", "gfx950", "cpu"):
        assert scan_precision_for(False, arch) == "ieee"


def test_decode_and_prologue():
    for arch in ("sm_90", "gfx942", "gfx950", "cpu"):
        assert decode_tiling_for(arch, 128) == DecodeTiling(16, 4)
        assert decode_tiling_for(arch, 128, steps=4) == DecodeTiling(16, 2)
    assert decode_tiling_for("cpu", 8).block_v == 8
    with pytest.raises(ValueError, match="block_v"):
        DecodeTiling(24, 4)
    with pytest.raises(ValueError, match="num_warps"):
        DecodeTiling(16, 3)
    for arch in ("sm_90", "gfx942", "gfx950"):
        assert prologue_warps_for(arch, 128, 128) == PrologueWarps(4, 2)
        assert prologue_warps_for(arch, 64, 64) == PrologueWarps(4, 4)
    assert prologue_warps_for("cpu", 128, 128) == PrologueWarps(4, 4)
    with pytest.raises(ValueError, match="num_warps"):
        PrologueWarps(4, 32)


def test_kda_prefill_walk_takes_a_dict_or_the_dataclass():
    H, K, V, T = 1, 32, 32, 130
    gen = torch.Generator().manual_seed(3)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    raw = dict(q=rnd(1, T, H, K), k=rnd(1, T, H, K), v=rnd(1, T, H, V), raw_g=rnd(1, T, H, K),
               raw_beta=rnd(1, T, H), A_log=rnd(H) * 0.5, dt_bias=rnd(H * K))
    cu = torch.tensor([0, T])
    ops = naive_chunk_operands(**raw, cu_seqlens=cu, lower_bound=-5.0)
    args = [ops[n] for n in ("qg", "w", "u", "kg_t", "aqk", "decay")]
    ref, _, _ = naive_chunk_walk(ops, cu_seqlens=cu, scale=0.2)
    for config in ({"BV": 16, "num_warps": 2}, ChunkConfig(BV=32, num_stages=2), None):
        out = torch.empty_like(ops["u"])
        kda_prefill_walk(*args, out, 0.2, cu, None, False, config=config)
        assert (out - ref).abs().max().item() < 2e-4, config
    with pytest.raises(ValueError, match="unknown keys"):
        kda_prefill_walk(*args, torch.empty_like(ops["u"]), 0.2, cu, None, False, config={"BV": 32, "stages": 2})
    with pytest.raises(ValueError, match="BV"):
        ChunkLaunch(K=32, V=32, arch="cpu", interpret=True, BV=64, num_warps=4, num_stages=1, BV_pass1=32,
                    num_warps_pass1=4, num_stages_pass1=1, BV_scan=32, BJ_scan=32, num_warps_scan=8,
                    num_stages_scan=1, scan_precision="ieee")


def test_gate_geometry():
    from kda_engram.engram.gate import launch_geometry, post_wkv_launch
    from kda_engram.launch_config import GateGeometry

    geom = GateGeometry(HEAD=4096, TAIL=1024, CHUNK=16, LOOP=False, num_warps=4)
    assert geom.as_dict() == dict(HEAD=4096, TAIL=1024, CHUNK=16, LOOP=False, num_warps=4)
    assert launch_geometry(5120, None, None, 5120) == GateGeometry(**launch_geometry(5120, None, None, 5120)).as_dict()
    assert set(post_wkv_launch(64, 4, 5120, "cpu")[0]) == {"HEAD", "TAIL", "CHUNK", "LOOP", "num_warps", "KEEP",
                                                           "LAST_USE", "PERSISTENT"}
    for bad, field in ((dict(HEAD=24), "HEAD"), (dict(TAIL=8), "TAIL"), (dict(CHUNK=0), "CHUNK"),
                       (dict(num_warps=64), "num_warps"), (dict(LOOP=True), "LOOP"), (dict(KEEP="evict"), "KEEP"),
                       (dict(PERSISTENT=True, LOOP=True, HEAD=16, TAIL=0), "persistent")):
        with pytest.raises(ValueError, match=field):
            dataclasses.replace(geom, **bad)

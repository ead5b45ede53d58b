"""The platform policies of the specification, exercised on the CPU with a test
double for the device facts (arch, compute units): the
shard-the-Engram-gate policy and the chunk-group heuristic on MI300X (gfx942,
304 CUs) and MI355X (gfx950, 256 CUs), next to the H200 (sm_90, 132 SMs)."""

import sys

import pytest

import kda_engram.platform as platform
from kda_engram.layers.engram_gate import SHARD_GATE_ENV, shards_engram_gate
from kda_engram.kda.groups import MAX_GROUPS, MIN_GROUP_CHUNKS, chunk_groups
from kda_engram.launch_config import arch_facts, chunk_launch

C = 64  # tokens per chunk

DEVICES = {"gfx942": 304, "gfx950": 256, "sm_90": 132}


@pytest.fixture
def device_facts(monkeypatch):
    """``use(arch)``: from then on every module sees a compiled ``arch`` GPU with
    the reference part's compute units (patched in :mod:`kda_engram.platform` and
    wherever a module imported the functions by name)."""
    import kda_engram.kda.groups as groups

    names = ("arch", "num_compute_units", "interpreting", "is_gpu")
    originals = {name: getattr(platform, name) for name in names}
    fakes = set()  # ids of the stand-ins, so a second use() replaces them again

    def use(arch: str):
        cus = DEVICES[arch]
        fake = {"arch": lambda device=None: arch, "num_compute_units": lambda device=None: cus,
                "interpreting": lambda: False,
                "is_gpu": lambda device=None: True}
        fakes.update(id(fn) for fn in fake.values())
        for mod_name, module in list(sys.modules.items()):
            if not mod_name.startswith("kda_engram") or module is None:
                continue
            for name, fn in fake.items():
                current = getattr(module, name, None)
                if module is platform or current is originals[name] or id(current) in fakes:
                    monkeypatch.setattr(module, name, fn)
        groups._chunk_groups_cached.cache_clear()

    yield use
    groups._chunk_groups_cached.cache_clear()


# ----------------------------------------------------------------------------- the double itself


@pytest.mark.parametrize("arch", ["gfx942", "gfx950", "sm_90"])
def test_the_double_reaches_the_platform(device_facts, arch):
    device_facts(arch)
    assert platform.arch("cuda") == arch
    assert platform.num_compute_units("cuda") == arch_facts(arch).compute_units


# ----------------------------------------------------------------------------- shard the Engram gate


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_cdna3_and_cdna4_shard_the_gate(device_facts, monkeypatch, arch):
    # The specification (seeds/000: _shards_engram_gate is get_cdna_version() in (3, 4)).
    monkeypatch.delenv(SHARD_GATE_ENV, raising=False)
    device_facts(arch)
    for tp in (2, 4, 8):
        assert shards_engram_gate(tp, False, "cuda") is True
    # Nothing to exchange with one rank; under sequence parallelism each rank
    # gates its own tokens with the whole kv local.
    assert shards_engram_gate(1, False, "cuda") is False
    assert shards_engram_gate(4, True, "cuda") is False
    # The environment override, both ways; it never turns sharding on for tp 1 or SP.
    monkeypatch.setenv(SHARD_GATE_ENV, "0")
    assert shards_engram_gate(4, False, "cuda") is False
    monkeypatch.setenv(SHARD_GATE_ENV, "on")
    assert shards_engram_gate(1, False, "cuda") is False
    assert shards_engram_gate(4, True, "cuda") is False
    monkeypatch.setenv(SHARD_GATE_ENV, "maybe")
    with pytest.raises(ValueError, match=SHARD_GATE_ENV):
        shards_engram_gate(4, False, "cuda")


def test_nvidia_shards_the_gate_too(device_facts, monkeypatch):
    # Where the package departs from the specification (which shards on CDNA3/4
    # only): on every vendor, from the H200 measurement (layers/engram_gate.py,
    # src/kda_engram/tools/benchmarks/bench_engram_gate.py); KDA_ENGRAM_SHARD_GATE=0 restores the
    # specification's choice on NVIDIA.
    monkeypatch.delenv(SHARD_GATE_ENV, raising=False)
    device_facts("sm_90")
    assert shards_engram_gate(4, False, "cuda") is True
    monkeypatch.setenv(SHARD_GATE_ENV, "0")
    assert shards_engram_gate(4, False, "cuda") is False


# ----------------------------------------------------------------------------- chunk groups

SHAPES = {  # (sequences, length, heads): G picked on gfx942 (304 CUs), gfx950 (256 CUs)
    (1, 32768, 4): (10, 9), (1, 131072, 4): (19, 16), (1, 262144, 2): (32, 32),
    (1, 32768, 8): (9, 8), (1, 16384, 4): (10, 9),
    (1, 32768, 32): (1, 1), (16, 2048, 32): (1, 1), (64, 512, 32): (1, 1), (1, 8192, 96): (1, 1),
    (4, 8192, 8): (1, 1),
}


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_chunk_groups_on_cdna(device_facts, arch):
    device_facts(arch)
    col = 0 if arch == "gfx942" else 1
    picks = {shape: chunk_groups(L // C, N, H, "cuda") for shape, (N, L, H) in ((s, s) for s in SHAPES)}
    assert picks == {shape: want[col] for shape, want in SHAPES.items()}, picks
    # The rules: never G = 2, never groups shorter than the minimum, at most MAX_GROUPS.
    for chunks in range(0, 4096, 97):
        for N, H in ((1, 1), (1, 4), (2, 8), (4, 32)):
            g = chunk_groups(chunks, N, H, "cuda")
            assert g != 2 and 1 <= g <= MAX_GROUPS
            assert g == 1 or chunks // g >= MIN_GROUP_CHUNKS


def test_chunk_groups_follow_the_compute_units(device_facts):
    # More compute units hold more pass-two programs at once: the few-head long
    # sequence splits into at least as many groups on the MI300X as on the MI355X.
    counts = {}
    for arch in ("gfx942", "gfx950"):
        device_facts(arch)
        counts[arch] = [chunk_groups(L // C, 1, H, "cuda") for L, H in ((32768, 4), (131072, 4), (32768, 8))]
    assert all(a >= b for a, b in zip(counts["gfx942"], counts["gfx950"])), counts
    assert counts["gfx942"] != counts["gfx950"], counts


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_chunk_launch_on_cdna(device_facts, arch):
    # The launch the chunk kernel gets on the part, from the same device facts.
    device_facts(arch)
    cus = platform.num_compute_units("cuda")
    launch = chunk_launch(None, num_seqs=1, n_groups=chunk_groups(2048, 1, 4, "cuda"), num_heads=4, head_k=128,
                          head_v=128, ieee_operands=False, arch=platform.arch("cuda"), compute_units=cus,
                          interpret=platform.interpreting())
    assert launch.arch == arch and launch.num_stages == 1 and launch.scan_precision == "ieee"

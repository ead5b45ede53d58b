import numpy as np
import pytest
import torch

from kda_engram.engram.hashing import ngram_hash
from kda_engram.engram.layout import EngramLayout
from kda_engram.engram.reference import (
    naive_dequantize_fp8_ue8m0,
    naive_lookup,
    naive_ngram_hash_padded,
    naive_quantize_fp8_ue8m0,
)
from kda_engram.engram.table import EngramTable, quantize_fp8_ue8m0, shard_columns

from ..helpers import SimulatedGroup, refused

SIZES = [11, 13, 17, 19, 23, 29]
D = 64


def table_weight(seed=0, sizes=SIZES, dim=D):
    gen = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    # Rows spanning six decades, so the fp8 scales take many exponents.
    return torch.randn(n, dim, generator=gen) * torch.logspace(-3, 3, n)[:, None]


def random_rows(T, sizes=SIZES, seed=1):
    gen = torch.Generator().manual_seed(seed)
    starts = np.cumsum([0, *sizes[:-1]])
    rows = torch.stack([torch.randint(0, s, (T,), generator=gen) + int(o) for s, o in zip(sizes, starts)], 1)
    rows[2 % T, 3] = -1
    rows[5 % T, 0] = -7
    return rows


def expected_weight(weight, storage):
    if storage == "fp8":
        return naive_dequantize_fp8_ue8m0(*naive_quantize_fp8_ue8m0(weight))
    return weight.to({"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[storage])


# -- fp8 ---------------------------------------------------------------------------------


def test_quantize_matches_reference_and_bounds_error():
    w = table_weight()
    w[3, :32] = 0  # an all-zero block
    w[4, :32] = 448.0 * 2.0**-5  # amax exactly on a power of two
    q, s = quantize_fp8_ue8m0(w)
    qr, sr = naive_quantize_fp8_ue8m0(w)
    assert q.dtype == s.dtype == torch.uint8 and s.shape == (w.shape[0], D // 32)
    assert torch.equal(q, qr) and torch.equal(s, sr)
    assert s[3, 0] == 127 and s[4, 0] == 127 - 5
    back = naive_dequantize_fp8_ue8m0(q, s)
    amax = w.reshape(-1, 32).abs().amax(-1, keepdim=True)
    err = (back - w).reshape(-1, 32).abs()
    # e4m3 keeps 3 mantissa bits: error <= half an ulp of the block's top binade.
    assert bool((err <= amax * 2.0**-4 + 1e-30).all())
    assert bool((back.reshape(-1, 32).abs().amax(-1, keepdim=True) <= amax * (1 + 2.0**-4)).all())


def every_byte_case():
    """All 254 finite e4m3 byte patterns (256 values = 8 scale blocks), three rows
    of scales from 2^-126 to 2^113."""
    codes = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)
    codes = torch.cat([codes, codes[:2]])
    q = codes.reshape(1, 256).repeat(3, 1)
    s = torch.tensor([[1, 20, 100, 126, 127, 128, 200, 240], [127] * 8, [120, 121, 122, 123, 130, 131, 132, 133]], dtype=torch.uint8)
    return q, s


def test_fp8_decode_every_byte_exactly():
    """The kernel's integer e4m3 decode against PyTorch's, bit for bit."""
    q, s = every_byte_case()
    table = EngramTable([3], 256, storage="fp8", device="cpu", out_dtype=torch.float32)
    assert table.fp8_decode == "integer"  # the CPU (interpreter) always takes the integer rebuild
    table.load_(q, s)
    got = table.lookup(torch.tensor([[0], [1], [2]]))[:, 0]
    assert torch.equal(got, naive_dequantize_fp8_ue8m0(q, s))


def test_load_prequantized_scales_in_every_format():
    w = table_weight()
    q, s = quantize_fp8_ue8m0(w)
    ref = EngramTable.from_weight(w, SIZES, storage="fp8", device="cpu")
    as_float = torch.pow(2.0, s.float() - 127)
    for weight, scale in [(q, s), (q.view(torch.float8_e4m3fn), as_float), (q, s.view(torch.float8_e8m0fnu))]:
        t = EngramTable.from_weight(weight, SIZES, storage="fp8", device="cpu", scale=scale)
        assert torch.equal(t.weight, ref.weight) and torch.equal(t.scale, ref.scale)
    with refused(ValueError, match="powers of two"):
        EngramTable.from_weight(q, SIZES, storage="fp8", device="cpu", scale=as_float * 1.5)
    with refused(ValueError, match="scale"):
        EngramTable.from_weight(q, SIZES, storage="fp8", device="cpu")
    with refused(TypeError, match="fp8"):
        EngramTable.from_weight(q, SIZES, storage="bf16", device="cpu")


# -- lookups -----------------------------------------------------------------------------


def test_fp8_lookup_row_width_not_a_power_of_two():
    """96 values = 3 scale blocks: the kernel pads the block axis to 4 and masks it."""
    w = table_weight(dim=96)
    rows = random_rows(7)
    table = EngramTable.from_weight(w, SIZES, storage="fp8", device="cpu", out_dtype=torch.float32)
    out = torch.full((7, 6, 96), float("nan"))
    got = table.lookup(rows, out=out)
    assert torch.equal(got, naive_lookup(expected_weight(w, "fp8"), rows))


@pytest.mark.parametrize("storage", ["fp32", "fp16", "bf16", "fp8"])
def test_lookup_matches_reference(storage):
    w = table_weight()
    rows = random_rows(9)
    table = EngramTable.from_weight(w, SIZES, storage=storage, device="cpu", out_dtype=torch.float32)
    got = table.lookup(rows)
    assert got.shape == (9, 6, D) and got.dtype == torch.float32
    assert torch.equal(got, naive_lookup(expected_weight(w, storage), rows))
    assert (got[2, 3] == 0).all() and (got[5, 0] == 0).all()
    native = EngramTable.from_weight(w, SIZES, storage=storage, device="cpu").lookup(rows)
    assert native.dtype == (torch.bfloat16 if storage == "fp8" else table.weight.dtype)
    assert torch.equal(native, got.to(native.dtype))


def test_lookup_strided_rows_from_the_hash_and_embeddings():
    layout = EngramLayout.build(layer_ids=[1, 3], max_ngram=3, n_heads=2, head_dim=32, vocab_size=[41, 53], compressed_vocab_size=30, pad_id=1)
    gen = torch.Generator().manual_seed(5)
    x = torch.randint(0, 30, (2, 6), generator=gen)
    hashed = ngram_hash(x.reshape(-1), torch.tensor([0, 6, 12]), layout)  # [12, 2, 4]
    for li, layer_id in enumerate(layout.layer_ids):
        w = torch.randn(layout.num_embeddings[li], 32, generator=gen)
        table = EngramTable.from_weight(w, layout.column_sizes(layer_id), storage="fp32", device="cpu")
        rows = hashed[:, li]  # a strided view, no copy
        assert not rows.is_contiguous()
        emb = table.embeddings(rows)
        # The paper's formulation: embedding(hash + column offset), flattened.
        local = torch.from_numpy(naive_ngram_hash_padded(x, layout, li)).reshape(12, -1)
        expect = torch.nn.functional.embedding(local + torch.from_numpy(layout.column_offsets(layer_id)), w)
        assert emb.shape == (12, 4 * 32)
        assert torch.equal(emb, expect.reshape(12, -1))


@pytest.mark.parametrize("storage", ["bf16", "fp8"])
def test_head_sharding(storage):
    w = table_weight(seed=2)
    rows = random_rows(7, seed=3)
    full = EngramTable.from_weight(w, SIZES, storage=storage, device="cpu").lookup(rows)
    P = 3
    tables = [EngramTable.from_weight(w, SIZES, storage=storage, device="cpu", rank=r, world_size=P) for r in range(P)]
    starts = np.cumsum([0, *SIZES[:-1]])
    for r, t in enumerate(tables):
        assert (t.col_start, t.col_end) == (2 * r, 2 * r + 2) == shard_columns(6, r, P)
        # Only the rows of its own columns are stored.
        assert t.weight.shape[0] == SIZES[2 * r] + SIZES[2 * r + 1]
        assert t.row_lo == starts[2 * r]
    outs = [t.lookup(rows) for t in tables]
    for r, o in enumerate(outs):
        owned = torch.zeros(6, dtype=torch.bool)
        owned[2 * r : 2 * r + 2] = True
        assert torch.equal(o[:, owned], full[:, owned]) and (o[:, ~owned] == 0).all()
    assert torch.equal(sum(o.float() for o in outs).to(full.dtype), full)
    pieces = [t.lookup_local(rows) for t in tables]
    for r, t in enumerate(tables):
        group = SimulatedGroup(r, P, pieces)
        assert torch.equal(t.lookup_gathered(rows, group), full)
        grouped = EngramTable(SIZES, D, storage=storage, device="cpu", group=group).load_(w)
        assert torch.equal(grouped.embeddings(rows), full.reshape(7, -1))


def test_uneven_shards_and_streamed_loading():
    w = table_weight(seed=4)
    rows = random_rows(5, seed=6)
    ref = naive_lookup(w, rows)
    for r in range(4):  # 6 columns over 4 ranks: 1, 2, 1, 2
        t = EngramTable(SIZES, D, storage="fp32", device="cpu", rank=r, world_size=4)
        for a in range(0, w.shape[0], 37):  # a checkpoint streamed in 37-row pieces
            t.load_(w[a : a + 37], row_start=a)
        lo, hi = shard_columns(6, r, 4)
        assert torch.equal(t.lookup_local(rows), ref[:, lo:hi])
        with refused(ValueError, match="evenly"):
            t.lookup_gathered(rows, SimulatedGroup(r, 4, []))


@pytest.mark.parametrize("storage", ["bf16", "fp8"])
@pytest.mark.parametrize("mode", ["staged", "zero_copy"])
def test_host_resident(storage, mode):
    """On the CPU both host paths run: the staged gather + copy, and the kernel
    reading the host table directly (what zero-copy does through UVA on a GPU)."""
    w = table_weight(seed=7)
    rows = random_rows(6, seed=8)
    dev = EngramTable.from_weight(w, SIZES, storage=storage, device="cpu")
    host = EngramTable.from_weight(w, SIZES, storage=storage, device="cpu", host_resident=True, host_mode=mode)
    assert host.host_mode == mode and host.weight.device.type == "cpu"
    assert torch.equal(host.lookup(rows), dev.lookup(rows))
    for r in range(2):
        shard = EngramTable.from_weight(w, SIZES, storage=storage, device="cpu", host_resident=True, host_mode=mode, rank=r, world_size=2)
        assert torch.equal(shard.lookup(rows), EngramTable.from_weight(w, SIZES, storage=storage, device="cpu", rank=r, world_size=2).lookup(rows))
        assert torch.equal(shard.lookup_local(rows), dev.lookup(rows)[:, 3 * r : 3 * r + 3])
    assert EngramTable(SIZES, D, device="cpu", host_resident=True).host_mode == "staged"


def test_out_buffer():
    w = table_weight()
    rows = random_rows(4)
    t = EngramTable.from_weight(w, SIZES, storage="fp8", device="cpu", out_dtype=torch.float16)
    out = torch.full((4, 6, D), 3.0, dtype=torch.float16)
    assert t.lookup(rows, out=out) is out
    assert torch.equal(out, t.lookup(rows))
    with refused(TypeError, match="out"):
        t.lookup(rows, out=torch.empty(4, 6, D))


@pytest.mark.parametrize(
    "rows, exc, match",
    [
        (lambda r: r.float(), TypeError, "rows"),
        (lambda r: r[:, :5], ValueError, "rows"),
        (lambda r: r.reshape(-1), ValueError, "rows"),
        (lambda r: torch.where(torch.arange(6) == 2, r + 17, r), ValueError, "hash column 2"),
        (lambda r: torch.where(torch.arange(6) == 0, torch.full_like(r, 11), r), ValueError, "hash column 0"),
    ],
)
def test_bad_rows(rows, exc, match):
    t = EngramTable.from_weight(table_weight(), SIZES, storage="fp32", device="cpu")
    with refused(exc, match=match):
        t.lookup(rows(random_rows(3)))


def test_bad_construction():
    with refused(ValueError, match="head_dim"):
        EngramTable(SIZES, 48, storage="fp8", device="cpu")
    with refused(ValueError, match="storage"):
        EngramTable(SIZES, D, storage="int8", device="cpu")
    with refused(ValueError, match="world_size"):
        EngramTable(SIZES, D, device="cpu", rank=0, world_size=7)
    with refused(ValueError, match="column_sizes"):
        EngramTable([5, 0], D, device="cpu")
    with refused(ValueError, match="weight"):
        EngramTable(SIZES, D, device="cpu").load_(torch.zeros(3, D + 1))
    with refused(ValueError, match="group"):
        EngramTable(SIZES, D, device="cpu", rank=1, world_size=2).lookup_gathered(random_rows(2))


def test_for_layer():
    layout = EngramLayout.build(layer_ids=[4, 9], max_ngram=3, n_heads=2, head_dim=32, vocab_size=40, compressed_vocab_size=10, pad_id=0)
    t = EngramTable.for_layer(layout, 9, storage="fp8", device="cpu")
    assert t.num_rows == layout.num_embeddings[1] and t.n_cols == 4 and t.head_dim == 32
    assert t.nbytes() == t.num_rows * (32 + 1)


# -- GPU ---------------------------------------------------------------------------------

V41_COLS, V41_DIM = 24, 256


def gpu_table_case(gpu, T=16384, rows_per_col=100_003, seed=0):
    gen = torch.Generator(device=gpu).manual_seed(seed)
    sizes = [rows_per_col + 2 * c for c in range(V41_COLS)]
    w = torch.randn(sum(sizes), V41_DIM, device=gpu, generator=gen, dtype=torch.bfloat16)
    starts = torch.tensor(np.cumsum([0, *sizes[:-1]]), device=gpu)
    rows = torch.randint(0, 2**31 - 1, (T, V41_COLS), device=gpu, generator=gen) % torch.tensor(sizes, device=gpu) + starts
    rows[::97, 5] = -1
    return sizes, w, rows.to(torch.int32)


@pytest.mark.gpu
@pytest.mark.gpu_mem(8)  # a 1.2 GiB table; the fp8 case peaked at 6.9 GiB on an H100 (its float reference)
@pytest.mark.parametrize("storage", ["bf16", "fp8"])
def test_gpu_lookup_prefill(gpu, storage):
    sizes, w, rows = gpu_table_case(gpu)
    t = EngramTable.from_weight(w, sizes, storage=storage, device=gpu)
    got = t.lookup(rows)
    torch.cuda.synchronize()
    if storage == "bf16":
        expect = torch.where((rows >= 0)[..., None], w[rows.clamp(min=0).long()], torch.zeros((), dtype=w.dtype, device=gpu))
        assert torch.equal(got, expect)
    else:
        T = rows.shape[0]
        idx = rows.clamp(min=0).long()
        dq = naive_dequantize_fp8_ue8m0(t.weight[idx].reshape(-1, V41_DIM).cpu(), t.scale[idx].reshape(-1, V41_DIM // 32).cpu())
        expect = torch.where((rows >= 0).cpu()[..., None], dq.reshape(T, V41_COLS, V41_DIM), 0.0).to(torch.bfloat16)
        assert torch.equal(got.cpu(), expect)
        # and against the bf16 source: fp8 keeps about 2 significant digits
        err = (got.float() - torch.where((rows >= 0)[..., None], w[rows.clamp(min=0).long()].float(), 0.0)).abs()
        assert float(err.max()) <= 0.07 * float(w.float().abs().max())


@pytest.mark.gpu
@pytest.mark.parametrize("storage", ["bf16", "fp8"])
def test_gpu_head_sharding(gpu, storage):
    sizes, w, rows = gpu_table_case(gpu, T=2048, rows_per_col=5003)
    full = EngramTable.from_weight(w, sizes, storage=storage, device=gpu).lookup(rows)
    P = 8
    pieces = [EngramTable.from_weight(w, sizes, storage=storage, device=gpu, rank=r, world_size=P).lookup_local(rows) for r in range(P)]
    assert torch.equal(torch.cat(pieces, 1), full)


@pytest.mark.gpu
@pytest.mark.parametrize("storage", ["bf16", "fp8"])
@pytest.mark.parametrize("mode", ["zero_copy", "staged"])
def test_gpu_host_resident(gpu, storage, mode):
    sizes, w, rows = gpu_table_case(gpu, T=4096, rows_per_col=20011)
    dev = EngramTable.from_weight(w, sizes, storage=storage, device=gpu)
    host = EngramTable.from_weight(w, sizes, storage=storage, device=gpu, host_resident=True, host_mode=mode)
    assert host.weight.device.type == "cpu" and host.weight.is_pinned()
    assert torch.equal(host.lookup(rows), dev.lookup(rows))
    if mode == "zero_copy":
        # Zero-copy needs no host sync: it records into a CUDA graph.
        out = torch.empty(4096, V41_COLS, V41_DIM, dtype=torch.bfloat16, device=gpu)
        host.lookup(rows, out=out, check_inputs=False)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            host.lookup(rows, out=out, check_inputs=False)
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, dev.lookup(rows))
    assert EngramTable(sizes[:2], V41_DIM, device=gpu, host_resident=True).host_mode == "zero_copy"


@pytest.mark.gpu
def test_gpu_fp8_decode_paths_every_byte(gpu):
    """On the GPU both decodes (the conversion instruction where the device has
    it, and the integer rebuild) equal PyTorch's dequantisation bit for bit."""
    q, s = every_byte_case()
    expect = naive_dequantize_fp8_ue8m0(q, s)
    table = EngramTable([3], 256, storage="fp8", device=gpu, out_dtype=torch.float32)
    table.load_(q.to(gpu), s.to(gpu))
    rows = torch.tensor([[0], [1], [2]], device=gpu)
    native = torch.cuda.get_device_capability(gpu) >= (8, 9) and torch.version.hip is None
    assert table.fp8_decode == ("native" if native else "integer")
    for decode in (table.fp8_decode, "integer"):
        table.fp8_decode = decode
        assert torch.equal(table.lookup(rows)[:, 0].cpu(), expect), decode


@pytest.mark.gpu
def test_gpu_lookup_graph_capture_and_decode(gpu):
    sizes, w, rows = gpu_table_case(gpu, T=64, rows_per_col=1009)
    t = EngramTable.from_weight(w, sizes, storage="fp8", device=gpu)
    out = torch.empty(64, V41_COLS, V41_DIM, dtype=torch.bfloat16, device=gpu)
    expect = t.lookup(rows)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        t.lookup(rows, out=out, check_inputs=False)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expect)

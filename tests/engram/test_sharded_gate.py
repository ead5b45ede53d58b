"""The dim-sharded gate (partials + finish), P ranks simulated in one process.

The all-gather is replaced by ``torch.cat`` of the per-rank send buffers (rank
major), which is what TensorParallelGroup.all_gather returns; the real multi-process
runs are in tests/layers/test_engram_gate.py.
"""

import pytest
import torch

from kda_engram import ops

from kda_engram.engram.gate import engram_post_wkv
from kda_engram.engram.reference import naive_engram_gate_sharded, naive_engram_post_wkv, shard_kv_by_dim
from kda_engram.engram.sharded_gate import engram_gate_finish, engram_gate_partials, pair_elems, send_width

EPS = 1e-6


def make_inputs(T, hc, dim, *, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, hc, dim, generator=gen).to(dtype).to(device)
    kv = torch.randn(T, (hc + 1) * dim, generator=gen).to(dtype).to(device)
    q = (1 + 0.5 * torch.randn(hc, dim, generator=gen)).to(device)
    k = (1 + 0.5 * torch.randn(hc, dim, generator=gen)).to(device)
    return hidden, kv, q, k


def sharded(hidden, kv, q, k, P, *, token_mask=None, chunk=None, tokens=None):
    hc = hidden.shape[1]
    sends = [
        engram_gate_partials(hidden, local, q, k, rank=r, tp_size=P, tokens=tokens)
        for r, local in enumerate(shard_kv_by_dim(kv, hc, P))
    ]
    gathered = torch.cat(sends, dim=0)
    return engram_gate_finish(hidden, gathered, tp_size=P, eps=EPS, token_mask=token_mask, chunk=chunk), gathered


def ref64(hidden, kv, q, k, **kw):
    return naive_engram_post_wkv(hidden.double(), kv.double(), q.double(), k.double(), eps=EPS, **kw)


def test_pair_packing_follows_the_element_size():
    assert pair_elems(torch.bfloat16) == 4 and pair_elems(torch.float16) == 4 and pair_elems(torch.float32) == 2
    assert send_width(5120, 4, 8, torch.bfloat16) == 640 + 16
    assert send_width(96, 2, 4, torch.float32) == 24 + 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_send_row_holds_the_value_slice_and_the_pairs(dtype):
    T, hc, dim, P = 3, 2, 96, 2
    hidden, kv, q, k = make_inputs(T, hc, dim, dtype=dtype, seed=1)
    width = dim // P
    for rank, local in enumerate(shard_kv_by_dim(kv, hc, P)):
        send = engram_gate_partials(hidden, local, q, k, rank=rank, tp_size=P)
        assert send.dtype == dtype and send.shape == (T, width + pair_elems(dtype) * hc)
        assert torch.equal(send[:, :width], local[:, hc * width :])  # value slice, bit for bit
        pairs = send[:, width:].contiguous().view(torch.float32).reshape(T, hc, 2).double()
        cols = slice(rank * width, (rank + 1) * width)
        keys = local[:, : hc * width].reshape(T, hc, width).double()
        key_sq = (keys * keys).sum(-1)
        dot = (hidden[..., cols].double() * (q * k)[None, :, cols].double() * keys).sum(-1)
        torch.testing.assert_close(pairs[..., 0], key_sq, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pairs[..., 1], dot, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "dim, hc, P",
    [(96, 4, 1), (96, 4, 2), (96, 2, 4), (96, 1, 8), (258, 2, 2), (2560, 4, 4), (5120, 2, 8)],
)
def test_matches_reference_fp32(dim, hc, P):
    T = 2 if dim >= 2560 else 5
    hidden, kv, q, k = make_inputs(T, hc, dim, seed=dim + P)
    mask = torch.rand(T, generator=torch.Generator().manual_seed(P)) > 0.3
    mask[0] = True
    out, _ = sharded(hidden, kv, q, k, P, token_mask=mask)
    torch.testing.assert_close(out.double(), ref64(hidden, kv, q, k, token_mask=mask), rtol=2e-5, atol=2e-5)
    want = naive_engram_gate_sharded(hidden, kv, q, k, tp_size=P, eps=EPS, token_mask=mask)
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)
    assert torch.equal(out[~mask], hidden[~mask])


@pytest.mark.parametrize("dim, P", [(96, 4), (256, 2)])
def test_fp16_matches_the_single_rank_kernel(dim, P):
    T, hc = 4, 4
    hidden, kv, q, k = make_inputs(T, hc, dim, dtype=torch.float16, seed=P)
    out, _ = sharded(hidden, kv, q, k, P)
    torch.testing.assert_close(out.double(), ref64(hidden, kv, q, k), rtol=2e-3, atol=2e-3)
    single = engram_post_wkv(hidden, kv, q, k, eps=EPS)
    torch.testing.assert_close(out, single, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("max_chunk, tokens", [(2048, 3), (16, 2), (64, 8)])
def test_token_blocked_partials(monkeypatch, max_chunk, tokens):
    # max_chunk 16 < width 24: two blocks per row; 2048: one. 3 tokens round up to a
    # tile of 4 and 8 pass T = 7: the tile's rows past T are masked.
    import kda_engram.engram.sharded_gate as sharded_gate

    monkeypatch.setattr(sharded_gate, "PARTIALS_MAX_CHUNK", max_chunk)
    T, hc, dim, P = 7, 2, 96, 4
    hidden, kv, q, k = make_inputs(T, hc, dim, seed=tokens)
    out, gathered = sharded(hidden, kv, q, k, P, tokens=tokens)
    torch.testing.assert_close(out.double(), ref64(hidden, kv, q, k), rtol=2e-5, atol=2e-5)
    # the blocked partials wrote exactly T rows of each send: compare with one token per program
    _, plain = sharded(hidden, kv, q, k, P, tokens=1)
    torch.testing.assert_close(gathered, plain, rtol=1e-6, atol=1e-6)


def test_partials_launch_overrides_write_the_same_rows():
    # A 16-wide block (three per 48-column slice) on one warp, and 4-token tiles of
    # T = 5 (the second tile has one live row), against the default launch.
    T, hc, dim, P = 5, 2, 96, 2
    hidden, kv, q, k = make_inputs(T, hc, dim, seed=11)
    local = shard_kv_by_dim(kv, hc, P)[1]
    want = engram_gate_partials(hidden, local, q, k, rank=1, tp_size=P)
    got = engram_gate_partials(hidden, local, q, k, rank=1, tp_size=P, chunk=16, num_warps=1, tokens=4)
    width = dim // P
    assert torch.equal(got[:, :width], want[:, :width])
    torch.testing.assert_close(got[:, width:].contiguous().view(torch.float32),
                               want[:, width:].contiguous().view(torch.float32), rtol=1e-6, atol=1e-6)


def test_two_pass_finish_matches():
    T, hc, dim, P = 3, 2, 264, 4
    hidden, kv, q, k = make_inputs(T, hc, dim, seed=5)
    out, _ = sharded(hidden, kv, q, k, P, chunk=64)
    torch.testing.assert_close(out.double(), ref64(hidden, kv, q, k), rtol=2e-5, atol=2e-5)


def test_finish_is_deterministic_and_sums_in_rank_order():
    T, hc, dim, P = 3, 2, 96, 4
    hidden, kv, q, k = make_inputs(T, hc, dim, seed=6)
    out, gathered = sharded(hidden, kv, q, k, P)
    again = engram_gate_finish(hidden, gathered.clone(), tp_size=P, eps=EPS)
    assert torch.equal(out, again)
    # Perturbing one rank's partials only (key_sq of rank 2, token 1, stream 0)
    # changes exactly that (token, stream).
    width = dim // P  # fp32 rows: the pairs start right after the value slice
    bumped = gathered.clone()
    bumped.view(torch.float32)[2 * T + 1, width + 2 * 0] *= 4.0
    changed = engram_gate_finish(hidden, bumped, tp_size=P, eps=EPS)
    diff = (changed != out).any(-1)
    assert diff[1, 0] and diff.sum() == 1


def test_strided_hidden_and_kv_slice():
    T, hc, dim, P = 4, 2, 96, 2
    gen = torch.Generator().manual_seed(8)
    hidden = torch.randn(hc, T, dim, generator=gen).transpose(0, 1)
    kv = torch.randn(T, (hc + 1) * dim, generator=gen)
    q, k = torch.randn(hc, dim, generator=gen), torch.randn(hc, dim, generator=gen)
    width = dim // P
    sends = []
    for rank, local in enumerate(shard_kv_by_dim(kv, hc, P)):
        wide = torch.zeros(T, 3 + local.shape[1])
        wide[:, 3:] = local
        sends.append(engram_gate_partials(hidden, wide[:, 3:], q, k, rank=rank, tp_size=P))
    out = torch.full((T, hc, dim + 1), float("nan"))[:, :, 1:]
    engram_gate_finish(hidden, torch.cat(sends), tp_size=P, eps=EPS, out=out)
    torch.testing.assert_close(out.double(), ref64(hidden, kv, q, k), rtol=2e-5, atol=2e-5)
    assert width * P == dim


def test_empty_batch():
    hidden, kv, q, k = make_inputs(0, 2, 96)
    send = engram_gate_partials(hidden, kv[:, : 3 * 48], q, k, rank=1, tp_size=2)
    assert send.shape == (0, 48 + 2 * 2)  # fp32: one pair = 2 elements
    out = engram_gate_finish(hidden, torch.cat([send, send]), tp_size=2, eps=EPS)
    assert out.shape == (0, 2, 96)


def test_bad_input_raises_clear_errors():
    T, hc, dim = 4, 2, 96
    hidden, kv, q, k = make_inputs(T, hc, dim)
    local = shard_kv_by_dim(kv, hc, 2)[0]
    with pytest.raises(ValueError, match="dim 96 is not divisible by tp_size 5"):
        engram_gate_partials(hidden, local, q, k, rank=0, tp_size=5)
    h16, kv16 = make_inputs(T, hc, 90, dtype=torch.float16)[:2]  # width 45: odd for fp16
    with pytest.raises(ValueError, match="slice width dim/tp_size = 45"):
        engram_gate_partials(h16, shard_kv_by_dim(kv16, hc, 2)[0], q[:, :90], k[:, :90], rank=0, tp_size=2)
    with pytest.raises(ValueError, match=r"rank: expected an int in \[0, 2\)"):
        engram_gate_partials(hidden, local, q, k, rank=2, tp_size=2)
    with pytest.raises(TypeError, match="rank: expected an int, got bool"):  # issue 36: True is not rank 1
        engram_gate_partials(hidden, local, q, k, rank=True, tp_size=2)
    with pytest.raises(TypeError, match="rank: expected an int, got bool"):
        ops.engram_gate_partials(hidden, local, q, k, rank=True, tp_size=2)
    with pytest.raises(ValueError, match=r"kv_local: expected shape \[4, 144\]"):
        engram_gate_partials(hidden, kv, q, k, rank=0, tp_size=2)
    with pytest.raises(TypeError, match="hidden_states, kv_local: expected one dtype"):
        engram_gate_partials(hidden, local.half(), q, k, rank=0, tp_size=2)
    with pytest.raises(ValueError, match="kv_local: expected a tensor on cpu"):
        engram_gate_partials(hidden, local.to("meta"), q, k, rank=0, tp_size=2)
    with pytest.raises(ValueError, match=r"q_weight: expected shape \[2, 96\]"):
        engram_gate_partials(hidden, local, q[:, :48], k, rank=0, tp_size=2)
    with pytest.raises(ValueError, match=r"hidden_states: expected shape \[\*, \*, \*\]"):
        engram_gate_partials(hidden[0], local, q, k, rank=0, tp_size=2)
    with pytest.raises(ValueError, match="chunk: expected a power of two >= 16, got 24"):
        engram_gate_partials(hidden, local, q, k, rank=0, tp_size=2, chunk=24)
    with pytest.raises(ValueError, match="num_warps: expected a power of two in"):
        engram_gate_partials(hidden, local, q, k, rank=0, tp_size=2, num_warps=3)
    _, gathered = sharded(hidden, kv, q, k, 2)
    with pytest.raises(ValueError, match=r"gathered: expected shape .* = \[8, 52\], got \[4, 52\]"):
        engram_gate_finish(hidden, gathered[:4], tp_size=2, eps=EPS)
    with pytest.raises(ValueError, match=r"gathered: expected shape .* = \[16, 28\]"):
        engram_gate_finish(hidden, gathered, tp_size=4, eps=EPS)
    with pytest.raises(TypeError, match="hidden_states, gathered: expected one dtype"):
        engram_gate_finish(hidden, gathered.half(), tp_size=2, eps=EPS)
    with pytest.raises(ValueError, match=r"token_mask: expected shape \[4\]"):
        engram_gate_finish(hidden, gathered, tp_size=2, eps=EPS, token_mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="last dim must have stride 1"):
        engram_gate_finish(hidden, gathered.t().contiguous().t(), tp_size=2, eps=EPS)
    with pytest.raises(ValueError, match=r"out: expected shape \[4, 52\]"):
        engram_gate_partials(hidden, local, q, k, rank=0, tp_size=2, out=torch.empty(4, 51))


# --------------------------------------------------------------------------------------
# GPU: bf16 at real shapes
# --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dim, hc, P", [(5120, 4, 2), (5120, 4, 4), (5120, 4, 8), (2560, 2, 4), (96, 1, 2),
                                       pytest.param(12288, 4, 8, marks=pytest.mark.gpu_mem(4))])
def test_gpu_bf16_matches_reference(gpu, dim, hc, P):
    T = 1000
    hidden, kv, q, k = make_inputs(T, hc, dim, dtype=torch.bfloat16, device=gpu, seed=dim + P)
    mask = torch.rand(T, device=gpu) > 0.1
    out, _ = sharded(hidden, kv, q, k, P, token_mask=mask)
    torch.testing.assert_close(out.double(), ref64(hidden, kv, q, k, token_mask=mask), rtol=8e-3, atol=1e-2)
    blocked, _ = sharded(hidden, kv, q, k, P, token_mask=mask, tokens=3)
    torch.testing.assert_close(blocked.float(), out.float(), rtol=8e-3, atol=1e-2)
    single = engram_post_wkv(hidden, kv, q, k, eps=EPS, token_mask=mask)
    # The same function; only fp32 summation order differs, so at most a bf16 ulp apart.
    torch.testing.assert_close(out.float(), single.float(), rtol=8e-3, atol=1e-2)
    assert torch.equal(out[~mask], hidden[~mask])


@pytest.mark.gpu
@pytest.mark.parametrize("dim, P", [(5120, 4), (258, 2)])
def test_gpu_fp32_kv(gpu, dim, P):
    T, hc = 333, 4
    hidden, kv, q, k = make_inputs(T, hc, dim, device=gpu, seed=P)
    out, _ = sharded(hidden, kv, q, k, P)
    torch.testing.assert_close(out.double(), ref64(hidden, kv, q, k), rtol=2e-5, atol=2e-5)

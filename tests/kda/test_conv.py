"""The short conv of KDA (kda/conv.py): the prefill launch, the decode step and the
conv-window checkpoint against plain-PyTorch references; a prefill that continues
with decode steps equals one longer prefill."""

import pytest
import torch

from kda_engram.kda.conv import (
    conv_prefill_bands,
    kda_conv_checkpoint,
    kda_conv_decode,
)
from kda_engram.kda.metadata import prepare_chunk_indices
from kda_engram.kda.reference import naive_conv_checkpoint, naive_conv_decode

from ..helpers import refused


def gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("x_dtype, state_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                                  (torch.float32, torch.float16)])
def test_decode_step_matches_reference(x_dtype, state_dtype):
    B, C = 4, 300  # C not a multiple of the 256-channel block
    wide = torch.randn(B + 1, C + 9, generator=gen(0)).to(x_dtype)
    x = wide[1:, 5 : 5 + C]  # a strided band view, read in place
    w = torch.randn(C, 4, generator=gen(1))
    state = torch.randn(7, C, 3, generator=gen(2)).to(state_dtype)
    idx = torch.tensor([6, -1, 0, 3])
    want_out, want_state = naive_conv_decode(x, w, state, idx)
    before = state.clone()
    out = kda_conv_decode(x, w, state, idx, out_dtype=torch.float32)
    tol = 1e-5 if x_dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.double(), want_out, rtol=tol, atol=tol)
    torch.testing.assert_close(state, want_state, rtol=0, atol=0)
    for r in (1, 2, 4, 5):
        assert torch.equal(state[r], before[r])
    # default output dtype is x's; an explicit strided out is honoured
    assert kda_conv_decode(x, w, before.clone(), idx).dtype == x_dtype
    buf = torch.zeros(B, 2 * C)
    kda_conv_decode(x, w, before.clone(), idx, out=buf[:, ::2])
    torch.testing.assert_close(buf[:, ::2].double(), want_out, rtol=tol, atol=tol)
    assert (buf[:, 1::2] == 0).all()


def prefill_reference(x, cu, w, state, idx, has_init):
    """Depthwise causal conv + SiLU per sequence (fp64): ``(out [T, C], new state)``.
    Each sequence starts from its state row when flagged (zeros otherwise); its
    row then holds the last W - 1 inputs of [old window | sequence]."""
    C, W = w.shape
    out = torch.zeros(x.shape[0], C, dtype=torch.float64)
    new_state = state.clone()
    for n in range(len(cu) - 1):
        a, b = int(cu[n]), int(cu[n + 1])
        row = int(idx[n])
        if b == a:  # no token: no output, the row is not touched
            continue
        window = state[row].double() if (row >= 0 and bool(has_init[n])) else torch.zeros(C, W - 1, dtype=torch.float64)
        xs = torch.cat([window, x[a:b].double().t()], 1)  # [C, W - 1 + len]
        y = torch.nn.functional.conv1d(xs[None], w.double()[:, None, :], groups=C)[0]
        out[a:b] = torch.nn.functional.silu(y).t()
        if row >= 0:
            new_state[row] = xs[:, -(W - 1):].to(state.dtype)
    return out, new_state


PREFILL_LAUNCHES = [
    {},  # the defaults
    dict(row_block=16, num_warps=8),
    dict(row_block=64, num_warps=4),  # one block per chunk
    dict(row_block=4, num_warps=2),  # the taps before bos fill the first block (W = 4)
]


@pytest.mark.parametrize("launch", PREFILL_LAUNCHES, ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()) or "default")
@pytest.mark.parametrize("W", [2, 3, 4])
def test_prefill_conv_matches_reference(W, launch):
    # Lengths around the window (1, 2, 3), a zero-length sequence (its row untouched),
    # one past a chunk (70), a negative row and a sequence that starts from zeros.
    H, K, V = 2, 16, 32
    lens = [1, 70, 0, 2, 3, 40]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    T, C = int(cu[-1]), H * (2 * K + V)
    proj = torch.randn(T, C + 7, generator=gen(7))  # the bands are strided views of a wider projection
    q = proj[:, :H * K].view(1, T, H, K)
    k = proj[:, H * K:2 * H * K].view(1, T, H, K)
    v = proj[:, 2 * H * K:C].view(1, T, H, V)
    w = torch.randn(C, W, generator=gen(8))
    state = torch.randn(8, C, W - 1, generator=gen(9))
    idx = torch.tensor([3, 0, 5, -1, 7, 1])
    has_init = torch.tensor([True, True, True, True, True, False])
    want_out, want_state = prefill_reference(proj[:, :C], cu, w, state, idx, has_init)
    before = state.clone()
    ci = prepare_chunk_indices(cu, total_tokens=T)
    qc, kc, vc = conv_prefill_bands(q, k, v, w, cu, ci, state, idx, has_init, **launch)
    got = torch.cat([qc.reshape(T, H * K), kc.reshape(T, H * K), vc.reshape(T, H * V)], 1)
    torch.testing.assert_close(got.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, want_state, rtol=0, atol=0)
    for r in (2, 4, 5, 6):  # no sequence's row, the zero-length one's, the negative one's
        assert torch.equal(state[r], before[r])
    # Without a conv state every sequence starts from zeros.
    qc, kc, vc = conv_prefill_bands(q, k, v, w, cu, ci, **launch)
    want_out, _ = prefill_reference(proj[:, :C], cu, w, before.clone(), idx, torch.zeros(6, dtype=torch.bool))
    got = torch.cat([qc.reshape(T, H * K), kc.reshape(T, H * K), vc.reshape(T, H * V)], 1)
    torch.testing.assert_close(got.double(), want_out, rtol=1e-5, atol=1e-5)


CONV_TUNING = ([(W, dict(row_block=rb)) for W in (2, 4) for rb in (1, 2, 4, 8, 16, 32, 64) if rb >= W - 1]
               + [(4, dict(num_warps=w)) for w in (1, 2, 4, 8, 16, 32)])


@pytest.mark.parametrize("W, launch", CONV_TUNING, ids=[f"W{W}-{k}={v}" for W, d in CONV_TUNING for k, v in d.items()])
def test_every_accepted_tuning_value_matches_the_reference(W, launch):
    # Issue 54: every accepted row_block (a power of two dividing 64, >= W - 1) and
    # num_warps (a power of two in [1, 32]) gives the reference's outputs and rows.
    H, K, V = 1, 16, 16
    cu = torch.tensor([0, 3, 73])
    T, C = 73, H * (2 * K + V)
    proj = torch.randn(T, C, generator=gen(11))
    q, k, v = proj[:, :K].view(1, T, H, K), proj[:, K:2 * K].view(1, T, H, K), proj[:, 2 * K:].view(1, T, H, V)
    w = torch.randn(C, W, generator=gen(12))
    state = torch.randn(3, C, W - 1, generator=gen(13))
    idx, has_init = torch.tensor([2, 0]), torch.tensor([True, True])
    want_out, want_state = prefill_reference(proj, cu, w, state, idx, has_init)
    ci = prepare_chunk_indices(cu, total_tokens=T)
    qc, kc, vc = conv_prefill_bands(q, k, v, w, cu, ci, state, idx, has_init, **launch)
    got = torch.cat([qc.reshape(T, K), kc.reshape(T, K), vc.reshape(T, V)], 1)
    torch.testing.assert_close(got.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, want_state, rtol=0, atol=0)


def test_prefill_conv_rejects_bad_launch_geometry():
    T, H, K = 8, 1, 16
    x = torch.randn(1, T, H, K)
    cu = torch.tensor([0, T])
    ci = prepare_chunk_indices(cu, total_tokens=T)
    w = torch.randn(3 * H * K, 4)
    for bad in (2, 24, 128):  # below W - 1 = 3, not a power of two, past the 64-row chunk
        with refused(ValueError, match="row_block"):
            conv_prefill_bands(x, x, x, w, cu, ci, row_block=bad)
    for bad in (8.0, True):  # issue 54: a float failed in `&`, True passed for 1
        with refused(ValueError, match=rf"^row_block: expected a power of two dividing 64 .* got {bad!r}$"):
            conv_prefill_bands(x, x, x, w, cu, ci, row_block=bad)
    for bad in (0, 3, 64, -2, 4.0, True):  # issue 54: accepted before, then passed to Triton
        with refused(ValueError, match=rf"^num_warps: expected a power of two in \[1, 32\] or None, got {bad!r}$"):
            conv_prefill_bands(x, x, x, w, cu, ci, num_warps=bad)
    # In-chunk offsets are 32-bit: a token stride past 2**31 / 68 is refused, not wrapped.
    huge = torch.empty_strided((1, T, H, K), (0, 2**31 // 60, K, 1), device="meta")  # no storage needed
    with refused(ValueError, match="k: token stride"):
        conv_prefill_bands(x, huge, x, w, cu, ci)


def test_decode_steps_continue_a_prefill_conv():
    """conv1d over a whole sequence equals: window of the first L tokens, then steps."""
    C, L, S = 24, 9, 5
    seq = torch.randn(L + S, C, generator=gen(3))
    w = torch.randn(C, 4, generator=gen(4))
    full = torch.nn.functional.conv1d(torch.cat([torch.zeros(C, 3), seq.t()], 1)[None], w[:, None, :], groups=C)
    full = torch.nn.functional.silu(full[0]).t()  # [L + S, C]
    state = torch.zeros(1, C, 3)
    state[0] = seq[L - 3 : L].t()
    for t in range(L, L + S):
        out = kda_conv_decode(seq[t : t + 1], w, state, torch.tensor([0]))
        torch.testing.assert_close(out[0], full[t], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[0], seq[-3:].t(), rtol=0, atol=0)


def test_checkpoint_matches_reference():
    C = 40
    x = torch.randn(300, C + 4, generator=gen(5))[:, 2 : 2 + C]
    cu = torch.tensor([0, 70, 70, 200, 300])
    offs = torch.tensor([64, 0, 128, 64])
    rows = torch.tensor([5, 2, -1, 0])
    state = torch.randn(6, C, 3, generator=gen(6))
    want = naive_conv_checkpoint(x, cu, offs, rows, state)
    kda_conv_checkpoint(x, cu, offs, rows, state)
    torch.testing.assert_close(state, want, rtol=0, atol=0)
    torch.testing.assert_close(state[5], x[61:64].t(), rtol=0, atol=0)
    torch.testing.assert_close(state[0], x[261:264].t(), rtol=0, atol=0)


def test_bad_input():
    x, w, s = torch.randn(2, 8), torch.randn(8, 4), torch.zeros(3, 8, 3)
    with refused(ValueError, match="conv_weight: expected shape"):
        kda_conv_decode(x, torch.randn(9, 4), s, torch.tensor([0, 1]))
    with refused(ValueError, match="conv_state: expected shape"):
        kda_conv_decode(x, w, torch.zeros(3, 8, 4), torch.tensor([0, 1]))
    with refused(ValueError, match="conv_state_indices: expected shape"):
        kda_conv_decode(x, w, s, torch.tensor([0]))
    with refused(ValueError, match="distinct"):
        kda_conv_decode(x, w, s, torch.tensor([1, 1]))
    with refused(ValueError, match="entries must be < 3"):
        kda_conv_decode(x, w, s, torch.tensor([0, 3]))
    with refused(TypeError, match="x: expected dtype"):
        kda_conv_decode(x.double(), w, s, torch.tensor([0, 1]))
    with refused(TypeError, match="out_dtype: expected None or one of"):
        kda_conv_decode(x, w, s, torch.tensor([0, 1]), out_dtype=torch.int64)
    xt, cu = torch.randn(10, 8), torch.tensor([0, 10])
    with refused(ValueError, match="checkpoint_offsets"):
        kda_conv_checkpoint(xt, cu, torch.tensor([11]), torch.tensor([0]), s)
    with refused(ValueError, match="checkpoint_offsets"):
        kda_conv_checkpoint(xt, cu, torch.tensor([2]), torch.tensor([0]), s)
    with refused(ValueError, match="checkpoint_indices"):
        kda_conv_checkpoint(xt, cu, torch.tensor([5]), torch.tensor([3]), s)


@pytest.mark.gpu
def test_gpu_bf16_decode_and_checkpoint(gpu):
    B, C = 64, 2 * 16 * 128 + 16 * 128
    x = torch.randn(B, C + 64, device=gpu).to(torch.bfloat16)[:, :C]
    w = torch.randn(C, 4, device=gpu).to(torch.bfloat16)
    state = torch.randn(80, C, 3, device=gpu).to(torch.bfloat16)
    idx = torch.randperm(80, device=gpu)[:B]
    idx[5] = -1
    want_out, want_state = naive_conv_decode(x.cpu(), w.cpu(), state.cpu(), idx.cpu())
    out = kda_conv_decode(x, w, state, idx, out_dtype=torch.float32)
    torch.testing.assert_close(out.double().cpu(), want_out, rtol=1e-4, atol=1e-4)
    assert torch.equal(state.cpu(), want_state)
    xt = torch.randn(1000, C, device=gpu).to(torch.bfloat16)
    cu = torch.tensor([0, 300, 1000], device=gpu)
    offs, rows = torch.tensor([256, 640], device=gpu), torch.tensor([3, 7], device=gpu)
    want = naive_conv_checkpoint(xt.cpu(), cu.cpu(), offs.cpu(), rows.cpu(), state.cpu())
    kda_conv_checkpoint(xt, cu, offs, rows, state, check_inputs=False)
    assert torch.equal(state.cpu(), want)

"""kda_engram.integrations.vllm: the vLLM call shapes against the fp64 recurrence
(CPU, fp32 under the interpreter)."""

import pytest
import torch
import torch.nn.functional as F

from kda_engram.integrations.vllm import chunk_kda_with_fused_gate, fused_kda_gate, fused_recurrent_kda
from kda_engram.kda.reference import kda_gate, naive_recurrent_kda

H, K = 2, 32


def rnd(*s, seed=0):
    return torch.randn(*s, generator=torch.Generator().manual_seed(seed))


def close(a, b, atol=3e-4):
    assert a.shape == b.shape, (a.shape, b.shape)
    assert (a.double() - b.double()).abs().max().item() < atol


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_chunk_kda_with_fused_gate(lower_bound):
    lengths = [3, 64, 20]
    T = sum(lengths)
    cu = torch.tensor([0, *lengths]).cumsum(0)
    q, k, v, g = (rnd(1, T, H, K, seed=i) for i in range(4))
    raw_beta, A_log, g_bias = rnd(1, T, H, seed=5), rnd(H, seed=6) * 0.5, rnd(H * K, seed=7)
    h0 = rnd(3, H, K, K, seed=8)
    o, final = chunk_kda_with_fused_gate(q, k, v, g, raw_beta, A_log, g_bias, None, h0, True, lower_bound, True, cu)
    o_ref, f_ref, _ = naive_recurrent_kda(q.double(), k.double(), v.double(), g.double(), raw_beta.double(), A_log,
                                          g_bias, lower_bound=lower_bound, cu_seqlens=cu, initial_state=h0.double(),
                                          output_final_state=True)
    close(o, o_ref)
    close(final, f_ref)


@pytest.mark.parametrize("layout", ["decode_varlen", "spec_varlen", "spec_batched", "no_indices"])
def test_fused_recurrent_kda_on_the_pool(layout):
    N, S = 3, (1 if layout == "decode_varlen" else 3)
    q, k, v = (rnd(N, S, H, K, seed=i) for i in range(3))
    g = F.logsigmoid(rnd(N, S, H, K, seed=3))
    beta = rnd(N, S, H, seed=4).sigmoid()
    slots = 16
    pool = rnd(slots, H, K, K, seed=5)
    original = pool.clone()
    accepted = torch.tensor([1, 3, 2])
    if layout == "no_indices":
        ssm, start = None, torch.arange(N)
    elif layout == "decode_varlen":
        ssm, start = torch.tensor([7, 2, -1]), torch.tensor([7, 2, -1])
    else:
        ssm = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]])
        start = ssm.gather(1, (accepted - 1)[:, None])[:, 0]
    kw = dict(scale=None, initial_state=pool, inplace_final_state=True, use_qk_l2norm_in_kernel=True,
              ssm_state_indices=ssm, num_accepted_tokens=None if layout in ("decode_varlen", "no_indices") else accepted)
    if layout == "spec_batched" or layout == "no_indices":
        o, ret = fused_recurrent_kda(q, k, v, g, beta, **kw)
    else:
        flat = [x.reshape(1, N * S, *x.shape[2:]) for x in (q, k, v, g, beta)]
        o, ret = fused_recurrent_kda(*flat, cu_seqlens=torch.arange(N + 1) * S, **kw)
        o = o.view(N, S, H, K)
    assert ret is pool
    for n in range(N):
        row = int(start[n])
        if row < 0:
            assert (o[n] == 0).all()
            continue
        o_ref, _, _ = naive_recurrent_kda(*(x[n:n + 1].double() for x in (q, k, v, g, beta)), None, None,
                                          initial_state=original[row:row + 1].double(), gate="log_decay",
                                          beta_sigmoid=False)
        close(o[n:n + 1], o_ref)
        # The state after the last token sits in the last written row.
        last = n if ssm is None else int(ssm.view(N, -1)[n, S - 1])
        _, f_ref, _ = naive_recurrent_kda(*(x[n:n + 1].double() for x in (q, k, v, g, beta)), None, None,
                                          initial_state=original[row:row + 1].double(), gate="log_decay",
                                          beta_sigmoid=False, output_final_state=True)
        close(pool[last:last + 1], f_ref)


def test_fused_recurrent_kda_refusals():
    x = [rnd(1, 4, H, K, seed=i) for i in range(4)] + [rnd(1, 4, H).sigmoid()]
    pool = torch.zeros(8, H, K, K)
    with pytest.raises(ValueError, match="inplace_final_state"):
        fused_recurrent_kda(*x, initial_state=pool, inplace_final_state=False)


@pytest.mark.parametrize("check_inputs", [True, False])
@pytest.mark.parametrize("indexed", [True, False])
def test_fused_recurrent_kda_uneven_counts(check_inputs, indexed):
    """Issue 53 row 5: uneven token counts per sequence were refused, and with
    ``check_inputs=False`` gave wrong values silently; now served in one launch, with
    zero-length (CUDA-graph padding) sequences and tokens past the last sequence."""
    counts, pad = [3, 1, 0, 2], 1
    N, T = len(counts), sum(counts) + pad
    q, k, v = (rnd(1, T, H, K, seed=i) for i in range(3))
    g = F.logsigmoid(rnd(1, T, H, K, seed=3))
    beta = rnd(1, T, H, seed=4).sigmoid()
    pool = rnd(16, H, K, K, seed=5)
    original = pool.clone()
    cu = torch.tensor([0, *counts]).cumsum(0)
    accepted = torch.tensor([2, 1, 1, 3])
    ssm = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]]) if indexed else None
    o, ret = fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, cu_seqlens=cu, ssm_state_indices=ssm,
                                 num_accepted_tokens=accepted if indexed else None, check_inputs=check_inputs)
    assert ret is pool and o.shape == (1, T, H, K)
    written = set()
    for n, c in enumerate(counts):
        if c == 0:
            continue
        a, b = int(cu[n]), int(cu[n + 1])
        row = int(ssm[n, accepted[n] - 1]) if indexed else n
        o_ref, f_ref, _ = naive_recurrent_kda(*(x[:, a:b].double() for x in (q, k, v, g, beta)), None, None,
                                              initial_state=original[row:row + 1].double(), gate="log_decay",
                                              beta_sigmoid=False, output_final_state=True)
        close(o[:, a:b], o_ref)
        last = int(ssm[n, c - 1]) if indexed else n
        close(pool[last:last + 1], f_ref)
        written |= set(ssm[n, :c].tolist()) if indexed else {n}
    assert (o[:, T - pad:] == 0).all()
    for r in set(range(16)) - written:
        assert torch.equal(pool[r], original[r]), r


@pytest.mark.parametrize("beta_threshold", [(1.0, 20.0), (2.0, 5.0)])
def test_fused_kda_gate(beta_threshold):
    beta, threshold = beta_threshold
    g, A, bias = rnd(5, H * K, seed=1) * 8, rnd(H, seed=2), rnd(H * K, seed=3)
    y = fused_kda_gate(g, A, K, bias, beta, threshold)
    x = g.view(5, H, K) + bias.view(H, K)
    want = -A.exp()[:, None] * torch.where(beta * x > threshold, x, torch.log1p(torch.exp(beta * x)) / beta)
    assert y.dtype == torch.float32 and y.shape == (5, H, K)
    close(y, want, atol=1e-5)
    close(fused_kda_gate(g, A.view(1, 1, H, 1), K, bias, lower_bound=-5.0), kda_gate(g.view(5, H, K), A, bias, -5.0))


@pytest.mark.parametrize("accepted, exc, says", [
    (torch.tensor([0, 1]), ValueError, "num_accepted_tokens: expected entries in [1, 3]"),
    (torch.tensor([99, 1]), ValueError, "num_accepted_tokens: expected entries in [1, 3]"),
    (torch.tensor([1.0, 2.0]), TypeError, "num_accepted_tokens: expected dtype"),
    (torch.tensor([1, 2, 3]), ValueError, "num_accepted_tokens: expected shape [2]"),
])
def test_bad_num_accepted_tokens_are_refused_and_the_pool_is_untouched(accepted, exc, says):
    """Issue 46: bad values were clamped silently and the pool updated; a wrong length
    gave a raw torch error."""
    from ..helpers import refused

    N, S = 2, 3
    q, k, v = (rnd(N, S, H, K, seed=i) for i in range(3))
    g, beta = F.logsigmoid(rnd(N, S, H, K, seed=3)), rnd(N, S, H, seed=4).sigmoid()
    pool = rnd(8, H, K, K, seed=5)
    before = pool.clone()
    ssm = torch.tensor([[0, 1, 2], [3, 4, 5]])
    with refused(exc) as info:
        fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, ssm_state_indices=ssm, num_accepted_tokens=accepted)
    assert str(info.value).startswith(says) and "\n" not in str(info.value), str(info.value)
    assert torch.equal(pool, before)


@pytest.mark.parametrize("kwargs, exc, says", [
    (dict(lower_bound=3.0), ValueError, "lower_bound: expected a finite number <= 0, got 3.0"),
    (dict(lower_bound=float("nan")), ValueError, "lower_bound: expected a finite number <= 0, got nan"),
    (dict(g=torch.zeros(3, H * K, dtype=torch.int32)), TypeError, "g: expected dtype"),
    (dict(A=torch.zeros(H, dtype=torch.int64)), TypeError, "A: expected dtype"),
    (dict(g_bias=torch.zeros(H * K, dtype=torch.int32)), TypeError, "g_bias: expected dtype"),
    (dict(g_bias=torch.zeros(H * K + 1)), ValueError, "g_bias: expected H*head_k_dim"),
    (dict(head_k_dim=0), ValueError, "head_k_dim: expected an int"),
    (dict(beta=0.0), ValueError, "beta: expected a finite number > 0"),
    (dict(threshold=float("inf")), ValueError, "threshold: expected a finite number"),
])
def test_fused_kda_gate_refuses_what_the_kernels_refuse(kwargs, exc, says):
    """Issue 54 item 4: only the last dim was checked; lower_bound=3.0 gave positive
    log decays, NaN gave NaN, an int32 gate was accepted."""
    args = dict(g=rnd(3, H * K), A=torch.zeros(H), head_k_dim=K, g_bias=torch.zeros(H * K))
    args.update(kwargs)
    with pytest.raises(exc) as info:
        fused_kda_gate(**args)
    assert str(info.value).startswith(says) and "\n" not in str(info.value), str(info.value)


def test_chunk_kda_with_fused_gate_refuses_a_batch_with_cu_seqlens():
    """Issue 54 item 9: B=2 with cu_seqlens was flattened silently."""
    T = 8
    q, k, v, g = (rnd(2, T, H, K, seed=i) for i in range(4))
    with pytest.raises(ValueError) as info:
        chunk_kda_with_fused_gate(q, k, v, g, rnd(2, T, H, seed=5), torch.zeros(H), None,
                                  cu_seqlens=torch.tensor([0, 8, 16]))
    assert str(info.value).startswith("q: with cu_seqlens the batch dim must be 1"), str(info.value)

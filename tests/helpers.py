"""What several test modules share: input builders, error metrics, a simulated
process group and free ports. Test modules import from here, never from each other.
"""

from __future__ import annotations

import contextlib
import math
import socket

import torch

from kda_engram.kda.chunk import kda_prefill_walk
from kda_engram.kda.metadata import max_chunks
from kda_engram.kda.reference import naive_chunk_operands

# ----------------------------------------------------------------------- refusals


@contextlib.contextmanager
def refused(exc, **kwargs):
    """``pytest.raises`` for a call whose error may come from a rule on device
    values: by default such an error is raised by the next kda_engram call
    (:mod:`kda_engram.validation.entry`), so the block ends with
    :func:`kda_engram.raise_pending_errors`, which raises it there."""
    import pytest

    from kda_engram import raise_pending_errors

    with pytest.raises(exc, **kwargs) as info:
        yield info
        raise_pending_errors()


def with_sentinels(*shape, seed=3):
    """A cache of random values with every other row NaN (bit patterns a stray
    write would change)."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    x[::2] = math.nan
    return x


def bits(x):
    return x.view(torch.int32) if x.dtype == torch.float32 else x


def assert_same(after, before):
    """Every tensor bit-identical to its copy taken before."""
    for a, b in zip(after, before):
        assert torch.equal(bits(a), bits(b))


# ----------------------------------------------------------------------- error metrics

#: The chunk kernel's absolute bound in fp32 (tests/kda/test_chunk.py, test_groups.py).
CHUNK_ATOL = 2e-4


def close(a: torch.Tensor, b: torch.Tensor, atol: float = CHUNK_ATOL) -> None:
    """Same shape and max |a - b| < ``atol`` (0 for empty tensors)."""
    assert a.shape == b.shape
    err = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    assert err < atol, err


def rel_rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    """``rms(a - b) / rms(b)``, in fp64 on the host (the bf16 GPU tests' metric)."""
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------- KDA chunk inputs

#: The chunk kernel's operands, in its argument order.
OPS = ("qg", "w", "u", "kg_t", "aqk", "decay")


def make_raw(lengths, *, H=2, K=32, V=32, seed=0, device="cpu"):
    """Raw KDA inputs (fp32) for a varlen batch of ``lengths`` and its ``cu_seqlens``
    (int64): ``({q, k, v, raw_g, raw_beta, A_log, dt_bias}, cu)``."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    raw = dict(
        q=rnd(1, T, H, K), k=rnd(1, T, H, K), v=rnd(1, T, H, V), raw_g=rnd(1, T, H, K) * 2.0,
        raw_beta=rnd(1, T, H), A_log=rnd(H) * 0.5, dt_bias=rnd(H * K),
    )
    cu = torch.tensor([0] + list(lengths), dtype=torch.int64).cumsum(0)
    return {n: t.to(device) for n, t in raw.items()}, cu.to(device)


def make_ops(raw, cu, lower_bound, *, dtype=torch.float32, pad_rows=True):
    """naive_chunk_operands, with kg_t/decay padded to the prologue's static row bound
    and the padding filled with NaN (the kernel must never read it)."""
    ops = naive_chunk_operands(**raw, cu_seqlens=cu, lower_bound=lower_bound)
    out = {n: ops[n].to(dtype) for n in ("qg", "w", "u", "aqk")}
    out["decay"] = ops["decay"].float()
    out["kg_t"] = ops["kg_t"].to(dtype)
    if pad_rows:
        T, N = raw["q"].shape[1], cu.numel() - 1
        rows = max_chunks(T, N)
        for name in ("kg_t", "decay"):
            x = out[name]
            padded = torch.full((rows, *x.shape[1:]), math.nan, dtype=x.dtype, device=x.device)
            padded[: x.shape[0]] = x
            out[name] = padded
    return out, ops


def run_chunk(ops, cu, scale, out=None, **kw):
    """``kda_prefill_walk`` on ``ops`` (a NaN-filled ``out`` unless given)."""
    if out is None:
        u = ops["u"]
        out = torch.full(u.shape, math.nan, dtype=u.dtype, device=u.device)
    kw.setdefault("initial_state", None)
    kw.setdefault("output_final_state", False)
    return kda_prefill_walk(*(ops[n] for n in OPS), out, scale, cu, kw.pop("initial_state"),
                           kw.pop("output_final_state"), **kw)


# ----------------------------------------------------------------------- process groups


class SimulatedGroup:
    """Stands in for a TP group: all_gather returns the pieces every rank made
    (collected beforehand), after checking this rank's own one came in."""

    def __init__(self, rank, world_size, pieces):
        self.rank, self.world_size, self.pieces = rank, world_size, pieces

    def all_gather(self, x, dim):
        assert torch.equal(x, self.pieces[self.rank])
        return torch.cat(self.pieces, dim=dim)


def free_port() -> int:
    """A TCP port on 127.0.0.1 free at the time of the call (for gloo ranks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_step(B, H, K, V, *, S=None, dtype=torch.float32, gate="random", device="cpu", seed=0):
    """Raw decode inputs; ``S=None`` gives the one-token shapes ``[B, H, *]``."""
    gen = torch.Generator().manual_seed(seed)
    lead = (B,) if S is None else (B, S)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, raw_g = rnd(*lead, H, K), rnd(*lead, H, K), rnd(*lead, H, K)
    v, raw_beta = rnd(*lead, H, V), rnd(*lead, H)
    if gate == "extreme":
        # Gates far into both tails of softplus/sigmoid, saturated betas, and
        # zero q/k heads (the L2 norm's eps decides; k = 0 means no update).
        sign = torch.where(rnd(*lead, H, K) > 0, 1.0, -1.0)
        raw_g = sign * (30.0 + 20.0 * rnd(*lead, H, K).abs())
        raw_beta = 40.0 * torch.sign(rnd(*lead, H))
        q.reshape(-1, H, K)[0, 0] = 0.0
        k.reshape(-1, H, K)[-1, H - 1] = 0.0
    return dict(
        q=q.to(dtype).to(device),
        k=k.to(dtype).to(device),
        v=v.to(dtype).to(device),
        raw_g=raw_g.to(dtype).to(device),
        raw_beta=raw_beta.to(dtype).to(device),
        A_log=(rnd(H) * 0.5).to(device),
        dt_bias=rnd(H * K).to(device),
    )


def assert_untouched(cache, before, named):
    rows = [r for r in range(cache.shape[0]) if r not in {int(x) for x in named}]
    # NaN sentinels stay NaN, everything else bit-identical.
    assert torch.equal(cache[rows].isnan(), before[rows].isnan())
    torch.testing.assert_close(cache[rows], before[rows], equal_nan=True, rtol=0, atol=0)


def raw_kda_inputs(lead, H, K, V, seed=0):
    """Raw KDA inputs (fp32, CPU) with leading dims ``lead``: ``(1, T)`` for a
    prefill, ``(B,)`` or ``(B, S)`` for decode."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    return dict(q=rnd(*lead, H, K), k=rnd(*lead, H, K), v=rnd(*lead, H, V), raw_g=rnd(*lead, H, K),
                raw_beta=rnd(*lead, H), A_log=rnd(H) * 0.5, dt_bias=rnd(H * K))



# ----------------------------------------------------------------------- peers


@contextlib.contextmanager
def first_fit_autotune():
    """Inside: every Triton autotuner that has not tuned a key yet takes the first
    of its configs (in its own order, after its own pruning) that compiles and
    runs, instead of compiling and timing every config.

    For a peer (fla-core) checked side by side for correctness: its speed does not
    matter there, and compiling each of its kernels' configs (dozens per kernel) is
    most of such a test's time. The picks are not written to Triton's autotune disk
    cache and are dropped on the way out, so a later benchmark in the same process
    or on the same machine still tunes. (Uses ``Autotuner.prune_configs``,
    ``_bench`` and ``do_bench``, Triton's internals; triton is pinned to 3.5-3.6.)
    """
    from triton.runtime.autotuner import Autotuner

    prune, bench = Autotuner.prune_configs, Autotuner._bench
    touched = {}  # autotuner -> (its cache_results, the keys it had tuned)

    def first_prune(self, kwargs):
        if self not in touched:
            touched[self] = (self.cache_results, set(self.cache))
        self.cache_results = False
        self.first_fit_found = False
        return prune(self, kwargs)

    def first_bench(self, *args, config, **meta):
        if getattr(self, "first_fit_found", False):
            return [math.inf, math.inf, math.inf]
        had = "do_bench" in self.__dict__
        saved = self.__dict__.get("do_bench")
        # One launch (compile and run) in place of the timing loop.
        self.__dict__["do_bench"] = lambda kernel_call, quantiles: (kernel_call(), [0.0, 0.0, 0.0])[1]
        try:
            timing = bench(self, *args, config=config, **meta)
        finally:
            if had:
                self.__dict__["do_bench"] = saved
            else:
                del self.__dict__["do_bench"]
        self.first_fit_found = timing[0] != math.inf
        return timing

    Autotuner.prune_configs, Autotuner._bench = first_prune, first_bench
    try:
        yield
    finally:
        Autotuner.prune_configs, Autotuner._bench = prune, bench
        for tuner, (cache_results, keys) in touched.items():
            tuner.cache_results = cache_results
            for key in set(tuner.cache) - keys:
                del tuner.cache[key]
            tuner.__dict__.pop("first_fit_found", None)


def sm90_or_skip(device, what: str) -> None:
    """Skip a GPU test of an sm_90-only kernel (``what`` names it) on any other GPU."""
    import pytest

    major, _ = torch.cuda.get_device_capability(device)
    if major != 9:
        pytest.skip(f"{what} needs sm_90, this GPU is sm_{major}x")

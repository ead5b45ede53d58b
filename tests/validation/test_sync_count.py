"""Host syncs per call on the GPU (counted by torch's CUDA sync debug mode and
event waits): none with the defaults once the previous call's verdict has landed
(it is raised one call later, :mod:`kda_engram.validation.entry`), one with
``check_inputs="sync"``, none with ``check_inputs=False``."""

import pytest
import torch

from kda_engram.engram.gate import engram_post_wkv
from kda_engram.kda.decode import kda_decode
from kda_engram.kda.prefill import chunk_kda_prefill
from kda_engram.tools.benchmarks.profile_default_checks import sync_warnings


def count_syncs(fn, monkeypatch) -> int:
    """Host waits in one call of ``fn``: the syncs torch's debug mode reports plus
    event waits (the checks' read-back waits on an event of its side stream, which
    the debug mode does not see)."""
    fn()  # compile and warm the caching allocator first
    torch.cuda.synchronize()
    waits = []
    real_wait = torch.cuda.Event.synchronize
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda self: (waits.append(1), real_wait(self))[1])
    try:
        syncs = sync_warnings(fn)
    finally:
        monkeypatch.undo()
    return len(waits) + len(syncs)


def prefill_args(gpu, N=4, L=200, H=4, K=128, V=128, slots=8):
    gen = torch.Generator(device=gpu).manual_seed(0)
    T = N * L
    r = lambda *s: torch.randn(*s, device=gpu, generator=gen)  # noqa: E731
    cache = torch.zeros(slots, H, V, K, device=gpu)
    return dict(
        q=r(1, T, H, K).bfloat16(), k=r(1, T, H, K).bfloat16(), v=r(1, T, H, V).bfloat16(),
        raw_g=r(1, T, H, K).bfloat16(), raw_beta=r(1, T, H).bfloat16(), A_log=r(H) * 0.5, dt_bias=r(H * K),
        cu_seqlens=torch.arange(N + 1, device=gpu, dtype=torch.int32) * L,
        state_cache=cache, state_indices=torch.arange(N, device=gpu, dtype=torch.int32),
        has_initial_state=torch.ones(N, dtype=torch.bool, device=gpu), checkpoint_state=cache,
        checkpoint_offsets=torch.full((N,), 128, device=gpu, dtype=torch.int32),
        checkpoint_state_indices=torch.arange(N, 2 * N, device=gpu, dtype=torch.int32),
    )


@pytest.mark.gpu
def test_prefill_one_sync_by_default(gpu, monkeypatch):
    args = prefill_args(gpu)
    assert count_syncs(lambda: chunk_kda_prefill(**args), monkeypatch) == 0
    assert count_syncs(lambda: chunk_kda_prefill(**args, check_inputs="sync"), monkeypatch) == 1
    assert count_syncs(lambda: chunk_kda_prefill(**args, check_inputs=False), monkeypatch) == 0


@pytest.mark.gpu
def test_decode_one_sync_by_default(gpu, monkeypatch):
    B, H, K, V = 64, 4, 128, 128
    gen = torch.Generator(device=gpu).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=gpu, generator=gen)  # noqa: E731
    args = dict(q=r(B, H, K).bfloat16(), k=r(B, H, K).bfloat16(), v=r(B, H, V).bfloat16(),
                raw_g=r(B, H, K).bfloat16(), raw_beta=r(B, H).bfloat16(), A_log=r(H), dt_bias=r(H * K),
                state_cache=torch.zeros(B, H, V, K, device=gpu),
                state_indices=torch.arange(B, device=gpu, dtype=torch.int32))
    assert count_syncs(lambda: kda_decode(**args), monkeypatch) == 0
    assert count_syncs(lambda: kda_decode(**args, check_inputs="sync"), monkeypatch) == 1
    assert count_syncs(lambda: kda_decode(**args, check_inputs=False), monkeypatch) == 0


@pytest.mark.gpu
def test_engram_gate_no_sync(gpu, monkeypatch):
    T, hc, dim = 2048, 4, 5120
    hidden = torch.randn(T, hc, dim, device=gpu).bfloat16()
    kv = torch.randn(T, (hc + 1) * dim, device=gpu).bfloat16()
    q = torch.randn(hc, dim, device=gpu).bfloat16()
    k = torch.randn(hc, dim, device=gpu).bfloat16()
    assert count_syncs(lambda: engram_post_wkv(hidden, kv, q, k, eps=1e-6), monkeypatch) == 0


@pytest.mark.gpu
def test_layer_steps_no_sync_by_default(gpu, monkeypatch):
    """The fused decode step and the KimiDeltaAttention forward (a decode batch, and
    a mixed batch with checkpoints): no host wait once the previous verdict has
    landed. (The H100 bench of 2026-12-05 measured the layer's default forward at
    +1.3 to +1.7 ms over no-check; a sync here would be why.)"""
    from kda_engram.layers.kda import KDABatch, KimiDeltaAttention
    from kda_engram.tools.benchmarks.profile_default_checks import _calls

    with torch.inference_mode():
        calls = _calls(gpu, 64, 4, 128)
        for name in ("kda_layer_decode_step", "layer_forward"):
            assert count_syncs(lambda name=name: calls[name](True), monkeypatch) == 0, name
            assert count_syncs(lambda name=name: calls[name](False), monkeypatch) == 0, name
        layer = KimiDeltaAttention(512, 4, 128, lower_bound=-5.0, dtype=torch.bfloat16, device=gpu)
        layer.reset_parameters(torch.Generator().manual_seed(0))
        sc, cs = layer.allocate_cache(16)
        sc.zero_()
        cs.zero_()
        lens = torch.tensor([1, 1, 300, 200], device=gpu)
        batch = KDABatch.from_query_lens(lens, torch.arange(4, device=gpu), num_decode=2,
                                         checkpoint_offsets=torch.tensor([0, 0, 256, 128], device=gpu),
                                         checkpoint_indices=torch.arange(8, 12, device=gpu))
        hs = torch.randn(int(lens.sum()), 512, device=gpu).bfloat16()
        assert count_syncs(lambda: layer(hs, batch, sc, cs), monkeypatch) == 0

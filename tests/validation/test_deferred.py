"""The default checks' deferred verdict (:mod:`kda_engram.validation.entry`).

A call with ``check_inputs=True`` that breaks a rule on device values writes no
cache (guarded launches) and returns; its one-line error is raised by the next
call into the library, whatever the op, before that call writes anything, or by
:func:`kda_engram.raise_pending_errors`. ``check_inputs="sync"`` raises on the
spot. On the CPU the verdict is read at once but raised the same way, so these
tests run the deferred path itself.
"""

import subprocess
import sys
import threading

import pytest
import torch

import kda_engram
from kda_engram.engram.hashing import next_history, ngram_hash
from kda_engram.engram.layout import EngramLayout
from kda_engram.kda.conv import kda_conv_decode
from kda_engram.kda.decode import kda_decode
from kda_engram.kda.prefill import chunk_kda_prefill

from ..helpers import assert_same, raw_kda_inputs, with_sentinels

H, K, V = 1, 16, 16
SUFFIX = "(from an earlier kda_decode call, which wrote no cache)"


def decode_args(cache, rows):
    return dict(**raw_kda_inputs((len(rows),), H, K, V, 0), state_cache=cache, state_indices=torch.tensor(rows))


def one_line(info, name):
    text = str(info.value)
    assert "\n" not in text and text.startswith(name), text


def test_raised_by_the_next_call_before_it_writes():
    cache = with_sentinels(6, H, V, K)
    before = cache.clone()
    kda_decode(**decode_args(cache, [0, 9]))  # row 9 of 6: refused, but not here
    assert_same([cache], [before])
    with pytest.raises(ValueError) as info:
        kda_decode(**decode_args(cache, [1, 3]))  # valid, would write rows 1 and 3
    one_line(info, "state_indices")
    assert "got max 9" in str(info.value) and str(info.value).endswith(SUFFIX)
    assert_same([cache], [before])
    # The error was raised once: the same valid call now runs and writes.
    out = kda_decode(**decode_args(cache, [1, 3]))
    ref_cache = before.clone()
    ref = kda_decode(**decode_args(ref_cache, [1, 3]), check_inputs=False)
    assert torch.equal(out, ref) and torch.equal(cache[[1, 3]], ref_cache[[1, 3]])
    assert not torch.equal(cache[1:2].view(torch.int32), before[1:2].view(torch.int32))


def test_raised_by_a_different_op_before_it_writes():
    """A bad decode, then a prefill on the same caches (and a conv decode, and the
    Engram hashing into its own history): each raises first and writes nothing."""
    cache = with_sentinels(6, H, V, K)
    conv = with_sentinels(4, 8, 3, seed=4)
    layout = EngramLayout.build(layer_ids=[1], max_ngram=3, n_heads=2, head_dim=8, vocab_size=[101, 203],
                                compressed_vocab_size=50, pad_id=2)
    history = torch.tensor([[4, 5], [-1, 7]])
    before = [cache.clone(), conv.clone(), history.clone()]
    T = 70
    prefill = dict(**raw_kda_inputs((1, T), H, K, V, 1), cu_seqlens=torch.tensor([0, 66, T]), state_cache=cache,
                   state_indices=torch.tensor([0, 3]), has_initial_state=torch.tensor([False, True]))
    nexts = (
        lambda: chunk_kda_prefill(**prefill),
        lambda: kda_conv_decode(torch.randn(2, 8), torch.randn(8, 4), conv, torch.tensor([0, 2])),
        lambda: next_history(torch.arange(6), torch.tensor([0, 4, 6]), layout, history=history, out=history),
        lambda: ngram_hash(torch.arange(6), torch.tensor([0, 4, 6]), layout, history=history),
    )
    for call in nexts:
        kda_decode(**decode_args(cache, [2, 2]))  # duplicate rows: refused
        with pytest.raises(ValueError) as info:
            call()
        one_line(info, "state_indices")
        assert "distinct" in str(info.value)
        assert_same([cache, conv, history], before)
    # Nothing pending now: the prefill runs and writes.
    chunk_kda_prefill(**prefill)
    assert not torch.equal(cache[3:4].view(torch.int32), before[0][3:4].view(torch.int32))


def test_a_call_without_checks_raises_it_too():
    cache = with_sentinels(6, H, V, K)
    before = cache.clone()
    kda_decode(**decode_args(cache, [0, 9]))
    with pytest.raises(ValueError, match="state_indices"):
        kda_decode(**decode_args(cache, [1, 3]), check_inputs=False)
    assert_same([cache], [before])


def test_raise_pending_errors():
    cache = with_sentinels(6, H, V, K)
    kda_decode(**decode_args(cache, [0, 9]))
    with pytest.raises(ValueError) as info:
        kda_engram.raise_pending_errors()
    one_line(info, "state_indices")
    kda_engram.raise_pending_errors()  # raised once; nothing left
    kda_engram.raise_pending_errors()


def test_a_valid_call_leaves_nothing_to_raise():
    cache = with_sentinels(6, H, V, K)
    kda_decode(**decode_args(cache, [0, 2]))
    kda_engram.raise_pending_errors()


def test_sync_raises_on_the_spot():
    cache = with_sentinels(6, H, V, K)
    before = cache.clone()
    with pytest.raises(ValueError) as info:
        kda_decode(**decode_args(cache, [0, 9]), check_inputs="sync")
    one_line(info, "state_indices")
    assert not str(info.value).endswith(SUFFIX)  # this call's own error
    assert_same([cache], [before])
    kda_engram.raise_pending_errors()  # nothing deferred


def test_verdict_gathered_before_the_launch(monkeypatch):
    """The decode's verdict is complete before its kernel is queued (sealed by
    guard_decode_indices): on a GPU the next call then waits for the rule kernel
    only, not for this call's decode, so host and GPU time overlap instead of
    adding up (the measured cause of a default decode costing GPU + host time)."""
    import kda_engram.kda.decode as decode
    from kda_engram.validation.common import DeviceChecks

    order = []
    finish, launch = DeviceChecks._finish, decode.launch_decode

    def traced_finish(self):
        if self._values is None and self._rules:
            order.append("verdict")
        return finish(self)

    def traced_launch(*args, **kwargs):
        order.append("launch")
        return launch(*args, **kwargs)

    monkeypatch.setattr(DeviceChecks, "_finish", traced_finish)
    monkeypatch.setattr(decode, "launch_decode", traced_launch)
    kda_decode(**decode_args(with_sentinels(6, H, V, K), [0, 2]))
    assert order == ["verdict", "launch"]
    kda_engram.raise_pending_errors()


@pytest.mark.parametrize("value", ["yes", 1, None, "Sync"])
def test_check_inputs_values(value):
    cache = with_sentinels(6, H, V, K)
    with pytest.raises(TypeError, match="check_inputs"):
        kda_decode(**decode_args(cache, [0, 2]), check_inputs=value)


def test_pending_verdicts_are_per_thread():
    """A broken call in one thread is raised in that thread only: another thread's
    calls run (and write) meanwhile."""
    cache = with_sentinels(6, H, V, K)
    other = with_sentinels(6, H, V, K, seed=8)
    before_other = other.clone()
    called, resumed, got = threading.Event(), threading.Event(), []

    def worker():
        kda_decode(**decode_args(cache, [0, 9]))  # refused, pending in this thread
        called.set()
        resumed.wait(timeout=300)
        try:
            kda_engram.raise_pending_errors()
        except ValueError as exc:
            got.append(str(exc))

    thread = threading.Thread(target=worker)
    thread.start()
    assert called.wait(timeout=300)
    kda_decode(**decode_args(other, [1, 3]))  # this thread: nothing pending, runs
    kda_engram.raise_pending_errors()
    assert not torch.equal(other[1:2].view(torch.int32), before_other[1:2].view(torch.int32))
    resumed.set()
    thread.join()
    assert len(got) == 1 and got[0].startswith("state_indices"), got


def test_warned_at_exit_when_never_raised():
    code = ("import torch\n"
            "from kda_engram.kda.decode import kda_decode\n"
            "from tests.helpers import raw_kda_inputs\n"
            "kda_decode(**raw_kda_inputs((2,), 1, 16, 16, 0), state_cache=torch.zeros(4, 1, 16, 16),\n"
            "           state_indices=torch.tensor([0, 7]))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "RuntimeWarning" in run.stderr and "never raised" in run.stderr and "state_indices" in run.stderr, \
        run.stderr


@pytest.mark.gpu
def test_deferred_on_the_gpu(gpu):
    """The pinned-slot path: raised by the next call, the caches untouched in
    between; raised by the first call under CUDA-graph capture, which may not wait
    on an event (the slot's marker word is read instead)."""
    cache = with_sentinels(8, 4, 128, 128).to(gpu)
    before = cache.clone()

    def args(rows):
        x = {n: t.to(gpu) for n, t in raw_kda_inputs((len(rows),), 4, 128, 128, 0).items()}
        return dict(**x, state_cache=cache, state_indices=torch.tensor(rows, device=gpu))

    for _ in range(3):  # the slots are reused
        kda_decode(**args([0, 9]))
        with pytest.raises(ValueError, match="state_indices"):
            kda_decode(**args([1, 2]))
        torch.cuda.synchronize()
        assert_same([cache], [before])
    kda_decode(**args([1, 2]))  # valid: warms the kernel before the capture
    kda_engram.raise_pending_errors()
    cache.copy_(before)
    kda_decode(**args([3, 9]))
    good = args([1, 2])
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="state_indices"):
        with torch.cuda.graph(graph):
            kda_decode(**good, check_inputs=False)
    torch.cuda.synchronize()
    assert_same([cache], [before])


def test_kept_buffers_are_not_inference_tensors():
    """The verdicts' reused buffers are made outside inference mode even when the
    first call that needs them runs inside it (an inference tensor cannot be
    written by a later call outside inference mode)."""
    from kda_engram.validation.common import _kept_tensor

    with torch.inference_mode():
        buf = _kept_tensor(4)
    assert not buf.is_inference()
    buf.copy_(torch.arange(4))  # outside inference mode: allowed
    with torch.inference_mode():
        buf.zero_()  # and inside
    assert buf.tolist() == [0, 0, 0, 0]


@pytest.mark.gpu
def test_checked_calls_inside_then_outside_inference_mode_on_the_gpu(gpu):
    """A thread's first checked calls under ``torch.inference_mode()`` make its
    pinned verdict slots; its later calls outside inference mode reuse them (the
    tier once failed here: an inference tensor written outside inference mode)."""
    cache = with_sentinels(8, 4, 128, 128).to(gpu)
    x = {n: t.to(gpu) for n, t in raw_kda_inputs((2,), 4, 128, 128, 0).items()}
    rows = torch.tensor([1, 2], device=gpu)
    failures = []

    def calls():  # a new thread: its verdict slots are made by these calls
        try:
            for mode in ("inference", "normal", "inference"):
                with torch.inference_mode(mode == "inference"):
                    for check in (True, "sync"):
                        kda_decode(**x, state_cache=cache, state_indices=rows, check_inputs=check)
                    kda_engram.raise_pending_errors()
        except Exception as exc:  # noqa: BLE001 - reported by the test thread
            failures.append(exc)

    thread = threading.Thread(target=calls)
    thread.start()
    thread.join()
    assert not failures, failures

"""The prefill backend registry (kda/prefill_paths.py) as the only list of paths (issue 55).

CPU (interpreter): the shipped order and path names; a throwaway backend registered
from here alone (no other file edited) shows up in ``path=``'s values and
``path="auto"``'s order, serves calls through ``chunk_kda_prefill`` with its runner,
refuses in the registry's words, and is gone again once unregistered.
"""

import contextlib

import pytest
import torch

from kda_engram.kda.prefill import chunk_kda_prefill, prefill_path, prefill_verdict
from kda_engram.kda.prefill_paths import (BACKENDS, PrefillBackend, PrefillCall, auto_order, path_names, refusal,
                                          register, unregister)

from ..helpers import make_raw


@contextlib.contextmanager
def registered(backend):
    """``backend`` in the registry for the block, then removed (the registry as before)."""
    before = dict(BACKENDS)
    register(backend)
    try:
        yield backend
    finally:
        unregister(backend.name)
        assert BACKENDS == before


def throwaway(priority=100, verdict=(True, None)):
    """A backend that serves (or refuses) every call and writes 7 into ``out``; its
    calls are recorded in ``.calls``."""
    calls = []

    def run(x, *, cu_seqlens, chunk_offsets, chunk_indices, out, state, conv, groups):
        calls.append(dict(scale=x.scale, cu_seqlens=cu_seqlens, out=out, state=state))
        return out.fill_(7.0), None

    backend = PrefillBackend("throwaway", path="throwaway", title="the throwaway path", verify=lambda call: verdict,
                             run=run, priority=priority)
    return backend, calls


def test_the_shipped_backends_and_their_order():
    assert path_names() == ("auto", "fused", "hopper", "portable")
    assert auto_order() == ("grouped", "hopper", "portable")


def test_a_registered_backend_is_a_path_and_autos_first_choice():
    raw, cu = make_raw([10, 3], H=2, K=16, V=16)
    backend, calls = throwaway()
    with registered(backend):
        assert path_names() == ("auto", "fused", "hopper", "portable", "throwaway")
        assert auto_order() == ("throwaway", "grouped", "hopper", "portable")
        assert prefill_path(raw["q"], raw["v"], None, cu_seqlens=cu) == "throwaway"
        assert prefill_path(raw["q"], raw["v"], None, cu_seqlens=cu, path="throwaway") == "throwaway"
        for path in ("auto", "throwaway"):
            out, final = chunk_kda_prefill(**raw, lower_bound=-5.0, cu_seqlens=cu, output_final_state=True, path=path)
            assert final is None and bool((out == 7.0).all()) and out.shape == raw["v"].shape
        assert len(calls) == 2
        assert calls[-1]["scale"] == 16 ** -0.5 and calls[-1]["state"].output_final_state  # validated, filled in
        # The other paths still answer for themselves.
        assert prefill_path(raw["q"], raw["v"], None, cu_seqlens=cu, path="portable") == "portable"
    assert prefill_path(raw["q"], raw["v"], None, cu_seqlens=cu) == "portable"
    with pytest.raises(ValueError, match=r"path: expected one of \('auto', 'fused', 'hopper', 'portable'\), got 'throwaway'"):
        prefill_path(raw["q"], raw["v"], None, cu_seqlens=cu, path="throwaway")


def test_a_refusing_backend_speaks_in_the_registrys_words_and_auto_passes_it_by():
    raw, cu = make_raw([10], H=2, K=16, V=16)
    backend, calls = throwaway(verdict=(False, "needs a call it never gets"))
    with registered(backend):
        message = "path: the throwaway path cannot serve this call: it needs a call it never gets"
        assert refusal("throwaway", "needs a call it never gets") == message.removeprefix("path: ")
        with pytest.raises(ValueError) as info:
            chunk_kda_prefill(**raw, lower_bound=-5.0, cu_seqlens=cu, path="throwaway")
        assert str(info.value) == message
        assert prefill_verdict(PrefillCall(raw["q"], raw["v"], cu_seqlens=cu), "throwaway") == (False, message.removeprefix("path: "))
        assert prefill_path(raw["q"], raw["v"], None, cu_seqlens=cu) == "portable"
    assert calls == []


def test_a_backend_without_priority_is_a_path_but_never_autos():
    raw, cu = make_raw([10], H=2, K=16, V=16)
    backend, calls = throwaway(priority=None)
    with registered(backend):
        assert "throwaway" in path_names() and "throwaway" not in auto_order()
        assert prefill_path(raw["q"], raw["v"], None, cu_seqlens=cu) == "portable"
        assert prefill_path(raw["q"], raw["v"], None, cu_seqlens=cu, path="throwaway") == "throwaway"


def test_a_running_as_backend_is_no_path_of_its_own():
    """``"grouped"`` runs as ``"portable"``: a backend whose ``path`` is another's is asked
    by ``"auto"`` but is no ``path=`` value."""
    raw, cu = make_raw([10], H=2, K=16, V=16)
    backend, _ = throwaway()
    backend = PrefillBackend("portable_too", path="portable", title="the portable twin", verify=backend.verify,
                             run=BACKENDS["portable"].run, priority=100)
    with registered(backend):
        assert "portable_too" not in path_names() and auto_order()[0] == "portable_too"
        assert prefill_path(raw["q"], raw["v"], None, cu_seqlens=cu) == "portable"


def test_two_backends_in_autos_order_may_not_share_a_priority():
    backend, _ = throwaway(priority=BACKENDS["hopper"].priority)
    with pytest.raises(ValueError, match="prefill backend 'throwaway': priority 20 is taken by 'hopper'"):
        register(backend)
    assert "throwaway" not in BACKENDS
    # Re-registering a backend under its own name replaces it (its priority is its own).
    assert register(BACKENDS["hopper"]) is BACKENDS["hopper"]


def test_a_verifier_reads_the_calls_host_facts():
    """The verifier reads the call's host facts (``PrefillCall``) as ``chunk_kda_prefill`` passes them."""
    raw, cu = make_raw([10, 6], H=2, K=16, V=16)
    seen = []

    def verify(call):
        seen.append((call.num_seqs, call.tokens, call.groups, call.out is not None))
        return True, None

    backend = PrefillBackend("throwaway", path="throwaway", title="the throwaway path", verify=verify,
                             run=lambda x, *, out, **kw: (out.zero_(), None), priority=100)
    with registered(backend):
        out = torch.empty_like(raw["v"])
        chunk_kda_prefill(**raw, lower_bound=-5.0, cu_seqlens=cu, out=out, groups=1)
    assert seen == [(2, 16, 1, True)]

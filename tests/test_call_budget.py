"""The Python calls into the package per layer step stay within issue 55's bounds.

A serving engine pays every Python call of a step on the host, every step: the
bounds hold the line the house work drew (docs/design/README.md, "Python calls
per layer step"). Counted with ``sys.setprofile`` after a warm call: every
Python frame whose code lives in ``kda_engram`` (comprehensions and lambdas
included), except the kernel bodies the interpreter runs.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

import kda_engram
from kda_engram.engram.layout import EngramLayout
from kda_engram.layers.engram import EngramBatch, EngramLayer
from kda_engram.layers.kda import KDABatch, KimiDeltaAttention

PACKAGE = os.path.dirname(kda_engram.__file__) + os.sep

#: Issue 55's bounds (calls into the package per step).
KDA_PREFILL_MAX_CALLS = 120
KDA_DECODE_MAX_CALLS = 80
ENGRAM_MAX_CALLS = 120


class _CallCounter:
    """Counts the calls into the package's Python code; a kernel launched under the
    interpreter (its ``GridExecutor.__call__``) is one call site, its body not counted."""

    def __init__(self):
        self.calls: list[str] = []
        self._depth = 0
        self._kernel_depth = None

    def __call__(self, frame, event, arg):
        if event == "call":
            self._depth += 1
            if self._kernel_depth is not None:
                return
            code = frame.f_code
            if code.co_name == "__call__" and code.co_filename.endswith(os.path.join("runtime", "interpreter.py")):
                self._kernel_depth = self._depth
            elif code.co_filename.startswith(PACKAGE):
                self.calls.append(f"{code.co_filename[len(PACKAGE):]}:{code.co_qualname}")
        elif event == "return":
            if self._depth == self._kernel_depth:
                self._kernel_depth = None
            self._depth -= 1


def calls_of(step) -> list[str]:
    step()  # warm: compiles, the interpreter's set-up, a pending verdict to settle
    counter = _CallCounter()
    sys.setprofile(counter)
    try:
        step()
    finally:
        sys.setprofile(None)
    return counter.calls


def _kda_layer():
    layer = KimiDeltaAttention(32, 2, 16, gate_low_rank_dim=8, output_gate_low_rank_dim=8, lower_bound=-5.0,
                               dtype=torch.float32, device="cpu")
    layer.load_weights(layer.random_weights(torch.Generator().manual_seed(1)))
    state, conv = layer.allocate_cache(8)
    return layer, state.zero_(), conv.zero_()


@pytest.mark.parametrize("step, bound", [("prefill", KDA_PREFILL_MAX_CALLS), ("decode", KDA_DECODE_MAX_CALLS)])
def test_a_kda_layer_step_stays_within_its_call_budget(step, bound):
    layer, state, conv = _kda_layer()
    if step == "prefill":
        batch = KDABatch.from_query_lens(torch.tensor([20]), torch.tensor([2]), torch.tensor([False]), num_decode=0)
        x = torch.randn(20, 32, generator=torch.Generator().manual_seed(2))
    else:
        batch = KDABatch.from_query_lens(torch.tensor([1, 1]), torch.tensor([3, 5]), torch.tensor([True, True]),
                                         num_decode=2)
        x = torch.randn(2, 32, generator=torch.Generator().manual_seed(2))
    calls = calls_of(lambda: layer(x, batch, state, conv))
    assert 0 < len(calls) <= bound, f"{len(calls)} calls (bound {bound}):\n" + "\n".join(calls)


def test_an_engram_layer_step_stays_within_its_call_budget():
    layout = EngramLayout.build(layer_ids=[2, 5], max_ngram=3, n_heads=2, head_dim=16, vocab_size=[40, 50],
                                compressed_vocab_size=30, pad_id=1, seed=3)
    layer = EngramLayer(layout, 5, 32, 2, eps=1e-6, dtype=torch.float32, device="cpu", storage="fp32")
    layer.reset_parameters(torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(4)
    lens = [6, 1, 9]
    ids = torch.randint(0, 30, (sum(lens),), generator=gen)
    hidden = torch.randn(sum(lens), 2, 32, generator=gen)
    cache = torch.full((5, 2), -1, dtype=torch.int64)
    batch = EngramBatch.from_query_lens(torch.tensor(lens), torch.tensor([4, 2, 0]), torch.tensor([False] * 3))
    calls = calls_of(lambda: layer(hidden, batch, token_ids=ids, history_cache=cache))
    assert 0 < len(calls) <= ENGRAM_MAX_CALLS, f"{len(calls)} calls (bound {ENGRAM_MAX_CALLS}):\n" + "\n".join(calls)
    # Each of the step's rules once: the lookup's and the gate's are the layer's own.
    for rule in ("check_table_lookup", "check_post_wkv_arguments", "check_gate_common"):
        assert not any(c.endswith(f":{rule}") for c in calls), rule

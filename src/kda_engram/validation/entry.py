"""The one helper every entry point runs its checks with, and the deferred verdicts.

Every public entry point starts with ``checks = EntryChecks(check_inputs)`` and
ends with ``checks.run()``:

* the constructor first raises the broken verdict of an earlier call of this
  thread, if one is pending (:func:`settle_pending`), before this call queues or
  launches anything;
* the host rules of the call raise at once (the entry point runs them when
  ``checks.on``); the rules on device values are queued on ``checks`` (a
  :class:`~kda_engram.validation.common.DeviceChecks`), and the launches run on
  indices passed through :meth:`~kda_engram.validation.common.DeviceChecks.guard`
  (rows -1, sequences empty, offsets 0, token ids 0 when a rule is broken), so a
  broken call writes no cache row;
* :meth:`EntryChecks.run` then, with ``check_inputs=True`` (the default), does not
  block: the verdict is copied into a pinned host slot on a side stream and
  registered as this thread's *pending verdict*, raised by the next call into the
  library (any entry point, any op: its constructor) or by
  :func:`raise_pending_errors`. With ``check_inputs="sync"`` it reads the verdict
  back and raises on the spot (one host sync per call). ``False``: no rule, no
  verdict.

Why: a read-back that blocks makes the host wait for all GPU work queued before
the verdict, so a host-bound call pays its host time plus the GPU's. A deferred
verdict is waited for one call later, when the GPU has long computed it.

On CPU tensors (the interpreter) the verdict is read at once but raised the same
way, one call later, so the CPU tests exercise the deferred path. While a CUDA
graph is captured (no CUDA sync allowed) a pending verdict is read from its host
slot once the slot's marker word, copied after the verdict, says it landed; at
interpreter exit a broken verdict never raised is reported with a warning.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
import warnings

import torch

from .common import DeviceChecks, broken_rule_message, side_slot, can_read_back

__all__ = ["EntryChecks", "raise_pending_errors", "settle_pending", "check_mode"]

_TLS = threading.local()
_LIVE: set = set()  # every thread's pending verdicts, for the report at exit
_LIVE_LOCK = threading.Lock()


def check_mode(check_inputs) -> str | None:
    """``True`` -> ``"deferred"``, ``"sync"`` -> ``"sync"``, ``False`` -> None."""
    if check_inputs is True:
        return "deferred"
    if check_inputs is False:
        return None
    if isinstance(check_inputs, str) and check_inputs == "sync":
        return "sync"
    raise TypeError(f'check_inputs: expected True, False or "sync", got {check_inputs!r}')


class _Pending:
    """One call's verdict on its way to the host: the rules, their positions, and
    either the values (CPU) or a pinned slot whose last word turns 1 once the
    verdict has landed (CUDA: copied on the side stream after the verdict)."""

    __slots__ = ("rules", "positions", "origin", "got", "device_values", "slot", "entry", "n")

    def __init__(self, rules, positions, values: torch.Tensor, ready, origin: str) -> None:
        self.rules, self.positions, self.origin = rules, positions, origin
        self.got = None
        self.device_values = self.slot = self.entry = None
        if not values.is_cuda:
            self.got = values.tolist()  # a CPU tensor: nothing to wait for
            return
        slot = side_slot(values.device)
        n = values.numel()
        self.entry = host, marker, event = slot.take_buffer(n + 1)
        marker[n] = 0  # set to 1 by the second copy, once the verdict has landed
        slot.stream.wait_event(ready)
        with torch.cuda.stream(slot.stream):
            host[:n].copy_(values, non_blocking=True)
            host[n:n + 1].copy_(slot.one, non_blocking=True)
            event.record(slot.stream)
        # Held until resolved, so the caching allocator cannot hand its block to
        # later work on the current stream before the side stream has copied it.
        self.device_values, self.slot, self.n = values, slot, n

    def resolve(self) -> str | None:
        """Wait for the verdict if it has not landed (an event wait; under CUDA graph
        capture, where that is not allowed, a poll of the slot's marker word) and
        return the message of its first broken rule, else None."""
        if self.got is None:
            host, marker, event = self.entry
            n = self.n
            if marker[n] != 1:
                if can_read_back():
                    event.synchronize()
                else:  # capturing: the copy was queued before the capture, so it lands
                    while marker[n] != 1:
                        time.sleep(1e-5)
            self.got = marker[:n].tolist()
            self.slot.give_back(self.entry)
            self.device_values = self.slot = self.entry = None
        message = broken_rule_message(self.rules, self.positions, self.got)
        if message is None:
            return None
        return f"{message} (from an earlier {self.origin} call, which wrote no cache)"


def _pending() -> list:
    pend = getattr(_TLS, "pending", None)
    if pend is None:
        pend = _TLS.pending = []
    return pend


def _settle(pend: list) -> None:
    while pend:
        verdict = pend.pop(0)
        with _LIVE_LOCK:
            _LIVE.discard(verdict)
        message = verdict.resolve()
        if message is not None:
            raise ValueError(message)


def settle_pending() -> None:
    """Raise this thread's pending broken verdict, if any (waiting for it only if it
    has not landed). Every entry point calls it first (through
    :class:`EntryChecks`), and so does every op's body
    (:class:`kda_engram.ops.common.EntryOp`). Nothing to do while ``torch.compile``
    traces: the op's body runs it when the graph runs."""
    pend = getattr(_TLS, "pending", None)
    if pend and not torch.compiler.is_compiling():
        _settle(pend)


def raise_pending_errors() -> None:
    """Raise now the error of this thread's last checked call, if it broke a rule.

    With the default ``check_inputs=True`` a rule on device values that a call
    broke is raised by the next call into kda_engram (the broken call itself wrote
    no cache); call this to get it at a point of your choice instead, e.g. at the
    end of a step or before handing the caches on. Waits for the verdict if it has
    not reached the host yet."""
    _settle(_pending())


class EntryChecks(DeviceChecks):
    """One entry point call's checks: ``checks = EntryChecks(check_inputs)`` first
    (raises an earlier call's pending broken verdict), host rules when
    ``checks.on``, device rules queued on ``checks``, launches on
    :meth:`guard`-ed indices, then ``checks.run()`` once after the last launch (also
    on early returns)."""

    __slots__ = ("mode", "on", "origin")

    def __init__(self, check_inputs) -> None:
        mode = check_mode(check_inputs)
        settle_pending()
        super().__init__()
        self.mode, self.on = mode, mode is not None
        self.origin = sys._getframe(1).f_code.co_name

    def run(self) -> None:
        """The verdict: raised now with ``"sync"``, else registered as this thread's
        pending verdict (nothing to do without device rules)."""
        if not self._rules:
            return
        if self.mode == "sync":
            return super().run()
        if not can_read_back():
            self._take()
            raise RuntimeError(
                f"check_inputs: {self.origin} checks device values, and their verdict cannot be read while a CUDA "
                "graph is captured or torch.compile traces; pass check_inputs=False there")
        rules, positions, values, ready = self._take()
        verdict = _Pending(rules, positions, values, ready, self.origin)
        _pending().append(verdict)
        with _LIVE_LOCK:
            _LIVE.add(verdict)


@atexit.register
def _report_at_exit() -> None:
    """A broken verdict no call raised: warn (the call that broke the rule wrote no
    cache, but the caller never learned of it)."""
    with _LIVE_LOCK:
        left = list(_LIVE)
        _LIVE.clear()
    for verdict in left:
        try:
            message = verdict.resolve()
        except Exception as exc:  # noqa: BLE001 - the device may be gone at exit
            message = f"(the verdict could not be read at exit: {exc})"
        if message is not None:
            warnings.warn(f"kda_engram: a call's error was never raised (call kda_engram.raise_pending_errors() "
                          f"after the last call): {message}", RuntimeWarning, stacklevel=1)

"""Tensor, scalar and device primitives every argument rule is built from.

Each rule raises ``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong
shape, device or value) with one line naming the argument, what was expected and
what came. Host-only rules read nothing from the device. Rules about device
*values* (offsets, indices) do not read anything themselves: they add flags to a
:class:`DeviceChecks`, whose :meth:`DeviceChecks.run` reads them all back in one
transfer, so an entry point pays at most one host sync for all of them.
"""

from __future__ import annotations

import math
import numbers
import threading
from collections.abc import Iterable, Sequence

import torch

from .. import platform
from .index_rules import MAX_GUARDED, fits_index_set_rules, guard_tensors, index_rule_messages, index_set_rules

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)

__all__ = [
    "queue_index_sets",
    "FLOAT_DTYPES",
    "INDEX_DTYPES",
    "DeviceChecks",
    "check_tensor",
    "check_same_dtype",
    "check_kernel_device",
    "check_forward_only",
    "check_parameters_forward_only",
    "check_int",
    "check_real",
    "check_bool",
    "check_instance",
    "check_index_range",
    "check_index_values",
    "index_rule_messages",
    "read_back",
    "can_read_back",
]


#: Whether the interpreter was on when this module was imported. Triton picks
#: interpreted or compiled kernels when a module's ``@triton.jit`` runs, and every
#: kernel module imports this one first, so this says how the package's kernels
#: were built: with ``TRITON_INTERPRET=1`` set only afterwards, a CPU tensor would
#: reach a compiled kernel (Triton's "0 active drivers"), which
#: :func:`check_kernel_device` refuses in one line instead.
KERNELS_INTERPRETED = platform.interpreting()


def _names(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    name: str,
    x,
    *,
    shape: Sequence[int | None] | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    device: torch.device | None = None,
    last_dim_contiguous: bool = False,
) -> torch.Tensor:
    """Check one tensor argument; ``None`` entries of ``shape`` match any size."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.requires_grad:  # the common case costs one attribute read, not a call
        check_forward_only(name, x)
    if shape is not None:
        ok = x.dim() == len(shape)
        if ok:
            for s, d in zip(shape, x.shape):
                if s is not None and s != d:
                    ok = False
                    break
        if not ok:
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name}: expected shape {want}, got {list(x.shape)}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if x.dtype not in dtypes:
            raise TypeError(f"{name}: expected dtype {_names(dtypes)}, got {str(x.dtype).replace('torch.', '')}")
    if device is not None and x.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {x.device}")
    if last_dim_contiguous and x.dim() > 0 and x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"{name}: the last dim must have stride 1, got strides {tuple(x.stride())}")
    return x


def check_forward_only(name: str, x: torch.Tensor) -> None:
    """``x`` does not ask for a gradient: the kernels are forward-only (their outputs
    have no ``grad_fn``), so a tensor that requires grad under grad mode is refused
    rather than silently detached. Host-only (two attribute reads)."""
    if x.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            f"{name}: expected a tensor that does not require grad, got one that does; kda-engram is forward-only "
            f"(no gradient flows through it): call it under torch.no_grad() or torch.inference_mode(), or pass "
            f"{name}.detach()")


def check_parameters_forward_only(module: torch.nn.Module) -> None:
    """:func:`check_forward_only` on every parameter of a serving layer, named as in
    ``module.named_parameters()``: a layer runs it with its host rules, before its
    first launch, since its kernels take several parameters one launch after another
    (nothing to do outside grad mode, where a serving engine runs)."""
    if not torch.is_grad_enabled():
        return
    for name, p in module.named_parameters():
        if p.requires_grad:
            raise ValueError(
                f"{name}: expected a parameter that does not require grad, got one that does; kda-engram is "
                f"forward-only (no gradient flows through it): call the layer under torch.no_grad() or "
                f"torch.inference_mode(), or {name}.requires_grad_(False)")


def check_same_dtype(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    """All ``tensors`` share one dtype."""
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        got = ", ".join(f"{n}={str(t.dtype).replace('torch.', '')}" for n, t in zip(names, tensors))
        raise TypeError(f"{', '.join(names)}: expected one dtype, got {got}")


def check_kernel_device(name: str, x: torch.Tensor) -> None:
    """``x`` lives where a Triton kernel can run: a CUDA/ROCm device, or the CPU when
    the interpreter runs the kernels (``TRITON_INTERPRET=1``); never ``meta`` (no
    data), so a misplaced first tensor is blamed, not the next one compared to it."""
    if x.device.type not in ("cuda", "cpu"):
        raise ValueError(f"{name}: the kernels need tensors on a CUDA/ROCm device (or the CPU under "
                         f"TRITON_INTERPRET=1), got one on {x.device}")
    if x.device.type != "cuda" and not platform.interpreting():
        raise ValueError(
            f"{name}: the kernels need tensors on a CUDA/ROCm device, got one on {x.device}; "
            "to run them on the CPU, set TRITON_INTERPRET=1 before importing kda_engram"
        )
    if x.device.type != "cuda" and not KERNELS_INTERPRETED:
        raise ValueError(
            f"{name}: got a tensor on {x.device}, but TRITON_INTERPRET=1 was set after kda_engram's kernels were "
            "imported (they were built for a GPU); set it before the first import, e.g. TRITON_INTERPRET=1 python ..."
        )


def check_int(name: str, x, *, low: int | None = None, high: int | None = None, allow_none: bool = False) -> None:
    """``x`` is an int (not a bool) in ``[low, high]``."""
    if x is None and allow_none:
        return
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name}: expected an int{' or None' if allow_none else ''}, got {type(x).__name__}")
    if (low is not None and x < low) or (high is not None and x > high):
        lo = "" if low is None else f"{low} <= "
        hi = "" if high is None else f" <= {high}"
        raise ValueError(f"{name}: expected an int {lo}{name}{hi}, got {x}")


_SIGNS = {None: "", "positive": " > 0", "non-negative": " >= 0", "non-positive": " <= 0"}


def check_real(name: str, x, *, sign: str | None = None, allow_none: bool = False) -> None:
    """``x`` is a finite real number (int or float, not a bool or a tensor) of the given
    ``sign``: ``None`` (any), ``"positive"``, ``"non-negative"`` or ``"non-positive"``."""
    if x is None and allow_none:
        return
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name}: expected a real number{' or None' if allow_none else ''}, got {type(x).__name__}")
    value = float(x)
    want = _SIGNS[sign]
    ok = {None: True, "positive": value > 0, "non-negative": value >= 0, "non-positive": value <= 0}[sign]
    if not math.isfinite(value) or not ok:
        raise ValueError(f"{name}: expected a finite number{want}, got {x}")


def check_bool(name: str, x) -> None:
    if not isinstance(x, bool):
        raise TypeError(f"{name}: expected a bool, got {type(x).__name__}")


def check_instance(name: str, x, cls: type):
    """``x`` is a ``cls`` (``TypeError`` naming it otherwise); returns ``x``. The
    caller passes the class: the kernel families' types (``EngramLayout``) sit
    above this module."""
    if not isinstance(x, cls):
        article = "an" if cls.__name__[:1] in "AEIOU" else "a"
        raise TypeError(f"{name}: expected {article} {cls.__name__}, got {type(x).__name__}")
    return x


class DeviceChecks:
    """Flags computed on the device, read back together by :meth:`run`.

    Every :meth:`add` queues a 0-d bool tensor ``bad`` (true = the rule is broken)
    with its message; ``{}`` fields in the message are filled with the values of
    the ``details`` tensors (0-d, integer; int64 saves a conversion), which travel
    in the same transfer. :meth:`run` reads everything back in one transfer (the
    only host sync) and raises the first broken rule in the order the rules were
    added. Nothing queued here writes caller-visible memory.

    Two ways to use it:

    * check, then launch: :meth:`run` before the first launch that writes anything
      the caller owns. The launches wait for the host.
    * launch, then check (the entry points on the hot path): :meth:`guard` the
      device values the kernels index with (``cu_seqlens`` to zeros, row indices to
      -1 = none) so a broken rule turns the launches into no-ops on every cache,
      launch, then :meth:`run`. The read-back then waits only for the flags (a side
      stream, see :func:`read_back`), so the launches are already queued when the
      host waits, and the host may run ahead into the next call as without checks.
    """

    def __init__(self) -> None:
        # Rules in the order they were added: ("flag", bad, message, details) or
        # ("packed", j, flag position, message, detail positions) into packed[j].
        self._rules: list[tuple] = []
        self._packed: list[tuple[torch.Tensor, int]] = []  # (verdict, number of leading flags)
        self._values: torch.Tensor | None = None  # all flags, then all details, int64 (after _finish)
        self._positions: list[tuple[int, tuple[int, ...]]] = []  # per rule: flag and detail positions
        self._ready = None  # the event after which _values is complete (CUDA only)
        self._bad: torch.Tensor | None = None

    def add(self, bad: torch.Tensor, message: str, *details: torch.Tensor) -> None:
        if self._values is not None:
            raise self._closed()
        self._rules.append(("flag", bad, message, details))

    def add_packed(self, verdict: torch.Tensor, rules) -> None:
        """Rules computed by one kernel into an int64 ``verdict``: its leading
        entries are the flags, then the details; ``rules`` lists
        ``(flag position, message, detail positions)`` in ``verdict``. Costs no
        device op of its own."""
        if self._values is not None:
            raise self._closed()
        j, flags = len(self._packed), 0
        for flag, message, details in rules:
            self._rules.append(("packed", j, flag, message, tuple(details)))
            flags = max(flags, flag + 1)
        self._packed.append((verdict, flags))

    @staticmethod
    def _closed() -> RuntimeError:
        return RuntimeError("DeviceChecks: a rule was added after the flags were gathered")

    def __len__(self) -> int:
        return len(self._rules)

    def _finish(self) -> None:
        """Gather every flag, then every detail, into one int64 tensor (a few device
        ops whatever the number of rules; none for one packed verdict alone) and
        mark the point the read-back waits for."""
        if self._values is not None or not self._rules:
            return
        plain, plain_flags, plain_details = [], [], []  # (loops: no call per comprehension)
        for r in self._rules:
            if r[0] == "flag":
                plain.append(r)
                plain_flags.append(r[1])
                for d in r[3]:
                    plain_details.append(d if d.dtype == torch.int64 else d.to(torch.int64))
        if not plain and len(self._packed) == 1:
            values = self._packed[0][0]  # already flags then details: no op
        else:
            flag_parts, detail_parts = [], []
            if plain:
                flag_parts.append(torch.stack(plain_flags).to(torch.int64))
            for v, f in self._packed:
                flag_parts.append(v[:f])
                detail_parts.append(v[f:])
            if plain_details:
                detail_parts.insert(0, torch.stack(plain_details))
            values = torch.cat(flag_parts + detail_parts)
        # Absolute positions: flags [plain..., packed_0 flags, ...], then details likewise.
        flag_base, pos = {}, len(plain)
        for j, (v, f) in enumerate(self._packed):
            flag_base[j] = pos
            pos += f
        n_flags = pos
        detail_base, pos = {}, n_flags + len(plain_details)
        for j, (v, f) in enumerate(self._packed):
            detail_base[j] = pos - f  # packed detail position p (>= f) lands at base + p
            pos += v.numel() - f
        positions, plain_i, plain_d = [], 0, n_flags
        for r in self._rules:
            if r[0] == "flag":
                positions.append((plain_i, tuple(range(plain_d, plain_d + len(r[3])))))
                plain_i += 1
                plain_d += len(r[3])
            else:
                _, j, flag, _, details = r
                placed = []
                for d in details:
                    placed.append(detail_base[j] + d)
                positions.append((flag_base[j] + flag, tuple(placed)))
        self._values, self._positions, self._n_flags = values, positions, n_flags
        if values.is_cuda:
            self._ready = side_slot(values.device).mark_ready()

    def seal(self) -> None:
        """Gather the queued rules now, before the launches they guard: the read-back
        then waits for the rules' own kernels only. (Gathered at :meth:`run`, after
        the launches, the verdict would make the next call wait for the whole launch,
        serialising the host's time and the GPU's.) :meth:`guard` seals too; no rule
        may be added afterwards."""
        self._finish()

    def any_bad(self) -> torch.Tensor | None:
        """0-d bool on the device: some rule is broken (None without rules)."""
        if not self._rules:
            return None
        if self._bad is None:
            self._finish()
            self._bad = self._values[: self._n_flags].any()
        return self._bad

    def guard(self, x: torch.Tensor | None, none_value: int) -> torch.Tensor | None:
        """``x`` when every rule holds, else ``x`` filled with ``none_value`` (a new
        tensor either way, on the device, no sync). Kernels given guarded index
        tensors touch no caller row when a rule is broken."""
        if x is None or not self._rules:
            return x
        return torch.where(self.any_bad(), none_value, x)

    def guard_many(self, *pairs) -> list:
        """:meth:`guard` of several ``(x, none_value)`` pairs (``x`` may be None) in
        one launch (:func:`kda_engram.validation.index_rules.guard_tensors`) instead
        of one ``where`` each: a call's index tensors are guarded together, every one
        by all of the call's rules. Tensors the launch does not take (more than
        :data:`~kda_engram.validation.index_rules.MAX_GUARDED`, or neither 1-d nor
        contiguous) get :meth:`guard`."""
        out = []
        if not self._rules:
            for x, _ in pairs:
                out.append(x)
            return out
        self._finish()
        taken, flat = [], []  # (loops, not comprehensions: no call each on the serving path)
        for i, (x, none) in enumerate(pairs):
            out.append(x)
            if x is not None and len(taken) < MAX_GUARDED and (x.dim() == 1 or x.is_contiguous()):
                taken.append(i)
                flat.append((x if x.dim() == 1 else x.reshape(-1), none))  # (1-d as they are: no view op)
            elif x is not None:
                out[i] = self.guard(x, none)
        if taken:
            for i, y in zip(taken, guard_tensors(self._values, flat, n_flags=self._n_flags)):
                x = pairs[i][0]
                out[i] = y if x.dim() == 1 else y.view(x.shape)
        return out

    def _take(self):
        """Gather the queued rules and empty this object for reuse: ``(rules,
        positions, values, ready)``."""
        self._finish()
        taken = self._rules, self._positions, self._values, self._ready
        self._rules, self._packed, self._values, self._bad, self._ready = [], [], None, None, None
        return taken

    def run(self) -> None:
        """Read every queued rule back now (the one host sync) and raise the first
        broken one."""
        if not self._rules:
            return
        rules, positions, values, ready = self._take()
        message = broken_rule_message(rules, positions, read_back(values, ready))
        if message is not None:
            raise ValueError(message)


def broken_rule_message(rules, positions, got: list[int]) -> str | None:
    """The message of the first broken rule of a read-back verdict, else None."""
    for rule, (flag, details) in zip(rules, positions):
        if got[flag]:
            message = rule[2] if rule[0] == "flag" else rule[3]
            return message.format(*(got[d] for d in details))
    return None


def can_read_back() -> bool:
    """Whether a host read-back is allowed now: not while a CUDA graph is being
    captured on the current stream (a sync is illegal there) nor while
    ``torch.compile`` traces (``.tolist()`` would break the graph). Entry points
    that run their device rules by default skip them there (host rules only)."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


class _SideSlot:
    """Per thread and device: a side stream, a reused pinned buffer and the event
    the host waits on, for :func:`read_back` (a fresh pinned allocation per call
    cost more than the whole check in the first prototype).

    Its tensors outlive the call that made them, so they are made outside
    inference mode (:func:`_kept_tensor`): one made under ``torch.inference_mode()``
    is an inference tensor, and a later call outside it could not write it."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)
        self.host = _kept_tensor(0)
        self.done = torch.cuda.Event()
        self.device = device

        self.one = None  # a device int64 [1] = 1: the marker a deferred verdict's copy ends with
        self.free: list = []  # pinned buffers (tensor, numpy view, event) of resolved deferred verdicts

    def mark_ready(self):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def take_buffer(self, n: int):
        """A pinned int64 buffer of at least ``n`` words, its numpy view and an event,
        owned by one deferred verdict until :meth:`give_back` (a ring: a buffer is
        never reused while a copy into it may be in flight)."""
        if self.one is None:
            self.one = _kept_tensor(1, device=self.device).fill_(1)
        for i, entry in enumerate(self.free):
            if entry[0].numel() >= n:
                return self.free.pop(i)
        host = _kept_tensor(max(n, 64), pin_memory=True)
        return host, host.numpy(), torch.cuda.Event()

    def give_back(self, entry) -> None:
        self.free.append(entry)


def _kept_tensor(n: int, device=None, pin_memory: bool = False) -> torch.Tensor:
    """An int64 ``[n]`` buffer kept across calls: made outside inference mode, so
    that calls both inside and outside ``torch.inference_mode()`` can write it."""
    with torch.inference_mode(False):
        return torch.empty(n, dtype=torch.int64, device=device, pin_memory=pin_memory)


_SIDE = threading.local()


def side_slot(device: torch.device) -> _SideSlot:
    slots = getattr(_SIDE, "slots", None)
    if slots is None:
        slots = _SIDE.slots = {}
    slot = slots.get(device)
    if slot is None:
        slot = slots[device] = _SideSlot(device)
    return slot


def read_back(values: torch.Tensor, ready=None) -> list[int]:
    """``values.tolist()`` in one transfer. On a CUDA device with a ``ready`` event
    (recorded when ``values`` was complete) the copy runs on a side stream that
    waits for that event only: work queued on the current stream after it (the
    guarded launches) keeps running, and only the flags' own producers are waited
    for."""
    if not values.is_cuda or ready is None:
        return values.tolist()
    slot = side_slot(values.device)
    n = values.numel()
    if slot.host.numel() < n:
        slot.host = _kept_tensor(max(n, 64), pin_memory=True)
    slot.stream.wait_event(ready)
    with torch.cuda.stream(slot.stream):
        slot.host[:n].copy_(values, non_blocking=True)
        slot.done.record(slot.stream)
    slot.done.synchronize()
    return slot.host[:n].tolist()


def value_at(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """``x[i]`` of a 1-d tensor at a 0-d device index, as a 0-d tensor, without a
    host sync (``x[i]`` would read ``i`` back to the host): a detail for
    :meth:`DeviceChecks.add`."""
    return x.index_select(0, i.reshape(1)).reshape(())


def check_index_values(
    checks: DeviceChecks,
    name: str,
    idx: torch.Tensor,
    upper: int,
    *,
    allow_negative: bool = True,
    distinct: bool = True,
) -> None:
    """Queue: entries of ``idx`` (any shape) lie in ``[0, upper)``, negative ones
    allowed as "no row" when ``allow_negative``, and the non-negative ones are
    distinct when ``distinct`` (sort + adjacent compare: no data-dependent shapes,
    nothing read back here)."""
    flat = idx.reshape(-1)
    if flat.numel() == 0:
        return
    negative, out_of_range, duplicate = index_rule_messages(name, upper)
    if not allow_negative:
        low = flat.min()
        checks.add(low < 0, negative, low)
    high = flat.max()
    checks.add(high >= upper, out_of_range, high)
    if distinct and flat.numel() > 1:
        s = torch.sort(flat).values
        dup = ((s[1:] == s[:-1]) & (s[1:] >= 0)).any()
        checks.add(dup, duplicate)


def check_index_range(name: str, idx: torch.Tensor, upper: int, *, allow_negative: bool = True) -> None:
    """Entries of ``idx`` lie in ``[0, upper)`` (negative entries allowed as "no
    row" when ``allow_negative``), and the non-negative ones are distinct. One sync."""
    checks = DeviceChecks()
    check_index_values(checks, name, idx, upper, allow_negative=allow_negative)
    checks.run()


def queue_index_sets(checks: DeviceChecks, sets) -> None:
    """Queue the range and distinctness rules of ``sets`` (``(name, segments,
    rows available)``, a set's rows being all its segments together): in one launch
    when :func:`~kda_engram.validation.index_rules.fits_index_set_rules`, else the
    PyTorch rules per set (:func:`check_index_values`). The same rules in the same
    order with the same messages either way; empty sets queue nothing."""
    sets = [(name, [x if x.dim() == 1 else x.reshape(-1) for x in segments], upper) for name, segments, upper in sets]
    sets = [(name, segments, upper) for name, segments, upper in sets if sum(x.numel() for x in segments)]
    if not sets:
        return
    if fits_index_set_rules(sets):
        index_set_rules(checks, sets)
        return
    for name, segments, upper in sets:
        rows = segments[0] if len(segments) == 1 else torch.cat([x.to(torch.int64) for x in segments])
        check_index_values(checks, name, rows, upper)

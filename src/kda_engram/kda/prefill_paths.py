"""The KDA prefill's paths as registered backends (after fla's ``ops/kda`` backend registry):
the only list of them.

Each path registers a :class:`PrefillBackend` with one call of :func:`register` in its
own module: a verifier ``(call) -> (ok, reason)`` that answers from host facts alone
(:class:`PrefillCall`: no device value is read) whether the path serves the call and,
if not, why in one line; the function that runs the prefill on the path with
:func:`kda_engram.kda.prefill.chunk_kda_prefill`'s results contract; and a
``priority`` that places it in ``path="auto"``'s order (``None``: only ``path=`` takes
it). The registered backends:

* ``"grouped"`` (:mod:`kda_engram.kda.portable_prefill`, priority 30): the portable path where
  its walk cuts the sequences into parallel chunk groups (long sequences on few heads,
  where the groups' parallel walk beats one CTA per sequence and head, Hopper's
  included); it runs as ``path="portable"``;
* ``"hopper"`` (:mod:`kda_engram.kda.hopper.prefill`, priority 20): the folded
  prologue and the Gluon walk on sm_90;
* ``"portable"`` (:mod:`kda_engram.kda.portable_prefill`, priority 10): the Triton prologue and
  walk, on every device the kernels run on; the fallback of ``path="auto"``.

From the registry alone come the ``path=`` values (:func:`path_names`: ``"auto"`` and
every backend that runs as itself), ``path="auto"``'s order (:func:`auto_order`) and the
choice (:func:`serving`). ``chunk_kda_prefill(path=...)``,
:func:`~kda_engram.kda.prefill.prefill_path` and the fla integration's verifier
(:mod:`kda_engram.integrations.fla`) ask it, so they give the same answers in the same
words: a refusal reads ``"the <title> cannot serve this call: it <reason>"``
(:func:`refusal`). A backend's module is imported by :mod:`kda_engram.kda.prefill`
(one line), which registers it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from ..bundles import KDAInputs

__all__ = ["BACKENDS", "PrefillBackend", "PrefillCall", "Verdict", "auto_order", "path_names", "refusal", "register",
           "serving", "unregister", "verify"]

#: ``(ok, reason)``: ``reason`` is ``None`` when ``ok``, else one line that completes
#: "the path cannot serve this call: it ...".
Verdict = tuple[bool, "str | None"]


@dataclass(frozen=True)
class PrefillCall:
    """The host facts of one prefill call that a verifier may read: ``q [B, T, H, K]``
    and ``v [B, T, H, V]`` (their device, dtype, shapes and strides, never their
    values), ``out``, ``cu_seqlens`` (only its size: ``None`` means ``B`` sequences of
    ``T`` tokens), ``groups`` and ``conv_weight`` as :func:`chunk_kda_prefill` takes them;
    ``inputs`` the call's :class:`~kda_engram.bundles.KDAInputs` (their forms: gate,
    ``lower_bound``, dtypes and strides) where the caller has them (``None``: a verifier
    that needs them says no)."""

    q: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    groups: int | None = None
    conv_weight: torch.Tensor | None = None
    inputs: KDAInputs | None = None

    @property
    def num_seqs(self) -> int:
        return self.q.shape[0] if self.cu_seqlens is None else self.cu_seqlens.numel() - 1

    @property
    def tokens(self) -> int:
        """``T`` of the flattened batch."""
        return self.q.shape[0] * self.q.shape[1]


@dataclass(frozen=True)
class PrefillBackend:
    """One registered prefill path.

    ``name``: the registry key; ``path``: the ``path=`` value that runs it (its own name,
    or another backend's: ``"grouped"`` runs as ``"portable"``); ``title``: how a
    refusal names it ("the Hopper path"); ``verify``: the verifier; ``run``: the prefill
    on this path, called by :func:`chunk_kda_prefill` with every argument validated and
    guarded, the chunk metadata built and ``out`` allocated (the keywords of
    :func:`kda_engram.kda.hopper.prefill.hopper_kda_prefill`), returning
    ``(out, final_state | None)``; ``priority``: its place in ``path="auto"``'s order
    (higher is asked first; ``None``: ``path="auto"`` never takes it, how a backend
    ships before its GPU checks pass)."""

    name: str
    path: str
    title: str
    verify: Callable[[PrefillCall], Verdict]
    run: Callable[..., tuple]
    priority: int | None = None


#: The registered backends by name (filled as their modules are imported;
#: :mod:`kda_engram.kda.prefill` imports them all).
BACKENDS: dict[str, PrefillBackend] = {}


def register(backend: PrefillBackend) -> PrefillBackend:
    """Add ``backend`` to :data:`BACKENDS` (a second one of the same name replaces it).
    Two backends in ``path="auto"``'s order may not share a priority (the order would be
    a registration accident): that is a ``ValueError``."""
    if backend.priority is not None:
        for other in BACKENDS.values():
            if other.name != backend.name and other.priority == backend.priority:
                raise ValueError(f"prefill backend {backend.name!r}: priority {backend.priority} is taken by "
                                 f"{other.name!r}")
    BACKENDS[backend.name] = backend
    return backend


def unregister(name: str) -> PrefillBackend:
    """Remove backend ``name`` from :data:`BACKENDS` and return it (a ``KeyError`` if none)."""
    return BACKENDS.pop(name)


def path_names() -> tuple[str, ...]:
    """The values ``path=`` takes: ``"auto"``, then every backend that runs as itself
    (``path == name``), sorted."""
    names = []  # plain loops here and below: these run on every prefill call
    for name, backend in BACKENDS.items():
        if backend.path == name:
            names.append(name)
    names.sort()
    return ("auto", *names)


def auto_order() -> tuple[str, ...]:
    """The backends ``path="auto"`` asks, highest priority first; the first whose
    verifier says yes serves the call, the last (the lowest priority) is the fallback
    whose refusal ``"auto"`` gives when none does."""
    ranked = []
    for backend in BACKENDS.values():
        if backend.priority is not None:
            ranked.append((-backend.priority, backend.name))
    ranked.sort()
    order = []
    for _, name in ranked:
        order.append(name)
    return tuple(order)


def verify(name: str, call: PrefillCall) -> Verdict:
    """The verdict of backend ``name`` on ``call``."""
    return BACKENDS[name].verify(call)


def refusal(name: str, reason: str) -> str:
    """The one-line refusal of backend ``name``: ``"the <title> cannot serve this call: it <reason>"``."""
    return f"{BACKENDS[name].title} cannot serve this call: it {reason}"


def serving(call: PrefillCall, path: str) -> tuple[PrefillBackend | None, str | None]:
    """``(backend, None)``: the backend that serves ``call`` on ``path`` (one of
    :func:`path_names`; for ``"auto"`` the first of :func:`auto_order` whose verifier
    says yes); else ``(None, refusal)`` with the refusal of the last backend asked (for
    ``"auto"``, the fallback's)."""
    name, reason = path, None
    for name in (path,) if path != "auto" else auto_order():
        ok, reason = verify(name, call)
        if ok:
            return BACKENDS[name], None
    return None, refusal(name, reason)

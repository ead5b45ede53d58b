"""The KDA prefill's paths as registered backends (after fla's ``ops/kda`` backend registry).

Each path registers a :class:`PrefillBackend`: a verifier ``(call) -> (ok, reason)``
that answers from host facts alone (:class:`PrefillCall`: no device value is read)
whether the path serves the call and, if not, why in one line, and the function that
runs the prefill on the path with :func:`kda_engram.kda.prefill.chunk_kda_prefill`'s
results contract. The registered backends:

* ``"portable"`` (:mod:`kda_engram.kda.prefill`): the Triton prologue and walk, on every
  device the kernels run on; the fallback of ``path="auto"``;
* ``"grouped"`` (same module): the same path where its walk cuts the sequences into
  parallel chunk groups (long sequences on few heads); it runs as ``path="portable"``;
* ``"hopper"`` (:mod:`kda_engram.kda.hopper.prefill`): the folded prologue and the Gluon
  walk on sm_90.

``chunk_kda_prefill(path=...)``, :func:`~kda_engram.kda.prefill.prefill_path` and the fla
integration's verifier (:mod:`kda_engram.integrations.fla`) ask this registry, so they
give the same answers in the same words: a refusal reads
``"the <title> cannot serve this call: it <reason>"`` (:func:`refusal`). Which backends
``path="auto"`` tries, and in which order, is :func:`kda_engram.kda.prefill.auto_order`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["BACKENDS", "PrefillBackend", "PrefillCall", "Verdict", "refusal", "register", "verify"]

#: ``(ok, reason)``: ``reason`` is ``None`` when ``ok``, else one line that completes
#: "the path cannot serve this call: it ...".
Verdict = tuple[bool, "str | None"]


@dataclass(frozen=True)
class PrefillCall:
    """The host facts of one prefill call that a verifier may read: ``q [B, T, H, K]``
    and ``v [B, T, H, V]`` (their device, dtype, shapes and strides, never their
    values), ``out``, ``cu_seqlens`` (only its size: ``None`` means ``B`` sequences of
    ``T`` tokens), ``groups`` and ``conv_weight`` as :func:`chunk_kda_prefill` takes them."""

    q: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    groups: int | None = None
    conv_weight: torch.Tensor | None = None

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

    ``name``: the registry key; ``path``: the ``path=`` value that runs it (``"grouped"``
    runs as ``"portable"``); ``title``: how a refusal names it ("the Hopper path");
    ``verify``: the verifier; ``run``: the prefill on this path, called by
    :func:`chunk_kda_prefill` with every argument validated and guarded, the chunk
    metadata built and ``out`` allocated (the keywords of
    :func:`kda_engram.kda.hopper.prefill.hopper_kda_prefill`); returns
    ``(out, final_state | None)``."""

    name: str
    path: str
    title: str
    verify: Callable[[PrefillCall], Verdict]
    run: Callable[..., tuple]


#: The registered backends by name (filled as their modules are imported;
#: :mod:`kda_engram.kda.prefill` imports them all).
BACKENDS: dict[str, PrefillBackend] = {}


def register(backend: PrefillBackend) -> PrefillBackend:
    """Add ``backend`` to :data:`BACKENDS` (a second one of the same name replaces it)."""
    BACKENDS[backend.name] = backend
    return backend


def verify(name: str, call: PrefillCall) -> Verdict:
    """The verdict of backend ``name`` on ``call``."""
    return BACKENDS[name].verify(call)


def refusal(name: str, reason: str) -> str:
    """The one-line refusal of backend ``name``: ``"the <title> cannot serve this call: it <reason>"``."""
    return f"{BACKENDS[name].title} cannot serve this call: it {reason}"

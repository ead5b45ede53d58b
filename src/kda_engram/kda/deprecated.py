"""Old names of the KDA entry points, kept as aliases that warn.

``fused_kda_prologue``, ``fused_kda_chunk`` and ``fused_kda_decode_step`` became
:func:`~kda_engram.kda.prologue.kda_prefill_prologue`,
:func:`~kda_engram.kda.chunk.kda_prefill_walk` and
:func:`~kda_engram.kda.fused_decode.kda_layer_decode_step`: every KDA entry point
is fused, so the prefix said nothing; the new names say which stage each runs.
"""

from __future__ import annotations

import functools
import warnings

__all__ = ["deprecated_alias"]


def deprecated_alias(fn, old_name: str, new_path: str):
    """``fn`` under its old name: same call, plus a ``DeprecationWarning`` naming
    ``new_path`` (where the function lives now)."""

    @functools.wraps(fn)
    def alias(*args, **kwargs):
        warnings.warn(f"{old_name} is deprecated; use {new_path}", DeprecationWarning, stacklevel=2)
        return fn(*args, **kwargs)

    alias.__name__ = alias.__qualname__ = old_name
    alias.__doc__ = f"Deprecated alias of :func:`{new_path}` (same arguments)."
    return alias

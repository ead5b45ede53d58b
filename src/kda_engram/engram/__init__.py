"""DeepSeek Engram's kernels: hashed n-gram memory, its tables, and the (dim-sharded)
gate. The ``nn.Module``s are in :mod:`kda_engram.layers` (``Engram``, the gate module,
and ``shards_engram_gate``, its policy: :mod:`kda_engram.layers.engram_gate`); this
package still answers for those two names, importing them only when asked (importing
the family imports no layer).

Importing this package compiles nothing: Triton kernels are built on first use.
On a machine without a GPU set ``TRITON_INTERPRET=1`` before importing.
"""

from .gate import engram_post_wkv
from .hashing import CompressedTokenMap, build_compressed_token_map, ngram_hash, next_history
from .layout import EngramLayout
from .reference import naive_engram_gate_sharded, naive_engram_post_wkv
from .sharded_gate import engram_gate_finish, engram_gate_partials
from .table import EngramTable, quantize_fp8_ue8m0

__all__ = [
    "CompressedTokenMap",
    "Engram",
    "EngramLayout",
    "EngramTable",
    "build_compressed_token_map",
    "engram_gate_finish",
    "engram_gate_partials",
    "engram_post_wkv",
    "naive_engram_gate_sharded",
    "naive_engram_post_wkv",
    "next_history",
    "ngram_hash",
    "quantize_fp8_ue8m0",
    "shards_engram_gate",
]


def __getattr__(name):
    # The names that moved up to the layers keep this import path (tests/test_layering.py
    # allows this one upward import, lazy).
    if name in ("Engram", "shards_engram_gate"):
        from ..layers import engram_gate

        return getattr(engram_gate, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

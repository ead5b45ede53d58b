"""DeepSeek Engram: hashed n-gram memory, its tables, and the (dim-sharded) gate.

Importing this package compiles nothing: Triton kernels are built on first use.
On a machine without a GPU set ``TRITON_INTERPRET=1`` before importing.
"""

from .gate import engram_post_wkv
from .hashing import CompressedTokenMap, build_compressed_token_map, ngram_hash, next_history
from .layout import EngramLayout
from .module import Engram, shards_engram_gate
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

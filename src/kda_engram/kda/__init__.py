"""Kimi Delta Attention: decode, the two-launch chunked prefill, metadata and references.

Entry points: :func:`chunk_kda_prefill` (the prefill: :func:`kda_prefill_prologue`
then :func:`kda_prefill_walk`), :func:`kda_decode`, :func:`kda_decode_multi` and
:func:`kda_layer_decode_step` (the layer's whole decode step in one launch).

Importing this package compiles nothing: Triton kernels are built on first use.
On a machine without a GPU set ``TRITON_INTERPRET=1`` before importing, so the
kernels run under the Triton interpreter.
"""

from ..constants import CHUNK_SIZE
from .chunk import KDA_CHECKPOINT_ALIGNMENT, kda_prefill_walk
from .decode import kda_decode, kda_decode_multi
from .fused_decode import kda_layer_decode_step
from .metadata import prepare_chunk_indices, prepare_chunk_metadata, prepare_chunk_offsets
from .prefill import chunk_kda_prefill
from .prologue import kda_prefill_prologue
from .reference import kda_gate, naive_chunk_kda, naive_group_chunk_kda, naive_recurrent_kda
from .state_dtype import STATE_DTYPES

__all__ = [
    "CHUNK_SIZE",
    "KDA_CHECKPOINT_ALIGNMENT",
    "STATE_DTYPES",
    "chunk_kda_prefill",
    "kda_decode",
    "kda_decode_multi",
    "kda_gate",
    "kda_layer_decode_step",
    "kda_prefill_prologue",
    "kda_prefill_walk",
    "naive_chunk_kda",
    "naive_group_chunk_kda",
    "naive_recurrent_kda",
    "prepare_chunk_indices",
    "prepare_chunk_metadata",
    "prepare_chunk_offsets",
]

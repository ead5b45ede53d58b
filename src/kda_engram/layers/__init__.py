"""Serving layers: the KDA mixer and the whole Engram layer, built on the
``torch.ops.kda_engram`` custom ops so that a step is CUDA-graph capturable and
``torch.compile(fullgraph=True)``-able."""

from .engram import EngramBatch, EngramLayer, engram_hash_step
from .kda import KimiDeltaAttention
from .kda_batch import KDABatch

__all__ = ["EngramBatch", "EngramLayer", "KDABatch", "KimiDeltaAttention", "engram_hash_step"]

"""Serving layers: the KDA mixer (``kda.py``, its batch ``kda_batch.py``, its
checkpoint ``kda_weights.py``) and the whole Engram layer (``engram.py``, its gate
module ``engram_gate.py``), built on the ``torch.ops.kda_engram`` custom ops so that a
step is CUDA-graph capturable and ``torch.compile(fullgraph=True)``-able."""

from .engram import EngramBatch, EngramLayer, engram_hash_step
from .engram_gate import Engram
from .kda import KimiDeltaAttention
from .kda_batch import KDABatch

__all__ = ["Engram", "EngramBatch", "EngramLayer", "KDABatch", "KimiDeltaAttention", "engram_hash_step"]

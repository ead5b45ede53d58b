"""kda-engram: Triton kernels and PyTorch layers for serving Kimi Delta Attention
(KDA) and DeepSeek Engram.

Subpackages: :mod:`kda_engram.kda` (decode, two-launch chunked prefill),
:mod:`kda_engram.engram` (hashing, tables, the gate and its dim-sharded
tensor-parallel form), :mod:`kda_engram.parallel` (a tensor-parallel group on
``torch.distributed``), :mod:`kda_engram.platform` (device facts).
"""

__version__ = "0.1.0"

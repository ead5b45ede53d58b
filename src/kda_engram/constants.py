"""Numeric constants shared by the kernels, the references and the argument rules.

Defined once here (the bottom layer: no package imports, torch only), so kernels never take
them from a reference module.
"""

from __future__ import annotations

import math

import torch

#: Tokens per chunk of the KDA chunk form (prologue, chunk walk, chunk metadata).
CHUNK_SIZE = 64
#: Rows of one intra-chunk sub-block in the prologue (four per chunk).
SUB_CHUNK = 16
#: The widest decay span (log2 units) inside one sub-chunk that the factored (anchored)
#: products take: their factors reach ``2^span`` and ``2^-span`` and must stay normal
#: fp32 / bf16 numbers (2^-126). A bounded gate stays within it for ``|L| <= 5.459``
#: (``SUB_CHUNK |L| log2 e``); a sub-chunk past it takes the exact diagonal sums.
MAX_ANCHOR_SPAN = 126.0
#: Checkpoint offsets must be multiples of this: a snapshot is taken at a chunk end.
KDA_CHECKPOINT_ALIGNMENT = CHUNK_SIZE
#: Head dims (K and V) the chunk kernels compile for; 128 in the model.
KDA_HEAD_DIMS = (16, 32, 64, 128)
#: Largest power-of-two head dim the decode kernel takes.
DECODE_MAX_HEAD_DIM = 256
#: Taps of the KDA short convolution (the state keeps CONV_WIDTH - 1 inputs).
CONV_WIDTH = 4
#: log2(e): the kernels keep the gate cumsum in log2 units (exp2 is the fast path).
LOG2E = math.log2(math.e)
#: The epsilon inside the L2 norm of q and k: ``x / sqrt(sum x^2 + L2NORM_EPS)``.
L2NORM_EPS = 1e-6
#: Largest grid dimension 1 or 2 of one CUDA launch (sequences, heads).
MAX_GRID_DIM = 65535
#: Storage dtypes of a KDA recurrent state (cache, initial/final state, checkpoints);
#: the arithmetic on chip is always fp32.
STATE_DTYPES = (torch.float32, torch.bfloat16)

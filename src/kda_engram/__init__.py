"""kda-engram: Triton kernels and PyTorch layers for serving Kimi Delta Attention
(KDA) and DeepSeek Engram.

Subpackages: :mod:`kda_engram.kda` (decode, two-launch chunked prefill),
:mod:`kda_engram.engram` (hashing, tables, the gate and its dim-sharded
tensor-parallel form), :mod:`kda_engram.ops` (the kernels as ``torch.ops``),
:mod:`kda_engram.layers` (the serving ``nn.Module``s: the KDA layer, the Engram layer
and its gate module), :mod:`kda_engram.validation` (the argument rules),
:mod:`kda_engram.parallel` (a tensor-parallel group on ``torch.distributed``),
:mod:`kda_engram.platform` (device facts). ``docs/design/README.md`` maps the rooms.
"""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy, so that importing the package (the CLI's --version) does not import torch.
    if name == "raise_pending_errors":
        from .validation.entry import raise_pending_errors

        return raise_pending_errors
    raise AttributeError(f"module 'kda_engram' has no attribute {name!r}")


__all__ = ["raise_pending_errors"]

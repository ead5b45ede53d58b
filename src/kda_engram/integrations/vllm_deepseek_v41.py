"""vLLM 0.33's DeepSeek-V4.1 Engram gate launch, on kda-engram's fused gate.

``vllm/models/deepseek_v41/common/engram.py``'s ``Engram.forward`` launches its
post-``wkv`` gate kernel directly: ``_fused_engram_post_wkv_kernel[(T * hc,)](...)``.
:data:`fused_engram_post_wkv_kernel` takes that launch, with its exact arguments,
and runs :func:`kda_engram.engram.gate.engram_post_wkv` instead, so
:mod:`kda_engram.integrations.vllm_plugin` can put it under that name. No vLLM import.

vLLM's conventions, adapted here (on the device, no host sync):

* the sequence-parallel ``token_mask`` has ``num_kv_tokens`` rows (the rank's
  share of the tokens), possibly fewer than the ``T`` rows of ``hidden_states``;
  ours takes ``[T]``: padded with false (rows ``>= num_kv_tokens`` pass
  ``hidden`` through either way);
* a non-bool mask counts as true where non-zero (the kernel's ``tl.where``).

The stride arguments must be the tensors' own (they are, as vLLM passes them): the
fused gate reads each tensor through its strides itself.
"""

from __future__ import annotations

import torch

from ..engram.gate import engram_post_wkv

__all__ = ["fused_engram_post_wkv", "fused_engram_post_wkv_kernel"]

_STRIDES = (
    ("hidden_states", "hidden_stride_t", 0), ("hidden_states", "hidden_stride_h", 1),
    ("hidden_states", "hidden_stride_d", 2), ("kv", "kv_stride_t", 0), ("kv", "kv_stride_d", 1),
    ("q_weight", "q_stride_h", 0), ("q_weight", "q_stride_d", 1), ("k_weight", "k_stride_h", 0),
    ("k_weight", "k_stride_d", 1), ("output", "output_stride_t", 0), ("output", "output_stride_h", 1),
    ("output", "output_stride_d", 2),
)


def fused_engram_post_wkv(
    grid,
    hidden_states: torch.Tensor,
    kv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    token_mask: torch.Tensor,
    output: torch.Tensor,
    num_kv_tokens: int,
    hidden_stride_t: int,
    hidden_stride_h: int,
    hidden_stride_d: int,
    kv_stride_t: int,
    kv_stride_d: int,
    q_stride_h: int,
    q_stride_d: int,
    k_stride_h: int,
    k_stride_d: int,
    mask_stride: int,
    output_stride_t: int,
    output_stride_h: int,
    output_stride_d: int,
    eps: float,
    clamp_value: float,
    *,
    DIM: int,
    HC_MULT: int,
    BLOCK_SIZE: int,
    HAS_MASK: bool,
    num_warps: int | None = None,
) -> None:
    """vLLM's launch ``_fused_engram_post_wkv_kernel[grid](...)``, served by
    :func:`~kda_engram.engram.gate.engram_post_wkv`.

    ``hidden_states`` / ``output``: ``[T, hc, dim]``; ``kv``: ``[>= num_kv_tokens,
    (hc+1)*dim]`` (``hc`` keys, then the value); ``q_weight``, ``k_weight``:
    ``[hc, dim]``; ``token_mask`` (read when ``HAS_MASK``): ``[num_kv_tokens]`` or
    ``[T]``, false rows pass ``hidden`` through. Rows ``t >= num_kv_tokens`` pass
    ``hidden`` through. ``grid`` must be ``(T * hc,)``; ``BLOCK_SIZE`` and
    ``num_warps`` are vLLM's launch choices (ours are its own). Writes ``output``.
    """
    T, hc, dim = hidden_states.shape
    if tuple(grid) != (T * hc,):
        raise ValueError(f"grid: expected (T * hc,) = ({T * hc},), got {tuple(grid)}")
    if (DIM, HC_MULT) != (dim, hc):
        raise ValueError(f"DIM, HC_MULT: expected hidden_states' dim and hc ({dim}, {hc}), got ({DIM}, {HC_MULT})")
    given = locals()
    for tensor, name, axis in _STRIDES:
        if given[name] != given[tensor].stride(axis):
            raise ValueError(f"{name}: expected {tensor}.stride({axis}) = {given[tensor].stride(axis)}, "
                             f"got {given[name]}")
    mask = None
    if HAS_MASK:
        if token_mask.dim() != 1 or mask_stride != token_mask.stride(0):
            raise ValueError(f"token_mask: expected a 1-D mask with stride mask_stride={mask_stride}, got shape "
                             f"{list(token_mask.shape)} strides {list(token_mask.stride())}")
        mask = token_mask[:T] if token_mask.dtype == torch.bool else token_mask[:T] != 0
        if mask.shape[0] < T:
            mask = torch.cat([mask, mask.new_zeros(T - mask.shape[0])])
    engram_post_wkv(hidden_states, kv, q_weight, k_weight, eps=float(eps), clamp_value=float(clamp_value),
                    token_mask=mask, num_kv_tokens=int(num_kv_tokens), out=output)


class _Launch:
    """``kernel[grid]`` -> a launch of :func:`fused_engram_post_wkv` on that grid."""

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            return fused_engram_post_wkv(grid, *args, **kwargs)

        return launch

    def __repr__(self) -> str:
        return "kda_engram.integrations.vllm_deepseek_v41.fused_engram_post_wkv_kernel"


#: What ``Engram.forward`` launches as ``_fused_engram_post_wkv_kernel[grid](...)``.
fused_engram_post_wkv_kernel = _Launch()

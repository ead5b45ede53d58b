"""vLLM 0.33's DeepSeek-V4.1 Engram kernel launches, on kda-engram's kernels.

``vllm/models/deepseek_v41/common/engram.py`` launches its Triton kernels
directly, ``kernel[grid](...)``; each launch here takes the same arguments and
runs ours instead, so :mod:`kda_engram.integrations.vllm_plugin` can put it under
that name. No vLLM import.

* :data:`fused_engram_post_wkv_kernel`: ``Engram.forward``'s post-``wkv`` gate
  ``_fused_engram_post_wkv_kernel[(T * hc,)](...)``, on
  :func:`kda_engram.engram.gate.engram_post_wkv`;
* :data:`hash_ids_kernel`: ``NgramHashState.forward``'s
  ``_hash_ids_kernel[(cdiv(T, 32), n_layers)](...)``, in one launch that hashes as
  :mod:`kda_engram.engram.hashing` does (see :func:`hash_ids` for the conventions).

And the dim-sharded gate inside vLLM's ``Engram`` (:func:`engram_init`,
:func:`engram_forward`, replacing ``Engram.__init__`` and ``Engram.forward``):
with tensor parallelism on and no sequence parallelism, vLLM all-gathers the
whole ``wkv`` projection (``gather_output=True``, ``(hc+1)*dim`` elements per
token); here ``wkv`` keeps its local output (``gather_output=False``), its weight
loader takes each rank's slice of every key and of the value
(:func:`wkv_dim_shard_loader`), and the ranks exchange value slices and gate
partial sums instead (:mod:`kda_engram.engram.sharded_gate`).

The gate's conventions, adapted here (on the device, no host sync):

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

import sys

from .. import ops
from ..engram.gate import engram_post_wkv
from ..engram.sharded_gate import engram_gate_finish, engram_gate_partials
from ..parallel import merged_column_parallel_shard
from .vllm_engram_history import vllm_engram_hash

__all__ = [
    "engram_forward", "engram_init", "fused_engram_post_wkv", "fused_engram_post_wkv_kernel", "hash_ids",
    "hash_ids_kernel", "shard_engram_wkv", "wkv_dim_shard_loader",
]

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
    _check_strides(locals(), _STRIDES)
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


def _check_strides(given: dict, strides) -> None:
    """Each ``(tensor, argument, axis)``: the stride argument is the tensor's own."""
    for tensor, name, axis in strides:
        if given[tensor] is not None and given[name] != given[tensor].stride(axis):
            raise ValueError(f"{name}: expected {tensor}.stride({axis}) = {given[tensor].stride(axis)}, "
                             f"got {given[name]}")


_HASH_STRIDES = (
    ("input_ids", "input_stride", 0), ("dead_mask", "mask_stride", 0), ("positions", "position_stride", 0),
    ("block_table", "table_stride", 0), ("block_table", "table_col_stride", 1),
    ("query_start_loc", "query_stride", 0), ("lookback_token_ids", "lookback_row_stride", 0),
    ("lookback_token_ids", "lookback_col_stride", 1), ("lookback_dead_mask", "lookback_mask_row_stride", 0),
    ("lookback_dead_mask", "lookback_mask_col_stride", 1),
)


def hash_ids(
    grid,
    input_ids: torch.Tensor,
    token_map: torch.Tensor,
    dead_mask: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    multipliers: torch.Tensor,
    primes: torch.Tensor,
    offsets: torch.Tensor,
    cache: torch.Tensor | None,
    lookback_token_ids: torch.Tensor,
    lookback_dead_mask: torch.Tensor,
    output: torch.Tensor,
    num_tokens: int,
    num_slots: int,
    pad_id: int,
    input_stride: int,
    mask_stride: int,
    position_stride: int,
    table_stride: int,
    table_col_stride: int,
    query_stride: int,
    num_query_rows: int,
    num_table_rows: int,
    max_blocks: int,
    cache_block_size: int,
    MAX_NGRAM: int,
    num_heads: int,
    BLOCK_T: int,
    BLOCK_H: int,
    dead_id: int,
    lookback_depth: int,
    lookback_row_stride: int,
    lookback_col_stride: int,
    lookback_mask_row_stride: int,
    lookback_mask_col_stride: int,
    num_warps: int | None = None,
) -> None:
    """vLLM's launch ``_hash_ids_kernel[grid](...)``, served by one launch that hashes
    as kda-engram's n-gram hash kernel does (:func:`kda_engram.engram.hashing.launch_ngram_hash`).

    Shapes (vLLM's): ``input_ids`` ``[T]`` raw ids; ``token_map`` ``[vocab]`` raw ->
    compressed; ``dead_mask`` bool ``[T]``; ``positions`` ``[T]``;
    ``query_start_loc`` ``[R+1]`` (repeated boundaries: zero-length padding
    requests); ``multipliers`` int64 ``[L, MAX_NGRAM]``; ``primes`` int64 ``[L,
    MAX_NGRAM-1, num_heads]``; ``offsets`` int64 ``[L, n_hash_cols]``;
    ``lookback_token_ids`` / ``lookback_dead_mask`` ``[R, depth]``, **newest
    first** (column 0 is the position right before the request's chunk);
    ``cache`` (V1 runner) int32 ``[num_slots]`` of compressed ids or ``dead_id``,
    addressed through ``block_table`` ``[rows, max_blocks]``, or ``None`` (V2).
    Writes ``output`` int32 ``[T, L, n_hash_cols]``. ``grid`` must be
    ``(cdiv(T, BLOCK_T), L)``.

    vLLM's contract, exactly: token ``t`` belongs to the first request whose end
    ``query_start_loc[r+1]`` exceeds ``t``, and **tokens past the last end
    (CUDA-graph padding) belong to the last request**. With ``p = positions[t]``,
    ``cs`` the position of the request's first token, the n-gram reads for lag
    ``s``: the batch token ``t - s`` when ``p - s >= cs`` (membership by
    *position*, source by *index*); else the lookback column ``cs - 1 - (p - s)``
    when it is inside the window and its id is ``>= 0``; else the slot cache
    (V1) or the pad id (V2). **An unknown (``-1``) lookback id reads as pad but
    older ids still count**; a dead token (``dead_mask``, ``lookback_dead_mask``,
    a cache ``dead_id``) or a position ``< 0`` reads as pad and hides every older
    one.

    Our n-gram hash kernel decides membership by *index* inside ``cu_seqlens`` and
    reads a ``history`` row oldest first; vLLM's position-based membership (which
    matters for padding tokens, whose positions need not follow their request's)
    has no equivalent there. So one launch of its own
    (:func:`~kda_engram.integrations.vllm_engram_history.vllm_engram_hash`) selects
    each lag's id by vLLM's rules and hashes it on the spot as ours does (the XOR
    of id x multiplier, the cumulative blocking to pad, the modulo by each head's
    prime and the bucket offsets): one launch as vLLM's, no host sync.
    """
    C = (MAX_NGRAM - 1) * num_heads
    if output.dim() != 3 or output.shape[0] != input_ids.shape[0] or output.shape[2] != C:
        raise ValueError(f"output: expected [T, L, (MAX_NGRAM-1)*num_heads] = [{input_ids.shape[0]}, L, "
                         f"{C}], got {list(output.shape)}")
    L, T = output.shape[1], int(num_tokens)
    if T != input_ids.shape[0]:
        raise ValueError(f"num_tokens: expected input_ids.shape[0] = {input_ids.shape[0]}, got {num_tokens}")
    for name, tensor in (("input_ids", input_ids), ("dead_mask", dead_mask), ("positions", positions)):
        if tensor.dim() != 1 or tensor.shape[0] < T:
            raise ValueError(f"{name}: expected [num_tokens] = [{T}], got {list(tensor.shape)}")
    if tuple(grid) != (-(-T // BLOCK_T), L):
        raise ValueError(f"grid: expected (cdiv(T, BLOCK_T), L) = ({-(-T // BLOCK_T)}, {L}), got {tuple(grid)}")
    if tuple(multipliers.shape) != (L, MAX_NGRAM) or primes.numel() != L * C or offsets.numel() != L * C:
        raise ValueError(f"multipliers, primes, offsets: expected [L, MAX_NGRAM] = [{L}, {MAX_NGRAM}] and "
                         f"{L * C} elements each, got {list(multipliers.shape)}, {list(primes.shape)}, "
                         f"{list(offsets.shape)}")
    if num_query_rows != query_start_loc.numel() - 1 or num_query_rows < 1:
        raise ValueError(f"num_query_rows: expected query_start_loc.numel() - 1 >= 1, got {num_query_rows} for "
                         f"{query_start_loc.numel()} boundaries")
    if (lookback_token_ids.dim() != 2 or lookback_token_ids.shape[0] < num_query_rows
            or lookback_depth != lookback_token_ids.shape[1] or lookback_dead_mask.shape != lookback_token_ids.shape):
        raise ValueError(f"lookback_token_ids, lookback_depth, lookback_dead_mask: expected [>= num_query_rows = "
                         f"{num_query_rows}, lookback_depth] each, got {list(lookback_token_ids.shape)}, "
                         f"{lookback_depth} and {list(lookback_dead_mask.shape)}")
    if cache is not None and (block_table is None or block_table.shape[0] < 1 or block_table.shape[1] < 1
                              or (num_slots, num_table_rows, max_blocks) != (cache.shape[0], *block_table.shape)):
        raise ValueError("cache, block_table: the slot cache needs a non-empty block table, num_slots = "
                         "cache.shape[0] and (num_table_rows, max_blocks) = block_table.shape")
    _check_strides(locals(), _HASH_STRIDES)
    if T == 0:
        return
    vllm_engram_hash(input_ids, token_map, dead_mask, positions, query_start_loc, lookback_token_ids,
                     lookback_dead_mask, multipliers.contiguous(), primes.contiguous(), offsets.contiguous(), output,
                     max_ngram=MAX_NGRAM, n_heads=num_heads, pad_id=int(pad_id), cache=cache,
                     block_table=block_table, cache_block_size=int(cache_block_size), dead_id=int(dead_id))


class _Launch:
    """``kernel[grid]`` -> a launch of ``function`` on that grid."""

    def __init__(self, function, name: str) -> None:
        self.function, self.name = function, name

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            return self.function(grid, *args, **kwargs)

        return launch

    def __repr__(self) -> str:
        return f"kda_engram.integrations.vllm_deepseek_v41.{self.name}"


#: What ``Engram.forward`` launches as ``_fused_engram_post_wkv_kernel[grid](...)``.
fused_engram_post_wkv_kernel = _Launch(fused_engram_post_wkv, "fused_engram_post_wkv_kernel")
#: What ``NgramHashState.forward`` launches as ``_hash_ids_kernel[grid](...)``.
hash_ids_kernel = _Launch(hash_ids, "hash_ids_kernel")


# ----------------------------------------------------------- the dim-sharded gate


def _engram_module(layer):
    """The module that defines vLLM's ``Engram`` (its distributed names are read there,
    as ``Engram.forward`` reads them)."""
    return sys.modules[type(layer).__module__]


def wkv_dim_shard_loader(hc: int, dim: int, rank: int, tp_size: int):
    """A vLLM weight loader ``loader(param, loaded_weight)`` for the dim-sharded
    ``wkv``: from the checkpoint's full ``[(hc+1)*dim, in]`` weight, rank ``rank``
    keeps rows ``[j*dim + rank*width, j*dim + (rank+1)*width)`` of each block ``j``
    (``hc`` keys, then the value; ``width = dim / tp_size``), concatenated in block
    order: ``param`` is ``[(hc+1)*width, in]``. vLLM's plain column-parallel loader
    would keep the contiguous rows ``[rank*(hc+1)*width, ...)`` instead."""

    def load(param, loaded_weight):
        shard = merged_column_parallel_shard(loaded_weight, [dim] * (hc + 1), rank, tp_size)
        if tuple(shard.shape) != tuple(param.shape):
            raise ValueError(f"loaded_weight: rank {rank}'s dim shard is {list(shard.shape)}, the wkv "
                             f"parameter {list(param.shape)}")
        param.data.copy_(shard)

    return load


def shard_engram_wkv(layer) -> bool:
    """Switch a built vLLM ``Engram`` (weights not loaded yet) to the dim-sharded gate
    where it applies; ``True`` when it did.

    Applies with tensor parallelism over ``P > 1`` ranks, no sequence parallelism
    (there ``wkv`` is not sharded), ``dim`` divisible by ``P`` with a slice the
    packed partials can align (``width * element_size`` a multiple of 4 bytes) and
    an unquantized ``wkv`` (its only parameter ``weight``, ``[(hc+1)*dim/P, in]``:
    a quantized one's scales follow vLLM's plain layout, so it keeps vLLM's path).
    Then ``wkv.gather_output`` is turned off and ``wkv.weight``'s loader becomes
    :func:`wkv_dim_shard_loader`'s."""
    engram = _engram_module(layer)
    P = engram.get_tensor_model_parallel_world_size()
    wkv, hc, dim = layer.wkv, layer.hc_mult, layer.dim
    if P <= 1 or layer.use_sequence_parallel or dim % P:
        return False
    params = dict(wkv.named_parameters())
    weight = params.get("weight")
    if set(params) != {"weight"} or not weight.is_floating_point() or weight.shape[0] * P != (hc + 1) * dim:
        return False
    if (dim // P) * weight.element_size() % 4:
        return False
    rank = engram.get_tensor_model_parallel_rank()
    weight.weight_loader = wkv_dim_shard_loader(hc, dim, rank, P)
    wkv.gather_output = False
    layer.kda_engram_dim_sharded = True
    return True


def engram_init(self, *args, **kwargs) -> None:
    """``Engram.__init__`` with the plugin on: vLLM's own, then
    :func:`shard_engram_wkv`."""
    from .vllm_plugin import original

    original(f"{_ENGRAM_MODULE}.Engram.__init__")(self, *args, **kwargs)
    shard_engram_wkv(self)


def engram_forward(self, hidden_states: torch.Tensor, hash_ids: torch.Tensor,
                   token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``Engram.forward`` with the plugin on: a layer :func:`shard_engram_wkv`
    switched runs the dim-sharded gate; any other runs vLLM's own forward.

    ``hidden_states`` ``[T, hc, dim]`` (every rank holds every token: no sequence
    parallelism), ``hash_ids`` ``[T, n_hash_cols]``, ``token_mask`` bool ``[T]`` or
    ``None`` (false rows pass ``hidden`` through). ``wkv`` gives this rank's
    ``[T, (hc+1)*width]``; :func:`~kda_engram.engram.sharded_gate.engram_gate_partials`
    packs its value slice and partial sums, vLLM's
    ``tensor_model_parallel_all_gather`` (dim 0, rank-major) exchanges them and
    :func:`~kda_engram.engram.sharded_gate.engram_gate_finish` writes the output,
    the same bits on every rank."""
    if not getattr(self, "kda_engram_dim_sharded", False):
        from .vllm_plugin import original

        return original(f"{_ENGRAM_MODULE}.Engram.forward")(self, hidden_states, hash_ids, token_mask)
    engram = _engram_module(self)
    T = hash_ids.shape[0]
    if hidden_states.dim() != 3 or hidden_states.shape[0] != T:
        raise ValueError(f"hidden_states: expected [T, hc, dim] with T = hash_ids.shape[0] = {T} (no sequence "
                         f"parallelism), got {list(hidden_states.shape)}")
    if self._batch is not None:
        kv_local = self.wkv(self._batch.wkv_input(self, T))
    else:
        kv_local = self.wkv(self.embed(hash_ids).flatten(-2))
    P, rank = engram.get_tensor_model_parallel_world_size(), engram.get_tensor_model_parallel_rank()
    # While torch.compile traces: the same entry points as custom ops (host rules only).
    partials, finish = ((ops.engram_gate_partials, ops.engram_gate_finish) if torch.compiler.is_compiling()
                        else (engram_gate_partials, engram_gate_finish))
    send = partials(hidden_states, kv_local, self.q_weight, self.k_weight, rank=rank, tp_size=P)
    gathered = engram.tensor_model_parallel_all_gather(send, dim=0)
    return finish(hidden_states, gathered, tp_size=P, eps=self.eps, clamp_value=self.clamp_value,
                  token_mask=token_mask)


_ENGRAM_MODULE = "vllm.models.deepseek_v41.common.engram"

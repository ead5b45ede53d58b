"""Engram embedding tables: bf16 or fp8 storage, a dequantising gather, TP head
sharding and host-resident tables.

One :class:`EngramTable` holds one Engram layer's table: ``n_hash_cols``
column tables of prime sizes, concatenated (rows ``[offset[c], offset[c] +
size[c])`` belong to hash column ``c``; :class:`~kda_engram.engram.layout.EngramLayout`
gives the sizes), each row ``head_dim`` values. DeepSeek-V4.1-Flash's tables
have 384M rows of 256 values per layer: 196 GB in bf16, 101 GB in fp8. Hence:

* **fp8 storage**: e4m3 values with one power-of-two (ue8m0) scale per 32
  values, 1.03 bytes a value instead of 2. Stored as raw bytes (``uint8``).
  NVIDIA GPUs from compute capability 8.9 decode them with their e4m3fn
  conversion instruction; elsewhere (AMD CDNA3, whose native fp8 is the
  different e4m3fnuz, older GPUs, the Triton interpreter) the kernel rebuilds
  the fp32 bits with integer ops (:func:`native_fp8_decode`,
  ``EngramTable.fp8_decode``). Both are exact, and the scale is applied as an
  exact power of two, loaded once per 32 values. ``weight.view(torch.float8_e4m3fn)``
  is the fp8 view. Scale bytes are biased exponents ``e + 127``; byte 0 decodes
  as 0 and e4m3's NaN pattern as NaN (native) or 480 (integer rebuild); the
  quantiser produces neither.
* **TP head sharding**: rank ``r`` of ``P`` owns the contiguous hash columns
  ``[r*C//P, (r+1)*C//P)`` and stores only their rows (which are contiguous in
  the layer table). :meth:`EngramTable.lookup_local` gathers its columns,
  :meth:`EngramTable.lookup_gathered` all-gathers them along columns, and
  :meth:`EngramTable.lookup` writes the full width with zeros in the columns
  other ranks own.
* **Host-resident tables**: the table lives in pinned host memory and the GPU
  gathers only the rows a batch needs, as the Engram paper serves a
  100B-parameter table. ``"zero_copy"``: the same gather kernel reads the host
  rows directly over PCIe/NVLink-C2C through unified virtual addressing (the
  device pointer of pinned memory is its host pointer), no host sync, graph
  capturable. ``"staged"``: the rows are read back to the host, gathered there
  in one ``index_select`` into a pinned buffer and sent in one asynchronous
  copy (this syncs on the rows; it is the fallback where zero-copy is not
  available, and the path the CPU tests run).

The gather moves ``T * C * head_dim`` values in and out and does nothing else;
its floor is memory bandwidth (random 512-byte rows: whole DRAM bursts).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from ..validation.common import check_tensor
from ..validation.entry import EntryChecks
from ..validation.engram import check_column_sizes, check_finite_weight, check_table_lookup
from .layout import EngramLayout
from ..platform import interpreting, is_amd, num_compute_units

SCALE_BLOCK = 32
FP8_MAX = 448.0
_STORAGE = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp8": torch.uint8,
}
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_QUANT_CHUNK_ROWS = 1 << 16


@triton.jit
def _engram_gather_kernel(
    rows_ptr,
    rows_stride_t,
    rows_stride_c,
    w_ptr,
    w_stride,
    s_ptr,
    s_stride,
    out_ptr,
    out_stride_t,
    out_stride_c,
    n_items,
    out_cols,
    rows_col_base,
    own_lo,
    own_hi,
    row_lo,
    row_hi,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    FP8: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    BLOCK_S: tl.constexpr,
    NATIVE_FP8: tl.constexpr,
):
    """BLOCK_R (token, column) items per program; item i = t * out_cols + oc.

    Output column ``oc`` reads rows column ``oc + rows_col_base``; only
    columns in ``[own_lo, own_hi)`` are looked up, and only rows in ``[row_lo,
    row_hi)`` (the rows this table stores, at ``row - row_lo``); everything else
    is written as zeros, so no row outside the table is ever read.
    """
    pid = tl.program_id(0)
    i = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    imask = i < n_items
    t = i // out_cols
    oc = i % out_cols
    owned = imask & (oc >= own_lo) & (oc < own_hi)
    row = tl.load(rows_ptr + t * rows_stride_t + (oc + rows_col_base) * rows_stride_c, mask=owned, other=-1)
    row = row.to(tl.int64)
    valid = owned & (row >= row_lo) & (row < row_hi)
    local = tl.where(valid, row - row_lo, 0)
    if FP8:
        # [items, scale blocks, values per block]: each scale byte is loaded
        # once and broadcast over its 32 values. BLOCK_S is HEAD_DIM / 32
        # rounded up to a power of two; only a padded axis needs a mask.
        s_i = tl.arange(0, BLOCK_S)
        e_i = tl.arange(0, SCALE_BLOCK)
        col = s_i[None, :, None] * SCALE_BLOCK + e_i[None, None, :]
        s_valid = valid[:, None]
        out_mask = imask[:, None, None]
        if BLOCK_S != HEAD_DIM // SCALE_BLOCK:
            smask = s_i < HEAD_DIM // SCALE_BLOCK
            s_valid = s_valid & smask[None, :]
            out_mask = out_mask & smask[None, :, None]
        x = tl.load(w_ptr + local[:, None, None] * w_stride + col, mask=s_valid[:, :, None], other=0)
        if NATIVE_FP8:
            val = x.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            # e4m3fn bits -> fp32 bits: normal numbers rebias the exponent (7 -> 127)
            # and move the 3 mantissa bits to the top; subnormals are mant * 2^-9.
            b = x.to(tl.int32)
            e = (b >> 3) & 15
            mant = b & 7
            normal = (((e + 120) << 23) | (mant << 20)).to(tl.float32, bitcast=True)
            mag = tl.where(e == 0, mant.to(tl.float32) * 0.001953125, normal)
            val = tl.where((b & 128) != 0, -mag, mag)
        sb = tl.load(s_ptr + local[:, None] * s_stride + s_i[None, :], mask=s_valid, other=0)
        scale = (sb.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2^(sb - 127), exact
        tl.store(
            out_ptr + t[:, None, None] * out_stride_t + oc[:, None, None] * out_stride_c + col,
            (val * scale[:, :, None]).to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        x = tl.load(w_ptr + local[:, None] * w_stride + d[None, :], mask=valid[:, None] & dmask[None, :], other=0)
        tl.store(
            out_ptr + t[:, None] * out_stride_t + oc[:, None] * out_stride_c + d[None, :],
            x.to(out_ptr.dtype.element_ty),
            mask=imask[:, None] & dmask[None, :],
        )


def native_fp8_decode(device: torch.device) -> bool:
    """Whether the gather decodes e4m3fn with the GPU's conversion instruction
    (NVIDIA, compute capability 8.9 or newer, compiled) instead of the integer
    rebuild (AMD, whose native fp8 is e4m3fnuz, older NVIDIA GPUs, the
    interpreter). Both are exact on every byte the quantiser writes; they
    differ only on e4m3's NaN pattern (native: NaN; integer rebuild: 480)."""
    if device.type != "cuda" or interpreting() or is_amd():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def shard_columns(n_cols: int, rank: int, world_size: int) -> tuple[int, int]:
    """Hash columns ``[start, end)`` that ``rank`` of ``world_size`` owns (contiguous, balanced)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank, world_size: expected 0 <= rank < world_size, got {rank}, {world_size}")
    return rank * n_cols // world_size, (rank + 1) * n_cols // world_size


def quantize_fp8_ue8m0(x: torch.Tensor, block: int = SCALE_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [R, D]`` (any float dtype, any device) -> e4m3fn bits ``uint8 [R, D]`` and
    biased ue8m0 exponents ``uint8 [R, D / block]``.

    Each block of ``block`` values gets the least power of two ``2^e`` with
    ``amax / 2^e <= 448`` (e4m3's largest finite value), so the block's largest
    value uses the whole fp8 range and nothing saturates; ``e + 127`` is kept in
    ``[1, 254]`` and all-zero blocks take ``e = 0``. Rounding is PyTorch's
    round-to-nearest-even fp32 -> e4m3fn cast.
    """
    R, D = x.shape
    if D % block:
        raise ValueError(f"x: the row width {D} must be a multiple of the scale block {block}")
    xb = x.to(torch.float32).reshape(R, D // block, block)
    amax = xb.abs().amax(dim=-1)
    mant, ex = torch.frexp(amax / FP8_MAX)
    e = (ex - (mant == 0.5).to(ex.dtype)).clamp(-126, 127)
    # amax / 448 was rounded: settle e with exact power-of-two scalings.
    e = e + (torch.ldexp(amax, -e) > FP8_MAX).to(e.dtype)
    e = e - (torch.ldexp(amax, 1 - e) <= FP8_MAX).to(e.dtype)
    e = torch.where(amax > 0, e, torch.zeros_like(e))
    biased = (e + 127).clamp(1, 254)
    inv = torch.ldexp(torch.ones_like(amax), 127 - biased)
    q = (xb * inv[..., None]).clamp(-FP8_MAX, FP8_MAX).reshape(R, D).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), biased.to(torch.uint8)


def _scale_bytes(name: str, scale: torch.Tensor) -> torch.Tensor:
    """Biased-exponent bytes from a ue8m0 scale given as uint8, float8_e8m0fnu or
    (power-of-two) float32."""
    if scale.dtype == torch.uint8:
        return scale
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    if e8m0 is not None and scale.dtype == e8m0:
        return scale.view(torch.uint8)
    if scale.dtype in (torch.float32, torch.bfloat16, torch.float16):
        s = scale.to(torch.float32)
        mant, ex = torch.frexp(s)
        if bool(((mant != 0.5) | (s <= 0)).any()):
            raise ValueError(f"{name}: expected positive powers of two (ue8m0 scales), got other values")
        return (ex - 1 + 127).clamp(0, 255).to(torch.uint8)
    raise TypeError(f"{name}: expected uint8, float8_e8m0fnu or float32 power-of-two scales, got {scale.dtype}")


class EngramTable:
    """One Engram layer's embedding table and its gather.

    Args:
        column_sizes: rows of every hash column's table (``layout.column_sizes(layer_id)``).
        head_dim: values per row.
        storage: ``"bf16"`` (default), ``"fp16"``, ``"fp32"`` or ``"fp8"``
            (e4m3 + ue8m0 scale per 32 values; ``head_dim % 32 == 0``).
        device: where lookups run and write (default: the current CUDA device, else CPU).
        host_resident: keep the table in host memory (pinned when CUDA is
            available, unless ``pin_memory=False``) instead of on ``device``.
        host_mode: ``"auto"`` (zero-copy on a GPU when the table is pinned, else
            staged), ``"zero_copy"`` or ``"staged"``; see the module docstring.
        rank, world_size / group: tensor-parallel head sharding; ``group`` is any
            object with ``rank``, ``world_size`` and ``all_gather(x, dim)``
            (:class:`kda_engram.parallel.TensorParallelGroup`).
        out_dtype: dtype lookups return (default: the storage dtype, bf16 for fp8).

    The storage (``weight [local_rows, head_dim]``, ``scale [local_rows,
    head_dim/32]`` for fp8) is allocated uninitialised with ``torch.empty`` and
    owned by the table; fill it with :meth:`load_`. It is a plain object, not an
    ``nn.Module``, on purpose: a host-resident table must not follow
    ``module.to("cuda")``.
    """

    def __init__(
        self,
        column_sizes: Sequence[int],
        head_dim: int,
        *,
        storage: str = "bf16",
        device: torch.device | str | None = None,
        host_resident: bool = False,
        host_mode: str = "auto",
        pin_memory: bool | None = None,
        rank: int = 0,
        world_size: int = 1,
        group=None,
        out_dtype: torch.dtype | None = None,
    ):
        sizes = np.asarray(check_column_sizes(column_sizes), dtype=np.int64)
        if storage not in _STORAGE:
            raise ValueError(f"storage: expected one of {sorted(_STORAGE)}, got {storage!r}")
        head_dim = int(head_dim)
        if head_dim < 1 or (storage == "fp8" and head_dim % SCALE_BLOCK):
            raise ValueError(f"head_dim: expected a positive multiple of {SCALE_BLOCK} for fp8 (>= 1 otherwise), got {head_dim}")
        if host_mode not in ("auto", "zero_copy", "staged"):
            raise ValueError(f"host_mode: expected 'auto', 'zero_copy' or 'staged', got {host_mode!r}")
        if group is not None:
            rank, world_size = int(group.rank), int(group.world_size)
        self.group = group
        self.rank, self.world_size = int(rank), int(world_size)
        self.n_cols = int(sizes.size)
        self.col_start, self.col_end = shard_columns(self.n_cols, self.rank, self.world_size)
        if self.col_end <= self.col_start:
            raise ValueError(f"world_size: {world_size} ranks leave rank {rank} no hash column of {self.n_cols}")
        self.column_sizes = sizes
        self.column_offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.num_rows = int(sizes.sum())
        self.row_lo = int(self.column_offsets[self.col_start])
        self.row_hi = int(self.column_offsets[self.col_end - 1] + sizes[self.col_end - 1])
        self.head_dim = head_dim
        self.storage = storage
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.out_dtype = out_dtype or (torch.bfloat16 if storage == "fp8" else _STORAGE[storage])
        # How the gather decodes fp8 rows (see native_fp8_decode); may be set to
        # "integer" on any device, e.g. to compare the two.
        self.fp8_decode = "native" if native_fp8_decode(self.device) else "integer"
        if self.out_dtype not in _OUT_DTYPES:
            raise TypeError(f"out_dtype: expected bfloat16, float16 or float32, got {self.out_dtype}")
        self.host_resident = bool(host_resident)
        if pin_memory is None:
            pin_memory = self.host_resident and torch.cuda.is_available()
        home = torch.device("cpu") if self.host_resident else self.device
        rows = self.local_rows
        self.weight = torch.empty((rows, head_dim), dtype=_STORAGE[storage], device=home, pin_memory=bool(pin_memory))
        self.scale = None
        if storage == "fp8":
            self.scale = torch.empty(
                (rows, head_dim // SCALE_BLOCK), dtype=torch.uint8, device=home, pin_memory=bool(pin_memory)
            )
        if not self.host_resident:
            self.host_mode = None
        elif host_mode == "auto":
            zero_copy = self.device.type == "cuda" and not interpreting() and self.weight.is_pinned()
            self.host_mode = "zero_copy" if zero_copy else "staged"
        else:
            if host_mode == "zero_copy" and self.device.type == "cuda" and not self.weight.is_pinned():
                raise ValueError("host_mode: 'zero_copy' on a GPU needs a pinned table (pin_memory=True)")
            self.host_mode = host_mode
        self._col_bounds: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    # -- construction helpers -------------------------------------------------------

    @classmethod
    def for_layer(cls, layout: EngramLayout, layer_id: int, **kwargs) -> "EngramTable":
        """The (empty) table of model layer ``layer_id`` of ``layout``."""
        return cls(layout.column_sizes(layer_id), layout.head_dim, **kwargs)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, column_sizes: Sequence[int], *, scale=None, **kwargs) -> "EngramTable":
        """A table filled from the whole layer's ``weight [num_rows, head_dim]`` (see :meth:`load_`)."""
        table = cls(column_sizes, weight.shape[-1], **kwargs)
        return table.load_(weight, scale)

    @property
    def local_rows(self) -> int:
        """Rows this rank stores: those of its own hash columns."""
        return self.row_hi - self.row_lo

    @property
    def n_local_cols(self) -> int:
        return self.col_end - self.col_start

    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size() + (0 if self.scale is None else self.scale.numel())

    @torch.no_grad()
    def load_(self, weight: torch.Tensor, scale: torch.Tensor | None = None, *, row_start: int = 0) -> "EngramTable":
        """Copy the rows this rank owns out of a slice of the layer table.

        ``weight [R, head_dim]`` holds layer-table rows ``[row_start, row_start + R)``
        (the whole table, or one chunk of a checkpoint streamed in pieces; rows
        other ranks own are skipped). Float weights are cast, or quantised for
        fp8 storage (in chunks, bounding the temporary memory); fp8 weights
        (``float8_e4m3fn`` or raw ``uint8`` bits) need ``scale [R, head_dim/32]``
        (uint8 exponents, ``float8_e8m0fnu`` or power-of-two floats) and are copied
        as they are; float weights with NaN or inf are refused for fp8 storage
        (``ValueError``: quantisation cannot represent them). Returns ``self``.
        """
        check_tensor("weight", weight, shape=[None, self.head_dim])
        R = weight.shape[0]
        lo, hi = max(self.row_lo, row_start), min(self.row_hi, row_start + R)
        is_fp8 = weight.dtype in (torch.float8_e4m3fn, torch.uint8)
        if is_fp8 and self.storage != "fp8":
            raise TypeError(f"weight: fp8 rows need an fp8 table, this one stores {self.storage}")
        if is_fp8:
            if scale is None:
                raise ValueError("scale: fp8 weights need their ue8m0 scales [R, head_dim/32]")
            check_tensor("scale", scale, shape=[R, self.head_dim // SCALE_BLOCK])
        elif not weight.dtype.is_floating_point:
            raise TypeError(f"weight: expected a float or fp8 tensor, got {weight.dtype}")
        if hi <= lo:
            return self
        if not is_fp8 and self.storage == "fp8":
            # Quantisation would turn NaN into 480.0 (e4m3fn saturates): refuse it,
            # before any row is written.
            check_finite_weight("weight", weight, slice(lo - row_start, hi - row_start), _QUANT_CHUNK_ROWS)
        src = slice(lo - row_start, hi - row_start)
        dst = slice(lo - self.row_lo, hi - self.row_lo)
        if self.storage != "fp8":
            self.weight[dst].copy_(weight[src])
        elif is_fp8:
            self.weight[dst].copy_(weight[src].view(torch.uint8))
            self.scale[dst].copy_(_scale_bytes("scale", scale[src]))
        else:
            # Quantise where the numbers are fastest to crunch: on the GPU if
            # either side is there, chunk by chunk.
            work = weight.device if weight.is_cuda else (self.device if self.device.type == "cuda" else self.weight.device)
            for a in range(lo, hi, _QUANT_CHUNK_ROWS):
                b = min(hi, a + _QUANT_CHUNK_ROWS)
                q, s = quantize_fp8_ue8m0(weight[a - row_start : b - row_start].to(work))
                self.weight[a - self.row_lo : b - self.row_lo].copy_(q)
                self.scale[a - self.row_lo : b - self.row_lo].copy_(s)
        return self

    # -- lookups --------------------------------------------------------------------

    def column_bounds(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(starts, ends)``: every hash column's rows ``[starts[c], ends[c])`` in the
        layer table, int64 on ``device`` (made once per device), for the rows rule."""
        key = str(device)
        got = self._col_bounds.get(key)
        if got is None:
            starts = torch.from_numpy(self.column_offsets.copy()).to(device)
            got = (starts, starts + torch.from_numpy(self.column_sizes.copy()).to(device))
            self._col_bounds[key] = got
        return got

    def _launch(self, rows, weight, scale, out, out_cols, rows_col_base, own_lo, own_hi, row_lo, row_hi):
        n_items = rows.shape[0] * out_cols
        if n_items == 0:
            return out
        # Device tables: 16 rows per program once the grid fills the GPU 4 times
        # over, else 4. Rows read over the link (a zero-copy host table, whose
        # weight is not on the output's device): always 4. The sweeps behind both:
        # docs/design/engram_table.md.
        big = n_items >= 16 * 4 * num_compute_units(self.device)
        over_link = weight.device != out.device
        block_r = 16 if big and not over_link else 4
        _engram_gather_kernel[(triton.cdiv(n_items, block_r),)](
            rows,
            rows.stride(0),
            rows.stride(1),
            weight,
            weight.stride(0),
            scale if scale is not None else weight,
            scale.stride(0) if scale is not None else 0,
            out,
            out.stride(0),
            out.stride(1),
            n_items,
            out_cols,
            rows_col_base,
            own_lo,
            own_hi,
            row_lo,
            row_hi,
            HEAD_DIM=self.head_dim,
            BLOCK_D=triton.next_power_of_2(self.head_dim),
            BLOCK_R=block_r,
            FP8=scale is not None,
            SCALE_BLOCK=SCALE_BLOCK,
            BLOCK_S=triton.next_power_of_2(max(self.head_dim // SCALE_BLOCK, 1)),
            NATIVE_FP8=self.fp8_decode == "native",
            num_warps=4,
        )
        return out

    def _gather(self, rows, out, out_cols, rows_col_base, own_lo, own_hi):
        if self.host_mode != "staged":
            return self._launch(
                rows, self.weight, self.scale, out, out_cols, rows_col_base, own_lo, own_hi, self.row_lo, self.row_hi
            )
        # Staged: pick the rows on the host (this reads `rows` back: a sync), one
        # batched index_select into a pinned buffer, one asynchronous copy.
        T = rows.shape[0]
        rows_h = rows.to("cpu", torch.int64)
        cols = torch.arange(out_cols) + rows_col_base
        owned = (cols >= own_lo + rows_col_base) & (cols < own_hi + rows_col_base)
        r = rows_h[:, cols.clamp(max=self.n_cols - 1)]
        valid = owned[None] & (r >= self.row_lo) & (r < self.row_hi)
        idx = torch.where(valid, r - self.row_lo, 0).reshape(-1)
        pin = self.weight.is_pinned()
        staged = torch.empty((idx.numel(), self.head_dim), dtype=self.weight.dtype, pin_memory=pin)
        torch.index_select(self.weight, 0, idx, out=staged)
        if self.scale is None:
            staged.masked_fill_(~valid.reshape(-1, 1), 0)
            out.copy_(staged.view(T, out_cols, self.head_dim), non_blocking=True)
            return out
        staged_s = torch.empty((idx.numel(), self.scale.shape[1]), dtype=torch.uint8, pin_memory=pin)
        torch.index_select(self.scale, 0, idx, out=staged_s)
        pos = torch.where(valid.reshape(-1), torch.arange(idx.numel()), -1).view(T, out_cols).to(torch.int32)
        if pin:
            pos = pos.pin_memory()
        dev = lambda x: x.to(self.device, non_blocking=True)  # noqa: E731
        return self._launch(dev(pos), dev(staged), dev(staged_s), out, out_cols, 0, 0, out_cols, 0, idx.numel())

    def lookup(self, rows: torch.Tensor, *, out: torch.Tensor | None = None, check_inputs: bool = True) -> torch.Tensor:
        """Gather (and dequantise) the rows of all hash columns.

        ``rows``: int32/int64 ``[T, n_cols]`` layer-table rows (``ngram_hash(...)[:, l]``;
        any strides; negative = no row). Returns ``out_dtype [T, n_cols, head_dim]``;
        columns other ranks own, and negative rows, are zeros (so the rank
        outputs of a sharded table sum to the full lookup). :func:`engram_lookup`.
        """
        return engram_lookup(rows, self, out=out, check_inputs=check_inputs)

    def lookup_local(self, rows: torch.Tensor, *, out: torch.Tensor | None = None, check_inputs: bool = True) -> torch.Tensor:
        """This rank's hash columns only: ``rows [T, n_cols]`` (all columns, as the hash
        writes them) -> ``[T, n_local_cols, head_dim]``, columns ``col_start..col_end``.
        :func:`engram_lookup` with ``local=True``."""
        return engram_lookup(rows, self, local=True, out=out, check_inputs=check_inputs)

    def lookup_gathered(self, rows: torch.Tensor, group=None, *, check_inputs: bool = True) -> torch.Tensor:
        """Full ``[T, n_cols, head_dim]`` on every rank: :meth:`lookup_local`, then
        ``group.all_gather(local, dim=1)`` (rank-major = column order). Needs
        ``n_cols % world_size == 0`` (an all-gather takes equal pieces)."""
        group = group if group is not None else self.group
        if self.world_size == 1:
            return self.lookup(rows, check_inputs=check_inputs)
        if group is None:
            raise ValueError("group: a sharded table needs a group with all_gather(x, dim) to gather its columns")
        if self.n_cols % self.world_size:
            raise ValueError(f"world_size: {self.n_cols} hash columns do not split evenly over {self.world_size} ranks")
        local = self.lookup_local(rows, check_inputs=check_inputs)
        return group.all_gather(local, dim=1)

    def embeddings(self, rows: torch.Tensor, group=None, *, check_inputs: bool = True) -> torch.Tensor:
        """``[T, n_cols * head_dim]``: every token's row concatenation (``wkv``'s input),
        a free view of :meth:`lookup_gathered`'s output."""
        emb = self.lookup_gathered(rows, group, check_inputs=check_inputs)
        return emb.reshape(emb.shape[0], -1)


def engram_lookup(rows: torch.Tensor, table: EngramTable, *, local: bool = False, out: torch.Tensor | None = None,
                  check_inputs: bool = True) -> torch.Tensor:
    """The entry point of :meth:`EngramTable.lookup` (``local=False``: all columns,
    zeros where other ranks own them) and :meth:`EngramTable.lookup_local`
    (``local=True``: this rank's columns), one function so that its op
    (:mod:`kda_engram.ops.engram`) has one signature.

    Args:
        rows: int32/int64 ``[T, n_cols]`` layer-table rows (any strides; negative = no row).
        table: the :class:`EngramTable` to gather from.
        local: this rank's hash columns only.
        out: optional ``[T, n_cols or n_local_cols, head_dim]`` in ``table.out_dtype`` on
            ``table.device`` with a unit last stride.
        check_inputs: the rules (:func:`~kda_engram.validation.engram.check_table_lookup`):
            host rules at once, the rows' ranges queued; the gather runs on guarded
            rows (all -1 when a rule is broken: zeros out), the verdict deferred
            (:mod:`kda_engram.validation.entry`).

    Returns ``out_dtype [T, n_cols or n_local_cols, head_dim]``.
    """
    checks = EntryChecks(check_inputs)  # raises an earlier call's pending error first
    if checks.on:
        if not isinstance(table, EngramTable):
            raise TypeError(f"table: expected an EngramTable, got {type(table).__name__}")
        check_table_lookup(table, rows, out, local, checks)
    # Launch, then read back: a broken rule makes every row -1 (zeros out).
    out = run_engram_lookup(checks.guard(rows, -1), table, local=local, out=out)
    checks.run()  # the verdict (deferred by default: validation.entry)
    return out


def run_engram_lookup(rows, table: EngramTable, *, local: bool = False, out=None) -> torch.Tensor:
    """:func:`engram_lookup`'s gather without any rule: the caller has run them and
    guarded ``rows``; the eager body of its op (:mod:`kda_engram.ops.engram`)."""
    width = table.n_local_cols if local else table.n_cols
    if out is None:
        out = torch.empty((rows.shape[0], width, table.head_dim), dtype=table.out_dtype, device=table.device)
    if local:
        return table._gather(rows, out, width, table.col_start, 0, width)
    return table._gather(rows, out, width, 0, table.col_start, table.col_end)

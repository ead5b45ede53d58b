"""``KDABatch``: which rows of a KDA layer step decode and which prefill, their
cache rows, ``has_initial_state`` and the prefix-cache checkpoints, as device
tensors built without host syncs (what :class:`~kda_engram.layers.kda.KimiDeltaAttention`
takes per step). Its rules are :mod:`kda_engram.validation.kda_batch`."""

from __future__ import annotations

import dataclasses

import torch

from ..validation.common import DeviceChecks
from ..validation.kda_batch import check_kda_batch, check_kda_requests

__all__ = ["KDABatch"]


@dataclasses.dataclass(frozen=True)
class KDABatch:
    """The rows of one mixed decode + prefill step, as the KDA layer needs them.

    Tokens are ordered decode rows first (``num_decode`` of them, one token each),
    then the prefill tokens. Fields (device tensors, int32/int64 unless noted):

    * ``num_decode``: Python int, static for a captured graph.
    * ``decode_state_indices [B_d]``: state-cache row of each decode row (negative:
      padding row -- nothing read or written, output zero).
    * ``decode_conv_indices [B_d]``: conv-cache row (defaults to the state rows).
    * ``prefill_cu_seqlens [N_p+1]``: offsets over the prefill tokens only.
    * ``prefill_state_indices [N_p]`` / ``prefill_conv_indices [N_p]``: cache rows.
    * ``prefill_has_initial_state`` bool ``[N_p]``: continue from the rows (chunked
      prefill, resumption from a prefix checkpoint) or start from zeros (the rows
      are then not read).
    * ``checkpoint_offsets [N_p]`` / ``checkpoint_indices [N_p]`` (optional, both or
      neither): snapshot the state and conv window after ``checkpoint_offsets[n]``
      tokens (0 = none, else a multiple of 64, at most the length) into row
      ``checkpoint_indices[n]`` of the checkpoint buffers (by default the caches).
    * ``decode_query_lens [B_d]`` (optional; :meth:`from_query_lens` keeps the
      engine's query lengths of the decode rows here): checked to be 1, so a
      multi-token request counted as a decode row is refused by its own name.

    Build it with :meth:`from_query_lens` (device ops, no sync) or directly;
    :meth:`validate` checks it against the host (syncs: eager only).
    """

    num_decode: int
    decode_state_indices: torch.Tensor
    decode_conv_indices: torch.Tensor
    prefill_cu_seqlens: torch.Tensor
    prefill_state_indices: torch.Tensor
    prefill_conv_indices: torch.Tensor
    prefill_has_initial_state: torch.Tensor
    checkpoint_offsets: torch.Tensor | None = None
    checkpoint_indices: torch.Tensor | None = None
    decode_query_lens: torch.Tensor | None = None

    @property
    def num_prefill(self) -> int:
        """Number of prefill sequences (static: a shape)."""
        return self.prefill_state_indices.shape[0]

    @classmethod
    def from_query_lens(
        cls,
        query_lens: torch.Tensor,
        state_indices: torch.Tensor,
        has_initial_state: torch.Tensor | None = None,
        *,
        num_decode: int,
        conv_state_indices: torch.Tensor | None = None,
        checkpoint_offsets: torch.Tensor | None = None,
        checkpoint_indices: torch.Tensor | None = None,
    ) -> KDABatch:
        """From per-request device tensors in engine order (decode requests first).

        ``query_lens [N]`` (the first ``num_decode`` must be 1), ``state_indices [N]``,
        ``has_initial_state`` bool ``[N]`` (decode entries ignored: decode always
        continues; default all false for the prefill requests), ``conv_state_indices
        [N]`` (default ``state_indices``), ``checkpoint_offsets`` / ``checkpoint_indices
        [N]`` (decode entries ignored). Device ops only (a cumsum and slices)."""
        num_decode = check_kda_requests(query_lens, state_indices, has_initial_state, num_decode, conv_state_indices,
                                        checkpoint_offsets, checkpoint_indices)
        N, dev = query_lens.shape[0], query_lens.device
        conv = state_indices if conv_state_indices is None else conv_state_indices
        B = num_decode
        cu = torch.zeros(N - B + 1, dtype=torch.int64, device=dev)
        torch.cumsum(query_lens[B:].to(torch.int64), 0, out=cu[1:])
        has = torch.zeros(N - B, dtype=torch.bool, device=dev) if has_initial_state is None else has_initial_state[B:]
        ck_off = ck_idx = None
        if checkpoint_offsets is not None:
            ck_off, ck_idx = checkpoint_offsets[B:], checkpoint_indices[B:]
        return cls(B, state_indices[:B], conv[:B], cu, state_indices[B:], conv[B:], has, ck_off, ck_idx,
                   query_lens[:B])

    def validate(self, num_tokens: int, state_slots: int | None = None, conv_slots: int | None = None,
                 checkpoint_rows: int | None = None, conv_checkpoint_rows: int | None = None) -> None:
        """Every field against the host (one read-back of the device values: a
        sync; eager only).

        ``num_tokens`` is the step's token count (``num_decode`` + prefill tokens).
        With the cache sizes, index ranges and distinctness are checked too: all
        state rows written in the step (decode, prefill, checkpoints) must differ,
        and so must the conv rows. The rules are
        :func:`kda_engram.validation.kda_batch.check_kda_batch`, the ones the layer's
        forward runs by default."""
        checks = DeviceChecks()
        check_kda_batch(self, num_tokens, None, checks, state_slots=state_slots, conv_slots=conv_slots,
                        checkpoint_rows=checkpoint_rows, conv_checkpoint_rows=conv_checkpoint_rows)
        checks.run()

"""``KimiDeltaAttention``: the KDA mixer of Kimi-Linear / Kimi-K3 for serving.

Per token (hidden ``x``), per head ``h`` of this rank:

1. one fused input projection ``x @ W_in^T`` produces the bands
   ``[q | k | v | gate | beta | g_out]`` (``gate`` and ``g_out`` are either full,
   ``H K`` / ``H V`` columns, or the ``r`` columns of a low-rank down projection
   whose up projection ``f_b_proj`` / ``g_b_proj`` follows the fused matmul);
2. the width-4 causal depthwise conv + SiLU on ``q, k, v`` with a per-sequence
   conv window cache ``[slots, 2HK + HV, 3]`` (the last three raw inputs);
3. KDA itself and 4. the output gate ``RMSNorm(o) * o_norm.weight * sigmoid(g_out)``:
   prefill sequences through ``chunk_kda_prefill`` (conv launch, prologue, chunk
   kernel with the paged state cache and checkpoints) then the gate; decode rows
   through one fused launch (:func:`~kda_engram.kda.fused_decode.kda_layer_decode_step`:
   conv step, KDA step, gate), in the same call; then the output projection
   (row-parallel: an all-reduce under tensor parallelism).

Batches follow the engines' order: the ``num_decode`` decode rows first (one token
each), then the prefill tokens (``prefill_cu_seqlens`` over them alone).
:class:`KDABatch` (``layers/kda_batch.py``) says which rows are which, their
state-cache and conv-cache rows, ``has_initial_state`` and the prefix-cache checkpoints, all as device
tensors built without host syncs, so a step is CUDA-graph capturable and
``torch.compile(fullgraph=True)``-able (every kernel is a ``torch.ops.kda_engram``
custom op, :mod:`kda_engram.ops`).

Prefix caching is exact: a checkpoint at offset ``p`` (a multiple of 64) writes
the recurrent state after ``p`` tokens (chunk kernel) *and* the conv window at
``p`` -- the raw q/k/v inputs of tokens ``p-3 .. p-1``, gathered from the
projection on the device (:func:`kda_engram.kda.conv.kda_conv_checkpoint`) -- to
the checkpoint row; a later prefill from that row with ``has_initial_state``
reproduces the uninterrupted prefill. Chunked prefill carries both caches the same
way.

Memory ownership: the caches are the caller's (:meth:`KimiDeltaAttention.allocate_cache`,
fp32 or bf16 state); the projection is read through strided band views, never copied.

Tensor parallelism: rank ``r`` of ``P`` owns heads ``[r H/P, (r+1) H/P)`` (their bands,
conv channels, ``A_log``, ``dt_bias``, up projections; ``o_proj`` row-parallel);
:meth:`KimiDeltaAttention.load_weights` takes the full checkpoint and keeps the shard
(the checkpoint names and loading: :class:`~kda_engram.layers.kda_weights.KDAWeights`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .. import ops
from ..constants import CONV_WIDTH, KDA_HEAD_DIMS, STATE_DTYPES
from ..parallel import TensorParallelGroup
from ..validation.common import FLOAT_DTYPES, can_read_back, check_int, check_parameters_forward_only
from ..validation.entry import EntryChecks
from ..validation.kda_batch import check_kda_batch, check_kda_layer_inputs
from .kda_batch import KDABatch
from .kda_weights import KDAWeights

__all__ = ["KDABatch", "KimiDeltaAttention"]


class KimiDeltaAttention(KDAWeights, nn.Module):
    """The KDA token mixer for serving (one layer, this rank's heads).

    Args:
        hidden_size: model width.
        num_heads: KDA heads of the whole layer (sharded over ``tp``).
        head_dim: K = V per head (128 in Kimi-Linear; 16/32/64 accepted for tests).
        conv_size: the short conv width; the fused kernels implement 4.
        gate_low_rank_dim: ``None`` for a full ``H K`` gate band, or the rank ``r`` of
            the low-rank gate (``f_a_proj`` in the fused projection, ``f_b_proj``
            after it; Kimi-Linear uses ``r = head_dim``).
        output_gate_low_rank_dim: the same for the output gate (``g_a_proj`` /
            ``g_b_proj``).
        lower_bound: ``None`` for the softplus gate, ``L < 0`` for the bounded one
            (Kimi-K3 style safe gate).
        norm_eps: epsilon of the output RMSNorm.
        scale: attention scale (default ``head_dim ** -0.5``).
        tp: tensor-parallel group (``None``: one process).
        dtype, device: of the projections (``A_log``, ``dt_bias`` stay fp32).
        fused_decode: run the decode rows through one launch
            (:func:`~kda_engram.kda.fused_decode.kda_layer_decode_step`: conv, KDA
            step and output gate) instead of the conv launch, ``kda_decode`` and
            the PyTorch output gate. Same results up to fp32 summation order.

    Parameters (this rank's shard, ``torch.empty``: load with :meth:`load_weights`):
    ``in_proj.weight [2HK + HV + gate + H + g_out, hidden]``, ``f_b_proj.weight``,
    ``g_b_proj.weight`` (low-rank only), ``conv_weight [2HK + HV, 4]``, ``A_log [H]``,
    ``dt_bias [H K]``, ``o_norm_weight [V]``, ``o_proj.weight [hidden, H V]``.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int = 128,
        *,
        conv_size: int = CONV_WIDTH,
        gate_low_rank_dim: int | None = None,
        output_gate_low_rank_dim: int | None = None,
        lower_bound: float | None = None,
        norm_eps: float = 1e-5,
        scale: float | None = None,
        tp: TensorParallelGroup | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        fused_decode: bool = True,
    ):
        super().__init__()
        self.tp = tp if tp is not None else TensorParallelGroup.single()
        P = self.tp.world_size
        if conv_size != CONV_WIDTH:
            raise ValueError(f"conv_size: the fused conv kernels implement width {CONV_WIDTH}, got {conv_size}")
        if head_dim not in KDA_HEAD_DIMS:
            raise ValueError(f"head_dim: expected one of {KDA_HEAD_DIMS} (128 in production), got {head_dim}")
        if num_heads < 1 or num_heads % P:
            raise ValueError(f"num_heads: expected a positive multiple of tp_size {P}, got {num_heads}")
        if lower_bound is not None and not lower_bound <= 0:
            raise ValueError(f"lower_bound: expected None or a value <= 0 (e.g. -5.0), got {lower_bound}")
        for name, r in (("gate_low_rank_dim", gate_low_rank_dim), ("output_gate_low_rank_dim", output_gate_low_rank_dim)):
            if r is not None and (not isinstance(r, int) or r < 1):
                raise ValueError(f"{name}: expected None or a positive int, got {r!r}")
        dtype = dtype or torch.get_default_dtype()
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype: expected bfloat16, float16 or float32, got {dtype}")
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.local_heads = H = num_heads // P
        self.head_dim = K = V = head_dim
        self.conv_size = conv_size
        self.gate_low_rank_dim = gate_low_rank_dim
        self.output_gate_low_rank_dim = output_gate_low_rank_dim
        self.lower_bound = None if lower_bound is None else float(lower_bound)
        self.norm_eps = float(norm_eps)
        self.scale = float(scale) if scale is not None else K**-0.5
        self.fused_decode = bool(fused_decode)
        self.conv_channels = C = 2 * H * K + H * V
        gate_cols = gate_low_rank_dim or H * K
        gout_cols = output_gate_low_rank_dim or H * V
        # Column bands of the fused projection output, in order.
        widths = [("q", H * K), ("k", H * K), ("v", H * V), ("gate", gate_cols), ("beta", H), ("g_out", gout_cols)]
        self.bands: dict[str, tuple[int, int]] = {}
        start = 0
        for name, w in widths:
            self.bands[name] = (start, start + w)
            start += w
        self.proj_width = start
        kw = dict(dtype=dtype, device=device)
        self.in_proj = nn.Linear(hidden_size, start, bias=False, **kw)
        self.f_b_proj = nn.Linear(gate_low_rank_dim, H * K, bias=False, **kw) if gate_low_rank_dim else None
        self.g_b_proj = nn.Linear(output_gate_low_rank_dim, H * V, bias=False, **kw) if output_gate_low_rank_dim else None
        self.conv_weight = nn.Parameter(torch.empty(C, conv_size, **kw))
        self.A_log = nn.Parameter(torch.empty(H, dtype=torch.float32, device=device))
        self.dt_bias = nn.Parameter(torch.empty(H * K, dtype=torch.float32, device=device))
        self.o_norm_weight = nn.Parameter(torch.empty(V, **kw))
        self.o_proj = nn.Linear(H * V, hidden_size, bias=False, **kw)
        for p in self.parameters():
            p.requires_grad_(False)

    # -- caches -----------------------------------------------------------------------

    def allocate_cache(self, slots: int, *, device=None,
                       state_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """``(state_cache [slots, H, V, K], conv_state [slots, 2HK + HV, 3])`` with
        ``torch.empty`` (the conv windows in the projection dtype: raw inputs are
        stored exactly). Rows are only read where ``has_initial_state`` says so.

        ``state_dtype``: float32 (default) or bfloat16. A bf16 cache halves the
        bytes a decode step moves and the memory of every cached prefix; the
        kernels step the state in fp32 and round it to bf16 (RTNE) once per store.
        Checkpoint buffers must then be bf16 too."""
        check_int("slots", slots, low=0)
        if state_dtype not in STATE_DTYPES:
            raise TypeError(f"state_dtype: expected float32 or bfloat16, got {state_dtype}")
        device = device or self.in_proj.weight.device
        H, K = self.local_heads, self.head_dim
        state = torch.empty(slots, H, K, K, dtype=state_dtype, device=device)
        conv = torch.empty(slots, self.conv_channels, self.conv_size - 1, dtype=self.in_proj.weight.dtype,
                           device=device)
        return state, conv

    # -- forward ----------------------------------------------------------------------

    def forward(
        self,
        hidden_states: torch.Tensor,
        batch: KDABatch,
        state_cache: torch.Tensor,
        conv_state: torch.Tensor,
        *,
        checkpoint_state: torch.Tensor | None = None,
        checkpoint_conv_state: torch.Tensor | None = None,
        check_inputs: bool = True,
    ) -> torch.Tensor:
        """One step: ``hidden_states [T, hidden]`` (decode rows first) -> ``[T, hidden]``.

        Args:
            batch: the step's :class:`KDABatch`.
            state_cache: fp32 or bf16 ``[slots, H, V, K]`` (this rank's heads), updated in place.
            conv_state: ``[slots, 2HK + HV, 3]`` conv windows, updated in place.
            checkpoint_state / checkpoint_conv_state: where the batch's checkpoints go
                (rows ``batch.checkpoint_indices``); default the caches themselves.
            check_inputs: every rule of the step before any launch that writes a
                cache: the host rules raise at once; the rules on the batch's device
                values (:func:`~kda_engram.validation.kda_batch.check_kda_batch`: offsets,
                rows in range and distinct, the token count) are queued, the launches
                run on guarded copies of the batch's index tensors (all rows "none"
                and every sequence empty when a rule is broken, so no cache row is
                touched) and the verdict is read back once after them. One rule
                launch writes the verdict and the copies (as cheap as ``kda_decode``'s
                default: one allocation, one launch). While a CUDA
                graph is being captured or ``torch.compile`` traces, only the host
                rules run (a read-back is not allowed there): the device values are
                then the caller's contract, as with ``False`` (check them eagerly
                with :meth:`KDABatch.validate`). ``False`` runs the host rules only,
                once for the step (the kernels' ops are then crossed without rules
                of their own).

        Under tensor parallelism the result is all-reduced over the group.
        """
        # Raises an earlier call's pending error first. The step's host rules run on
        # every call, once (the ops are then crossed .unchecked); the rules on the
        # batch's device values only by default and where a read-back is allowed
        # (not while a CUDA graph is captured or torch.compile traces).
        checks = EntryChecks(check_inputs) if can_read_back() else None
        device_rules = checks if checks is not None and checks.on else None
        wt = self.in_proj.weight
        check_parameters_forward_only(self)
        check_kda_layer_inputs(hidden_states, state_cache, conv_state, checkpoint_state, checkpoint_conv_state,
                               hidden_size=self.hidden_size, heads=self.local_heads, head_dim=self.head_dim,
                               conv_channels=self.conv_channels, dtype=wt.dtype, device=wt.device)
        if not isinstance(batch, KDABatch):
            raise TypeError(f"batch: expected a KDABatch, got {type(batch).__name__}")
        # One rule launch, which also writes the guarded copies of the batch's index
        # tensors the launches below read (every row "none" when a rule is broken).
        guarded = check_kda_batch(
            batch, hidden_states.shape[0], wt.device, device_rules, state_slots=state_cache.shape[0],
            conv_slots=conv_state.shape[0],
            checkpoint_rows=None if checkpoint_state is None else checkpoint_state.shape[0],
            conv_checkpoint_rows=None if checkpoint_conv_state is None else checkpoint_conv_state.shape[0],
            guard=device_rules is not None)
        if guarded:
            batch = dataclasses.replace(batch, **guarded)
        T = hidden_states.shape[0]
        B = batch.num_decode
        H, K = self.local_heads, self.head_dim
        V = K
        C = self.conv_channels
        b = self.bands
        proj = self.in_proj(hidden_states)  # [T, width]: the only read of hidden_states
        gate = proj[:, b["gate"][0] : b["gate"][1]]
        raw_g = self.f_b_proj(gate) if self.f_b_proj is not None else gate  # [T, H*K], strided when full
        raw_beta = proj[:, b["beta"][0] : b["beta"][1]]  # [T, H], a strided column slice
        g_out = proj[:, b["g_out"][0] : b["g_out"][1]]
        g_out = self.g_b_proj(g_out) if self.g_b_proj is not None else g_out

        parts = []  # o_proj inputs [rows, H*V]: decode rows, then prefill tokens
        dt = self.in_proj.weight.dtype
        if B > 0 and self.fused_decode:
            # One launch: conv window update + SiLU, norms, gate, beta, state step, gated RMSNorm.
            parts.append(ops.kda_layer_decode_step.unchecked(
                proj[:B, :C], raw_g[:B], raw_beta[:B], g_out[:B], self.conv_weight, conv_state,
                batch.decode_conv_indices, self.A_log, self.dt_bias, self.o_norm_weight, state_cache,
                batch.decode_state_indices, scale=self.scale, lower_bound=self.lower_bound, norm_eps=self.norm_eps,
                out_dtype=dt,
            ))
        elif B > 0:
            x = proj[:B, :C]
            conv = ops.kda_conv_decode.unchecked(x, self.conv_weight, conv_state, batch.decode_conv_indices,
                                                 out_dtype=torch.float32)
            q = conv[:, : H * K].view(B, H, K)
            k = conv[:, H * K : 2 * H * K].view(B, H, K)
            v = conv[:, 2 * H * K :].view(B, H, V)
            o_d = ops.kda_decode.unchecked(q, k, v, raw_g[:B].view(B, H, K), raw_beta[:B], self.A_log, self.dt_bias,
                                 state_cache, batch.decode_state_indices, scale=self.scale,
                                 lower_bound=self.lower_bound)
            parts.append(self._output_gate(o_d.to(hidden_states.dtype), g_out[:B].view(B, H, V)).reshape(B, H * V))
        if batch.prefill_state_indices.shape[0] > 0:  # batch.num_prefill: prefill sequences
            Tp = T - B
            xp = proj[B:]
            q = xp[:, 0 : H * K].view(1, Tp, H, K)
            k = xp[:, H * K : 2 * H * K].view(1, Tp, H, K)
            v = xp[:, 2 * H * K : C].view(1, Tp, H, V)
            ckpt = batch.checkpoint_offsets is not None
            o_p, _ = ops.chunk_kda_prefill.unchecked(
                q, k, v, raw_g[B:].view(1, Tp, H, K), raw_beta[B:].unsqueeze(0), self.A_log, self.dt_bias,
                cu_seqlens=batch.prefill_cu_seqlens, scale=self.scale, lower_bound=self.lower_bound,
                state_cache=state_cache, state_indices=batch.prefill_state_indices,
                has_initial_state=batch.prefill_has_initial_state,
                # None: the snapshots go to rows of the state cache itself.
                checkpoint_state=checkpoint_state if ckpt else None,
                checkpoint_offsets=batch.checkpoint_offsets if ckpt else None,
                checkpoint_state_indices=batch.checkpoint_indices if ckpt else None,
                conv_weight=self.conv_weight, conv_state=conv_state, conv_state_indices=batch.prefill_conv_indices,
                conv_has_initial_state=batch.prefill_has_initial_state,
            )
            if ckpt:
                ops.kda_conv_checkpoint.unchecked(
                    xp[:, :C], batch.prefill_cu_seqlens, batch.checkpoint_offsets, batch.checkpoint_indices,
                    checkpoint_conv_state if checkpoint_conv_state is not None else conv_state)
            parts.append(self._output_gate(o_p.view(Tp, H, V), g_out[B:].view(Tp, H, V)).reshape(Tp, H * V))
        if checks is not None:
            checks.run()  # the verdict, after every launch that writes a cache (deferred by default)
        # Decode rows then prefill tokens: together exactly the T rows (checked above).
        z = parts[0] if len(parts) == 1 else (torch.cat(parts) if parts else proj.new_zeros(T, H * V))
        y = self.o_proj(z)
        if self.tp.world_size > 1:
            y = self._all_reduce(y)
        return y

    def _output_gate(self, o: torch.Tensor, g_out: torch.Tensor) -> torch.Tensor:
        """``RMSNorm(o) * o_norm.weight * sigmoid(g_out)`` per head, fp32 math, model dtype out."""
        of = o.float()
        of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        of = of * self.o_norm_weight.float() * torch.sigmoid(g_out.float())
        return of.to(self.in_proj.weight.dtype)

    def _all_reduce(self, y: torch.Tensor) -> torch.Tensor:
        reduce = getattr(self.tp, "all_reduce", None)
        if reduce is not None:
            return reduce(y)
        import torch.distributed as dist

        dist.all_reduce(y, group=self.tp.group)
        return y

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads} (local {self.local_heads}), "
                f"head_dim={self.head_dim}, gate_low_rank_dim={self.gate_low_rank_dim}, "
                f"output_gate_low_rank_dim={self.output_gate_low_rank_dim}, lower_bound={self.lower_bound}, "
                f"tp_size={self.tp.world_size}")

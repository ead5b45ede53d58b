"""kda-engram as a backend of fla-core's registry (fla-core 0.6).

``import kda_engram.integrations.fla`` registers :class:`KdaEngramBackend` for

* ``fla.ops.kda.chunk_kda`` (fla dispatches the public function itself), and
* ``fla.ops.kda.fused_recurrent_kda`` (fla dispatches its inner
  ``fused_recurrent_kda_fwd`` through the ``"kda"`` operation registry, so the
  backend serves that name there).

fla asks each backend's verifier first; ours accepts exactly the calls our kernels
compute exactly and otherwise answers a one-line reason, and fla falls back to its
own kernels. Served: inference mode (no autograd), q/k/v in one float dtype, head dims
of :data:`kda_engram.constants.KDA_HEAD_DIMS` (``V`` the same set), no GVA, both gate
forms (``use_gate_in_kernel`` True: raw gate with ``A_log``/``dt_bias``/``lower_bound``;
False: ``g`` is the log decay), ``use_qk_l2norm_in_kernel`` and
``use_beta_sigmoid_in_kernel`` either way, ``state_v_first`` either way (the
K-first layout is passed as a transposed view; a returned K-first state is one
contiguous copy), batched or varlen inputs. Refused, with the reason: autograd,
GVA, a per-channel beta, ``allow_neg_eigval``, context parallelism,
``return_intermediate_states``, devices the kernels cannot run on, and
``fused_recurrent_kda_fwd``'s state-pool form (``ssm_state_indices``; served by
:func:`kda_engram.integrations.vllm.fused_recurrent_kda`).

A log-decay ``g`` is expected ``<= 0`` (a decay), as fla's gate produces; values
below -128 act as -128 (exp is 0 in fp32). ``FLA_KDA_ENGRAM=0`` disables the
backend. :data:`ROUTED` and :data:`REFUSED` count what it served and refused.
"""

from __future__ import annotations

import warnings
from collections import Counter

import torch

from ..constants import STATE_DTYPES
from ..kda.decode import kda_decode_multi
from ..kda.prefill import chunk_kda_prefill, prefill_verdict
from ..kda.prefill_paths import PrefillCall
from ..validation.common import FLOAT_DTYPES
from .common import NotServed, capturing, even_cu_seqlens, fold_batch

try:
    import fla.ops.kda  # noqa: F401  (fla's own KDA backends register first)
    from fla.backends import BaseBackend, register
    from fla.ops.kda.chunk import chunk_kda as _fla_chunk_kda
except ImportError as error:  # the optional extra, or one of fla-core's own imports, is missing
    missing = getattr(error, "name", None) or ""
    if missing == "fla" or missing.startswith("fla."):
        raise ImportError("kda_engram.integrations.fla needs fla-core 0.6.0: pip install 'kda-engram[fla]' "
                          "(from a checkout: pip install -e '.[fla]')") from error
    raise ImportError(f"kda_engram.integrations.fla: fla-core is installed but importing it failed: {error} "
                      f"(the fla extra installs what it needs: pip install 'kda-engram[fla]', or "
                      f"pip install {missing or 'the missing module'})") from error

__all__ = ["ENV_VAR", "PRIORITY", "ROUTED", "REFUSED", "KdaEngramBackend"]

#: fla's switch for this backend: ``FLA_KDA_ENGRAM=0`` turns it off.
ENV_VAR = "FLA_KDA_ENGRAM"

#: fla tries backends in ascending priority (its FlashKDA CUTLASS backend is 3; its
#: own Triton kernels are the fallback after every backend). 4 routes to us only
#: what FlashKDA does not take. To be set by measurement: route to us only where we
#: are at least as fast as the backend we displace.
PRIORITY = 4

#: Calls served, by fla function name.
ROUTED: Counter = Counter()
#: Calls refused, by ``(fla function name, reason)``.
REFUSED: Counter = Counter()

_CHUNK_KEYWORDS = {"A_log", "dt_bias", "chunk_size"}


def _refuse(function: str, reason: str) -> tuple[bool, str]:
    """Count the refusal; the first one of each reason is also a warning (fla only
    logs it, at INFO), so a call that silently ran on fla's kernels is visible."""
    key = (function, reason)
    if key not in REFUSED:
        warnings.warn(f"kda-engram: fla's {function} runs on fla's own kernels: {reason} "
                      f"(kda_engram.integrations.fla.REFUSED counts every refusal)", RuntimeWarning, stacklevel=3)
    REFUSED[key] += 1
    return False, reason


def _common_plan(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                 use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first, A_log, dt_bias):
    """Host-only mapping of an fla call onto our input forms (no allocation, no
    device read). Raises :class:`NotServed` with the reason. Whether our kernels serve
    the device and the head dims is the prefill registry's answer
    (:func:`kda_engram.kda.prefill.prefill_verdict`, in its words): the decode kernel
    that serves a batched ``fused_recurrent_kda_fwd`` runs where the portable prefill
    runs, on the same head dims."""
    if torch.is_grad_enabled():
        raise NotServed("kda-engram serves inference only (autograd is on)")
    tensors = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    for name, x in tensors.items():
        if not isinstance(x, torch.Tensor):
            raise NotServed(f"{name}: expected a tensor, got {type(x).__name__}")
        if x.dtype not in FLOAT_DTYPES:
            raise NotServed(f"{name}: dtype {x.dtype} not served")
        if x.device != q.device:
            raise NotServed(f"{name}: on {x.device}, q on {q.device}")
    if q.dim() != 4 or k.shape != q.shape:
        raise NotServed(f"q, k: expected one [B, T, H, K] shape, got {list(q.shape)} and {list(k.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise NotServed(f"q, k, v: one dtype expected, got {q.dtype}, {k.dtype}, {v.dtype}")
    B, T, H, K = q.shape
    if v.dim() != 4 or tuple(v.shape[:2]) != (B, T):
        raise NotServed(f"v: expected [B, T, HV, V] with B={B}, T={T}, got {list(v.shape)}")
    if v.shape[2] != H:
        raise NotServed(f"GVA (HV={v.shape[2]} != H={H}) not served")
    V = v.shape[3]
    ok, reason = prefill_verdict(PrefillCall(q, v, cu_seqlens=cu_seqlens))
    if not ok:
        raise NotServed(reason)
    if tuple(g.shape) != (B, T, H, K):
        raise NotServed(f"g: expected {[B, T, H, K]}, got {list(g.shape)}")
    if tuple(beta.shape) != (B, T, H):
        raise NotServed(f"beta: expected {[B, T, H]} (a per-channel beta is not served), got {list(beta.shape)}")
    if allow_neg_eigval:
        raise NotServed("allow_neg_eigval=True not served")
    if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
        raise NotServed(f"scale: expected None or a number > 0, got {scale!r}")
    if cu_seqlens is not None:
        if B != 1:
            raise NotServed(f"cu_seqlens needs batch 1, got {B}")
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.device != q.device:
            raise NotServed("cu_seqlens: expected a 1-D tensor on q's device")
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise NotServed(f"cu_seqlens: int32/int64 expected, got {cu_seqlens.dtype}")
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if use_gate_in_kernel:
        if A_log is None and lower_bound is None:
            raise NotServed("use_gate_in_kernel with A_log=None needs lower_bound")
        if lower_bound is not None and not (isinstance(lower_bound, (int, float)) and -float("inf") < lower_bound <= 0):
            raise NotServed(f"lower_bound: expected a finite number <= 0, got {lower_bound!r}")
        for name, x, shapes in (("A_log", A_log, ((H,),)), ("dt_bias", dt_bias, ((H * K,), (H, K)))):
            if x is not None and (not isinstance(x, torch.Tensor) or tuple(x.shape) not in shapes
                                  or x.dtype not in FLOAT_DTYPES or x.device != q.device):
                raise NotServed(f"{name}: expected a float tensor of shape {' or '.join(map(str, shapes))} "
                                f"on q's device")
    if initial_state is not None:
        want = (N, H, V, K) if state_v_first else (N, H, K, V)
        if not isinstance(initial_state, torch.Tensor) or tuple(initial_state.shape) != want:
            raise NotServed(f"initial_state: expected {list(want)}, got "
                            f"{list(getattr(initial_state, 'shape', [type(initial_state).__name__]))}")
        if initial_state.device != q.device:
            raise NotServed("initial_state: not on q's device")
    return dict(B=B, T=T, H=H, K=K, V=V, N=N, forms=dict(
        gate="raw" if use_gate_in_kernel else "log_decay", qk_l2norm=bool(use_qk_l2norm_in_kernel),
        beta_sigmoid=bool(use_beta_sigmoid_in_kernel)))


def _gate_arguments(plan, q, use_gate_in_kernel, A_log, dt_bias, lower_bound):
    """``(A_log, dt_bias, lower_bound)`` for our entry points: fla's ``A_log=None``
    (bounded gate ``L sigmoid(g + dt_bias)``) is ``A_log = 0``, a missing ``dt_bias`` zeros."""
    if not use_gate_in_kernel:
        return None, None, None
    H, K = plan["H"], plan["K"]
    if A_log is None:
        A_log = torch.zeros(H, dtype=torch.float32, device=q.device)
    if dt_bias is None:
        dt_bias = torch.zeros(H * K, dtype=torch.float32, device=q.device)
    return A_log, dt_bias, None if lower_bound is None else float(lower_bound)


def _to_v_first(state, state_v_first):
    return state if state is None or state_v_first else state.transpose(-1, -2)


def _from_v_first(state, state_v_first):
    return state if state is None or state_v_first else state.transpose(-1, -2).contiguous()


class KdaEngramBackend(BaseBackend):
    """fla backend serving ``chunk_kda`` and ``fused_recurrent_kda_fwd`` with kda-engram's kernels."""

    backend_type = "kda_engram"
    package_name = None
    env_var = ENV_VAR
    default_enable = True
    priority = PRIORITY

    # ------------------------------------------------------------------ chunk_kda

    @staticmethod
    def _chunk_plan(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                    allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
                    return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                    cp_context=None, use_graph=False, max_num_seqs=None, **kwargs):
        del safe_gate, disable_recompute, cu_seqlens_cpu, max_num_seqs  # no effect on the forward result
        unknown = sorted(set(kwargs) - _CHUNK_KEYWORDS)
        if unknown:
            raise NotServed(f"argument {unknown[0]} not served")
        if kwargs.get("chunk_size") not in (None, 32, 64):
            raise NotServed(f"chunk_size={kwargs['chunk_size']} not served")
        if cp_context is not None:
            raise NotServed("context parallelism not served")
        if return_intermediate_states:
            raise NotServed("return_intermediate_states not served")
        if initial_state is not None and initial_state.dtype not in STATE_DTYPES:
            raise NotServed(f"initial_state: dtype {initial_state.dtype} not served (float32 or bfloat16)")
        plan = _common_plan(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel,
                            use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
                            state_v_first, kwargs.get("A_log"), kwargs.get("dt_bias"))
        plan["check_inputs"] = not (use_graph or capturing())
        return plan

    def chunk_kda_verifier(self, *args, **kwargs) -> tuple[bool, str | None]:
        try:
            plan = self._chunk_plan(*args, **kwargs)
            q = args[0] if args else kwargs["q"]
            for name, x in (("q", q), ("v", args[2] if len(args) > 2 else kwargs["v"])):
                fold_batch(x, name)  # refuses a batch that would need a copy
            del plan
        except NotServed as reason:
            return _refuse("chunk_kda", str(reason))
        return True, None

    def chunk_kda(self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                  allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
                  return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                  cp_context=None, use_graph=False, max_num_seqs=None, **kwargs):
        plan = self._chunk_plan(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                                use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate,
                                lower_bound, disable_recompute, return_intermediate_states, state_v_first,
                                cu_seqlens, cu_seqlens_cpu, cp_context, use_graph, max_num_seqs, **kwargs)
        B, T = plan["B"], plan["T"]
        A_log, dt_bias, bound = _gate_arguments(plan, q, use_gate_in_kernel, kwargs.get("A_log"),
                                                kwargs.get("dt_bias"), lower_bound)
        if cu_seqlens is None:
            cu_seqlens = even_cu_seqlens(B, T, q.device)
        flat = [fold_batch(x, n) for n, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta))]
        o, final = chunk_kda_prefill(
            *flat, A_log, dt_bias, scale=scale, lower_bound=bound, cu_seqlens=cu_seqlens,
            initial_state=_to_v_first(initial_state, state_v_first), output_final_state=output_final_state,
            final_state_dtype=torch.float32 if output_final_state else None, check_inputs=plan["check_inputs"],
            **plan["forms"],
        )
        ROUTED["chunk_kda"] += 1
        return o.view(B, T, *o.shape[2:]), _from_v_first(final, state_v_first)

    # ----------------------------------------------------- fused_recurrent_kda_fwd

    @staticmethod
    def _recurrent_plan(q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, scale=None,
                        output_final_state=False, inplace_final_state=True, state_v_first=False, cu_seqlens=None,
                        ssm_state_indices=None, num_accepted_tokens=None, use_qk_l2norm_in_kernel=False,
                        use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                        lower_bound=None, out=None, **kwargs):
        if kwargs:
            raise NotServed(f"argument {sorted(kwargs)[0]} not served")
        if ssm_state_indices is not None or num_accepted_tokens is not None:
            raise NotServed("the state-pool form (ssm_state_indices) is served by "
                            "kda_engram.integrations.vllm.fused_recurrent_kda, not through fla")
        if inplace_final_state:
            if initial_state is None:
                raise NotServed("inplace_final_state needs initial_state")
            if not state_v_first:
                raise NotServed("inplace_final_state on a K-first state would need a transposed copy")
            if initial_state.dtype not in STATE_DTYPES:
                raise NotServed(f"inplace_final_state on a {initial_state.dtype} state (float32 or bfloat16 served)")
        plan = _common_plan(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel,
                            use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
                            state_v_first, A_log, dt_bias)
        if out is not None and (not isinstance(out, torch.Tensor) or out.shape != v.shape):
            raise NotServed("out: expected v's shape")
        plan["check_inputs"] = not capturing()
        return plan

    def fused_recurrent_kda_fwd_verifier(self, *args, **kwargs) -> tuple[bool, str | None]:
        try:
            self._recurrent_plan(*args, **kwargs)
        except NotServed as reason:
            return _refuse("fused_recurrent_kda_fwd", str(reason))
        return True, None

    def fused_recurrent_kda_fwd(self, q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, scale=None,
                                output_final_state=False, inplace_final_state=True, state_v_first=False,
                                cu_seqlens=None, ssm_state_indices=None, num_accepted_tokens=None,
                                use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                                use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None, out=None,
                                **kwargs):
        plan = self._recurrent_plan(q, k, v, g, beta, A_log, dt_bias, initial_state, scale, output_final_state,
                                    inplace_final_state, state_v_first, cu_seqlens, ssm_state_indices,
                                    num_accepted_tokens, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                                    use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, out, **kwargs)
        N, H, K, V = plan["N"], plan["H"], plan["K"], plan["V"]
        A_log, dt_bias, bound = _gate_arguments(plan, q, use_gate_in_kernel, A_log, dt_bias, lower_bound)
        # The states live in a cache of N rows, sequence n on row n: the caller's own
        # state in place, or a V-first fp32 scratch copy (fla's output dtype).
        if inplace_final_state:
            cache = initial_state
        elif initial_state is not None:
            cache = _to_v_first(initial_state, state_v_first).to(torch.float32, copy=True).contiguous()
        else:
            cache = torch.zeros(N, H, V, K, dtype=torch.float32, device=q.device)
        rows = torch.arange(N, device=q.device)
        gates = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=bound, **plan["forms"])
        if cu_seqlens is None:
            # B sequences of T tokens: the decode kernel's [B, S] layout, the state
            # kept on chip across the tokens and stored once after the last.
            steps = plan["T"]
            state_indices = torch.full((N, steps), -1, dtype=torch.int64, device=q.device)
            state_indices[:, -1:] = rows[:, None]
            o = kda_decode_multi(q, k, v, g, beta, state_cache=cache, state_indices=state_indices,
                                 initial_state_indices=rows, scale=scale, out=out,
                                 check_inputs=plan["check_inputs"], **gates)
        else:
            has = torch.full((N,), initial_state is not None, dtype=torch.bool, device=q.device)
            o, _ = chunk_kda_prefill(q, k, v, g, beta, scale=scale, cu_seqlens=cu_seqlens, state_cache=cache,
                                     state_indices=rows, has_initial_state=has, out=out,
                                     check_inputs=plan["check_inputs"], **gates)
        ROUTED["fused_recurrent_kda_fwd"] += 1
        if inplace_final_state:
            return o, initial_state
        return o, (_from_v_first(cache, state_v_first) if output_final_state else None)


register(_fla_chunk_kda)(KdaEngramBackend)
register("kda")(KdaEngramBackend)

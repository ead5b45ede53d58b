"""The KDA layer's checkpoint side: Kimi-Linear tensor names, loading the full
(unsharded) checkpoint into this rank's shard of the fused projection, conv,
gate and output weights, and random full weights for tests and benchmarks.

:class:`KDAWeights` is a base class of
:class:`~kda_engram.layers.kda.KimiDeltaAttention` (the layer's ``load_weights``,
``weight_names``, ``random_weights`` and ``reset_parameters``); it reads the
layer's shapes (``num_heads``, ``head_dim``, ``hidden_size``, the low-rank dims,
``conv_size``, ``tp``) and writes its parameters.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from ..validation.common import check_tensor

__all__ = ["KDAWeights"]


def _sharded(x: torch.Tensor, dim: int, rank: int, parts: int) -> torch.Tensor:
    size = x.shape[dim] // parts
    return x.narrow(dim, rank * size, size)


class KDAWeights:
    """Checkpoint names and loading of :class:`~kda_engram.layers.kda.KimiDeltaAttention`."""

    def weight_names(self) -> list[str]:
        """The full-checkpoint tensor names :meth:`load_weights` takes (Kimi-Linear's)."""
        names = ["q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight",
                 "v_conv1d.weight", "b_proj.weight", "A_log", "dt_bias", "o_norm.weight", "o_proj.weight"]
        names += ["f_a_proj.weight", "f_b_proj.weight"] if self.gate_low_rank_dim else ["f_proj.weight"]
        names += ["g_a_proj.weight", "g_b_proj.weight"] if self.output_gate_low_rank_dim else ["g_proj.weight"]
        return names

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                     prefix: str = "") -> set[str]:
        """Load the full (unsharded) checkpoint tensors, Kimi-Linear names under ``prefix``:

        ``q_proj / k_proj / v_proj.weight [H*K or H*V, hidden]``,
        ``q_conv1d / k_conv1d / v_conv1d.weight [*, 1, 4]`` (or ``[*, 4]``),
        ``f_a_proj.weight [r, hidden]`` + ``f_b_proj.weight [H*K, r]`` (low-rank gate) or
        ``f_proj.weight [H*K, hidden]``, ``b_proj.weight [H, hidden]``,
        ``g_a_proj.weight [r_o, hidden]`` + ``g_b_proj.weight [H*V, r_o]`` or
        ``g_proj.weight [H*V, hidden]``, ``A_log [H]`` (or ``[1, 1, H, 1]``),
        ``dt_bias [H*K]`` (or ``[H, K]``), ``o_norm.weight [V]``, ``o_proj.weight [hidden, H*V]``.

        This rank keeps its heads; the fused projection is assembled from the bands.
        Missing or unknown names under ``prefix`` raise ``ValueError``. Returns the
        names loaded."""
        items = weights.items() if isinstance(weights, Mapping) else weights
        w = {name[len(prefix):]: t for name, t in items if name.startswith(prefix)}
        need = set(self.weight_names())
        if need != set(w):
            raise ValueError(f"weights: under prefix {prefix!r} missing {sorted(need - set(w))}, "
                             f"unknown {sorted(set(w) - need)}")
        P, r = self.tp.world_size, self.tp.rank
        Hf, K, hid = self.num_heads, self.head_dim, self.hidden_size

        def get(name, shape):
            t = w[name]
            return check_tensor(prefix + name, t, shape=shape)

        def heads(name, shape, dim=0):
            return _sharded(get(name, shape), dim, r, P)

        q = heads("q_proj.weight", [Hf * K, hid])
        k = heads("k_proj.weight", [Hf * K, hid])
        v = heads("v_proj.weight", [Hf * K, hid])
        if self.gate_low_rank_dim:
            gate = get("f_a_proj.weight", [self.gate_low_rank_dim, hid])  # replicated
            self.f_b_proj.weight.copy_(heads("f_b_proj.weight", [Hf * K, self.gate_low_rank_dim]))
        else:
            gate = heads("f_proj.weight", [Hf * K, hid])
        beta = heads("b_proj.weight", [Hf, hid])
        if self.output_gate_low_rank_dim:
            gout = get("g_a_proj.weight", [self.output_gate_low_rank_dim, hid])
            self.g_b_proj.weight.copy_(heads("g_b_proj.weight", [Hf * K, self.output_gate_low_rank_dim]))
        else:
            gout = heads("g_proj.weight", [Hf * K, hid])
        self.in_proj.weight.copy_(torch.cat([x.to(self.in_proj.weight.dtype) for x in (q, k, v, gate, beta, gout)]))

        def conv(name):
            t = w[name]
            t = t.reshape(t.shape[0], t.shape[-1]) if t.dim() == 3 else t
            return _sharded(check_tensor(prefix + name, t, shape=[Hf * K, self.conv_size]), 0, r, P)

        self.conv_weight.copy_(torch.cat([conv("q_conv1d.weight"), conv("k_conv1d.weight"), conv("v_conv1d.weight")]))
        a_log = w["A_log"].reshape(-1)
        self.A_log.copy_(_sharded(check_tensor(prefix + "A_log", a_log, shape=[Hf]), 0, r, P))
        dtb = w["dt_bias"].reshape(-1)
        self.dt_bias.copy_(_sharded(check_tensor(prefix + "dt_bias", dtb, shape=[Hf * K]), 0, r, P))
        self.o_norm_weight.copy_(get("o_norm.weight", [K]))
        self.o_proj.weight.copy_(heads("o_proj.weight", [hid, Hf * K], dim=1))
        return {prefix + n for n in w}

    def random_weights(self, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """Random full checkpoint tensors (CPU fp32, Kimi-Linear names) of a plausible
        scale: unit-variance projections, ``A_log`` in ``log[1, 16]``, a conv that
        keeps the signal, for tests and benchmarks."""
        g = generator
        Hf, K, hid = self.num_heads, self.head_dim, self.hidden_size
        lin = lambda o, i: torch.randn(o, i, generator=g) * i**-0.5  # noqa: E731
        out = {
            "q_proj.weight": lin(Hf * K, hid), "k_proj.weight": lin(Hf * K, hid), "v_proj.weight": lin(Hf * K, hid),
            "b_proj.weight": lin(Hf, hid), "o_proj.weight": lin(hid, Hf * K),
            "A_log": torch.log(torch.rand(Hf, generator=g) * 15 + 1),
            "dt_bias": torch.randn(Hf * K, generator=g) * 0.5,
            "o_norm.weight": 1.0 + 0.1 * torch.randn(K, generator=g),
        }
        for name in ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"):
            out[name] = (torch.randn(Hf * K, 1, self.conv_size, generator=g) * 0.5)
        if self.gate_low_rank_dim:
            out["f_a_proj.weight"] = lin(self.gate_low_rank_dim, hid)
            out["f_b_proj.weight"] = lin(Hf * K, self.gate_low_rank_dim)
        else:
            out["f_proj.weight"] = lin(Hf * K, hid)
        if self.output_gate_low_rank_dim:
            out["g_a_proj.weight"] = lin(self.output_gate_low_rank_dim, hid)
            out["g_b_proj.weight"] = lin(Hf * K, self.output_gate_low_rank_dim)
        else:
            out["g_proj.weight"] = lin(Hf * K, hid)
        return out

    def reset_parameters(self, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """Load :meth:`random_weights`; returns the full tensors (the reference needs them)."""
        w = self.random_weights(generator)
        self.load_weights(w)
        return w

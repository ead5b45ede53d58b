"""``kda-engram demo``: the serving layers end to end on an embedded configuration.

The demo builds one hybrid block out of the two serving layers and drives it the
way an engine does, then checks every result against the plain-PyTorch
references:

* **block**: ``h = EngramLayer(streams, token ids)`` (hash, table gather, ``wkv``,
  gate into the ``hc`` streams), ``x = mean of h's streams``, ``y =
  KimiDeltaAttention(x)``, ``out = h + y`` added to every stream. The fixed mean
  stands in for a model's learned hyper-connection maps: it is enough to feed the
  mixer from the Engram output, which is all the demo needs.
* **prefill**: a batch of ragged prompts from empty caches (the caches are filled
  with NaN and garbage ids first, so a row read where ``has_initial_state`` is
  false would show), with a prefix-cache checkpoint at each prompt's last multiple
  of 64: the KDA state, the conv window and the Engram hash history at that offset.
* **resume**: one prompt's checkpoint rows are copied to a fresh slot and the rest
  of the prompt is prefilled from there; it must reproduce the uninterrupted
  prefill (outputs, state, conv window, history).
* **decode**: a few tokens for every prompt and for the resumed copy (which gets
  its original's tokens and must decode the same), as decode rows through the
  same layers.
* **reference**: the Engram layer and the KDA layer in plain PyTorch on the CPU
  (fp64 for an fp32 run, fp32 for a bf16 run) over every token the block saw,
  each fed the same inputs as its kernel counterpart, so an error is attributed
  to the layer that made it.

A short check of the Engram gate kernels on their own (fused, and dim-sharded
over 4 simulated ranks -- the path a single-rank layer never takes) comes first.

On a GPU the sizes are real (K = V = 128, 32 heads, Engram dim 5120, hc 4; a
small hash table) in bf16, checked against an fp32 reference with bounds relative
to the reference's largest magnitude; a warm-up pass compiles the kernels so that
the stage times are the steps' own. On the CPU the kernels run under the Triton
interpreter, so the sizes are small and everything is fp32 (the interpreter's
bf16 ``tl.dot`` is wrong), with absolute bounds.

Every stage prints one line with its wall time, then what it checked; the exit
status is non-zero if any check is out of bounds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time

import torch

from ..constants import KDA_CHECKPOINT_ALIGNMENT
from .reporting import Checks, check_seed, pick_device

# The demo's single Engram layer: its id seeds the hash multipliers.
ENGRAM_LAYER_ID = 0
ENGRAM_EPS = 1e-6
KDA_LOWER_BOUND = -5.0  # the bounded (Kimi-K3 style) gate


# ----------------------------------------------------------------------- configuration


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Sizes of the demo block and of the batch it serves.

    ``hidden`` is the block width: the Engram stream dim and the KDA layer's
    hidden size. ``table_floor`` is the smallest hash-table size (each hash column
    takes the next unused prime above it), ``vocab`` the compressed-id space the
    token ids are drawn from."""

    hidden: int
    hc: int
    kda_heads: int
    head_dim: int
    gate_rank: int
    engram_heads: int
    engram_head_dim: int
    max_ngram: int
    table_floor: int
    vocab: int
    prompt_lengths: tuple[int, ...]
    decode_steps: int
    gate_check_tokens: int

    def describe(self) -> str:
        return (f"KDA {self.kda_heads} heads x K=V={self.head_dim} (low-rank gates r={self.gate_rank}), "
                f"Engram dim {self.hidden} x hc {self.hc}, {self.max_ngram - 1} n-gram orders x "
                f"{self.engram_heads} hash heads x {self.engram_head_dim}")


#: Under the interpreter, about half a minute on two cores: the production head
#: dim (K = V = 128, the one the GPU kernels are tuned and tested for, so that
#: ``--small`` on a GPU takes the same kernel paths) but two heads, a narrow block
#: and two streams (the interpreter's cost goes with heads x chunks and with tokens
#: x streams). Prompt lengths hit the chunk edges (63/64/65), and a three-chunk
#: prompt is resumed from offset 128.
SMALL = DemoConfig(hidden=64, hc=2, kda_heads=2, head_dim=128, gate_rank=32, engram_heads=2, engram_head_dim=16,
                   max_ngram=3, table_floor=101, vocab=64, prompt_lengths=(1, 63, 64, 65, 150), decode_steps=3,
                   gate_check_tokens=16)

#: On a GPU: Kimi-Linear's head shape and DeepSeek-V4.1's Engram width, with a hash
#: table of ~320k rows instead of V4.1's 384M so that it builds in a moment.
REAL = DemoConfig(hidden=5120, hc=4, kda_heads=32, head_dim=128, gate_rank=128, engram_heads=8, engram_head_dim=64,
                  max_ngram=3, table_floor=20011, vocab=32000, prompt_lengths=(1, 63, 64, 65, 300, 1000),
                  decode_steps=4, gate_check_tokens=1024)


@dataclasses.dataclass(frozen=True)
class Bound:
    """An error bound: absolute, or a fraction of the reference's max magnitude
    (bf16 errors scale with the values, so a bf16 bound is stated relative)."""

    value: float
    relative: bool = False

    def limit(self, want: torch.Tensor) -> float:
        if not self.relative:
            return self.value
        return self.value * (float(want.double().abs().max()) if want.numel() else 0.0)


@dataclasses.dataclass(frozen=True)
class DemoBounds:
    """What each kind of check must meet.

    ``consistency`` is for two runs of the system that must agree (resumed vs
    uninterrupted prefill, the resumed copy's decode vs its original's): exact in
    fp32 up to GEMM rounding; in bf16 a projection GEMM over another row count may
    round a few values the other way."""

    engram: Bound
    kda_out: Bound
    kda_state: Bound
    conv: Bound
    block: Bound
    consistency: Bound
    gate_kernel: Bound


FP32_BOUNDS = DemoBounds(engram=Bound(5e-5), kda_out=Bound(1e-4), kda_state=Bound(2e-5), conv=Bound(1e-5),
                         block=Bound(2e-4), consistency=Bound(1e-5), gate_kernel=Bound(1e-4))
BF16_BOUNDS = DemoBounds(engram=Bound(5e-2, True), kda_out=Bound(5e-2, True), kda_state=Bound(5e-2, True),
                         conv=Bound(3e-2, True), block=Bound(5e-2, True), consistency=Bound(3e-2, True),
                         gate_kernel=Bound(3e-2, True))


# ----------------------------------------------------------------------- reporting


class DemoChecks(Checks):
    """:class:`kda_engram.tools.reporting.Checks` with relative bounds and exact (integer)
    comparisons; failures land in the same ``failed`` list."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def within(self, name: str, got: torch.Tensor, want: torch.Tensor, bound: Bound) -> None:
        got, want = got.detach().cpu().double(), want.detach().cpu().double()
        limit = bound.limit(want)
        if got.shape != want.shape:
            self._row(name, False, f"shape {list(got.shape)} vs the reference's {list(want.shape)}")
            return
        err = float((got - want).abs().max()) if got.numel() else 0.0
        how = f"<= {limit:.1e}"
        if bound.relative:
            how += f" ({bound.value:.0%} of max|ref| {limit / bound.value:.3g})"
        self._row(name, err <= limit, f"max|err| {err:.2e}  {how}")

    def equal(self, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        got, want = torch.as_tensor(got).cpu().long(), torch.as_tensor(want).cpu().long()
        if got.shape != want.shape:
            self._row(name, False, f"shape {list(got.shape)} vs the reference's {list(want.shape)}")
            return
        wrong = int((got != want).sum())
        self._row(name, wrong == 0, f"mismatches {wrong} of {got.numel()} (exact)")

    def _row(self, name: str, ok: bool, detail: str) -> None:
        self.count += 1
        print(f"  {'ok  ' if ok else 'FAIL'} {name:<52} {detail}", flush=True)
        if not ok:
            self.failed.append(name)


@contextlib.contextmanager
def _stage(name: str, device: torch.device):
    """One line per stage: its name as it starts, its wall time when the device has
    finished its work (a CUDA sync), so the time is the stage's own."""
    print(f"{name} ...", end="", flush=True)
    start = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    took = time.perf_counter() - start
    # GPU stages take milliseconds once the kernels are compiled.
    print(f" {took:.2f} s" if took >= 1.0 else f" {took * 1e3:.1f} ms", flush=True)


# ----------------------------------------------------------------------- the block


@dataclasses.dataclass
class _Caches:
    """Every per-sequence cache of the block, one slot numbering for all three."""

    state: torch.Tensor  # KDA recurrent state, fp32 [slots, H, V, K]
    conv: torch.Tensor  # KDA conv window [slots, 2HK + HV, 3]
    history: torch.Tensor  # Engram hash history, int64 [slots, max_ngram - 1]

    def copy_row(self, dst: int, src: int) -> None:
        """Restore a checkpoint into a slot: what an engine does on a prefix-cache hit."""
        for cache in (self.state, self.conv, self.history):
            cache[dst].copy_(cache[src])


@dataclasses.dataclass
class _StepOut:
    """What one block step produced, kept apart so each check sees its own layer."""

    rows: torch.Tensor  # Engram table rows [T, n_layers, n_hash_cols]
    engram_out: torch.Tensor  # [T, hc, dim]
    mixer_in: torch.Tensor  # [T, dim]
    mixer_out: torch.Tensor  # [T, dim]
    out: torch.Tensor  # [T, hc, dim]


class _HybridBlock(torch.nn.Module):
    """Engram into the streams, KDA on their mean, its output added to every stream."""

    def __init__(self, engram, kda):
        super().__init__()
        self.engram = engram
        self.kda = kda

    def forward(self, hidden, token_ids, kda_batch, engram_batch, caches: _Caches) -> _StepOut:
        rows = self.engram.hash_step(token_ids, engram_batch, caches.history)
        h = self.engram(hidden, engram_batch, rows=rows)
        x = h.mean(dim=1)
        y = self.kda(x, kda_batch, caches.state, caches.conv)
        return _StepOut(rows, h, x, y, h + y[:, None, :])


# ----------------------------------------------------------------------- the run


class _Run:
    """The demo's block, inputs, batches and caches, and its three serving steps.

    Slots: prompt ``n`` lives in slot ``n``, its checkpoint in slot ``N + n``, the
    resumed copy in slot ``2N``."""

    def __init__(self, cfg: DemoConfig, device: torch.device, dtype: torch.dtype, seed: int):
        from ..engram.layout import EngramLayout
        from ..layers import EngramBatch, EngramLayer, KDABatch, KimiDeltaAttention

        self.cfg, self.device, self.dtype = cfg, device, dtype
        gen = torch.Generator().manual_seed(seed)
        self.layout = EngramLayout.build(layer_ids=[ENGRAM_LAYER_ID], max_ngram=cfg.max_ngram,
                                         n_heads=cfg.engram_heads, head_dim=cfg.engram_head_dim,
                                         vocab_size=cfg.table_floor, compressed_vocab_size=cfg.vocab, pad_id=0,
                                         seed=seed)
        storage = "bf16" if dtype == torch.bfloat16 else "fp32"
        engram = EngramLayer(self.layout, ENGRAM_LAYER_ID, cfg.hidden, cfg.hc, eps=ENGRAM_EPS, storage=storage,
                             dtype=dtype, device=device)
        kda = KimiDeltaAttention(cfg.hidden, cfg.kda_heads, cfg.head_dim, gate_low_rank_dim=cfg.gate_rank,
                                 output_gate_low_rank_dim=cfg.gate_rank, lower_bound=KDA_LOWER_BOUND, dtype=dtype,
                                 device=device)
        # Full fp32 checkpoint tensors: the references take them unrounded.
        self.engram_weights = engram.reset_parameters(gen)
        self.kda_weights = kda.reset_parameters(gen)
        self.block = _HybridBlock(engram, kda)

        lengths = list(cfg.prompt_lengths)
        N, D = len(lengths), cfg.decode_steps
        self.lengths, self.N, self.D = lengths, N, D
        self.slots = 2 * N + 1
        self.checkpoints = [(L // KDA_CHECKPOINT_ALIGNMENT) * KDA_CHECKPOINT_ALIGNMENT for L in lengths]
        # Resume the prompt with the most tokens after its checkpoint.
        resumable = [n for n in range(N) if 0 < self.checkpoints[n] < lengths[n]]
        if not resumable:
            raise ValueError(f"prompt_lengths: no prompt has a checkpoint before its end, got {lengths}")
        self.resumed = max(resumable, key=lambda n: lengths[n] - self.checkpoints[n])
        self.copy_slot = 2 * N
        self.prefill_cu = [0] + torch.tensor(lengths).cumsum(0).tolist()
        self.full_cu = [0] + torch.tensor([L + D for L in lengths]).cumsum(0).tolist()

        # Every sequence's whole input (prompt + decode tokens), on the host.
        self.ids = [torch.randint(0, cfg.vocab, (L + D,), generator=gen) for L in lengths]
        self.hidden = [torch.randn(L + D, cfg.hc, cfg.hidden, generator=gen) for L in lengths]
        self.history_garbage = torch.randint(0, cfg.vocab, (self.slots, cfg.max_ngram - 1), generator=gen)

        dev = device
        on = lambda xs: torch.tensor(xs, device=dev)  # noqa: E731
        T = sum(lengths)
        self.prefill_batch = KDABatch.from_query_lens(
            on(lengths), torch.arange(N, device=dev), num_decode=0,
            checkpoint_offsets=on(self.checkpoints), checkpoint_indices=torch.arange(N, 2 * N, device=dev))
        r, p = self.resumed, self.checkpoints[self.resumed]
        self.resume_batch = KDABatch.from_query_lens(on([lengths[r] - p]), on([self.copy_slot]), on([True]),
                                                     num_decode=0)
        decode_slots = list(range(N)) + [self.copy_slot]
        self.decode_batch = KDABatch.from_query_lens(on([1] * (N + 1)), on(decode_slots), num_decode=N + 1)
        self.engram_batches = {}
        for name, batch, tokens in (("prefill", self.prefill_batch, T), ("resume", self.resume_batch, lengths[r] - p),
                                    ("decode", self.decode_batch, N + 1)):
            batch.validate(tokens, self.slots, self.slots)
            self.engram_batches[name] = EngramBatch.from_kda_batch(batch)
            self.engram_batches[name].validate(tokens, self.slots)

        self.prefill_ids = self._dev(torch.cat([i[:L] for i, L in zip(self.ids, lengths)]))
        self.prefill_hidden = self._dev(torch.cat([h[:L] for h, L in zip(self.hidden, lengths)]), dtype)
        self.resume_ids = self._dev(self.ids[r][p : lengths[r]])
        self.resume_hidden = self._dev(self.hidden[r][p : lengths[r]], dtype)
        decode_seqs = list(range(N)) + [r]  # the copy decodes its original's tokens
        self.decode_ids = [self._dev(torch.stack([self.ids[n][lengths[n] + t] for n in decode_seqs]))
                           for t in range(D)]
        self.decode_hidden = [self._dev(torch.stack([self.hidden[n][lengths[n] + t] for n in decode_seqs]), dtype)
                              for t in range(D)]
        self.caches = self.fresh_caches()

    def _dev(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return x.to(self.device, dtype) if dtype is not None else x.to(self.device)

    def fresh_caches(self) -> _Caches:
        """Caches as an engine hands them out: uninitialised. NaN and garbage ids make
        any read of a row that ``has_initial_state`` says not to read visible."""
        state, conv = self.block.kda.allocate_cache(self.slots)
        state.fill_(math.nan)
        conv.fill_(math.nan)
        return _Caches(state, conv, self.history_garbage.to(self.device))

    def prefill(self) -> _StepOut:
        return self.block(self.prefill_hidden, self.prefill_ids, self.prefill_batch, self.engram_batches["prefill"],
                          self.caches)

    def resume(self) -> _StepOut:
        self.caches.copy_row(self.copy_slot, self.N + self.resumed)
        return self.block(self.resume_hidden, self.resume_ids, self.resume_batch, self.engram_batches["resume"],
                          self.caches)

    def decode(self) -> list[_StepOut]:
        return [self.block(h, i, self.decode_batch, self.engram_batches["decode"], self.caches)
                for h, i in zip(self.decode_hidden, self.decode_ids)]

    def per_sequence(self, prefill: torch.Tensor, decode: list[torch.Tensor]) -> torch.Tensor:
        """Prefill rows and decode rows of a per-token result, regrouped sequence
        after sequence (prompt, then its decode tokens): the reference's order."""
        cu, parts = self.prefill_cu, []
        for n in range(self.N):
            parts.append(prefill[cu[n] : cu[n + 1]])
            parts.extend(d[n : n + 1] for d in decode)
        return torch.cat(parts)


class _GateCheck:
    """The Engram gate kernels on random inputs, fused and dim-sharded over 4 ranks
    simulated in one process (the single-rank block never runs the latter), and
    their references; the kernels and the references run apart so that a stage can
    time the kernels alone."""

    RANKS = 4

    def __init__(self, cfg: DemoConfig, device: torch.device, dtype: torch.dtype, seed: int):
        gen = torch.Generator().manual_seed(seed + 1)
        T, hc, dim = cfg.gate_check_tokens, cfg.hc, cfg.hidden
        rnd = lambda *s: torch.randn(*s, generator=gen).to(device, dtype)  # noqa: E731
        self.tokens = T
        self.hidden, self.kv = rnd(T, hc, dim), rnd(T, (hc + 1) * dim)
        self.q_weight, self.k_weight = rnd(hc, dim), rnd(hc, dim)
        self.mask = (torch.rand(T, generator=gen) > 0.2).to(device)

    def kernels(self) -> tuple[torch.Tensor, torch.Tensor]:
        from ..engram.gate import engram_post_wkv
        from ..engram.reference import shard_kv_by_dim
        from ..engram.sharded_gate import engram_gate_finish, engram_gate_partials

        args = (self.hidden, self.kv, self.q_weight, self.k_weight)
        fused = engram_post_wkv(*args, eps=ENGRAM_EPS, token_mask=self.mask)
        hc, P = self.hidden.shape[1], self.RANKS
        sends = [engram_gate_partials(self.hidden, local.contiguous(), self.q_weight, self.k_weight, rank=r, tp_size=P)
                 for r, local in enumerate(shard_kv_by_dim(self.kv, hc, P))]
        sharded = engram_gate_finish(self.hidden, torch.cat(sends, dim=0), tp_size=P, eps=ENGRAM_EPS,
                                     token_mask=self.mask)
        return fused, sharded

    def references(self) -> tuple[torch.Tensor, torch.Tensor]:
        from ..engram.reference import naive_engram_gate_sharded, naive_engram_post_wkv

        host = [t.float().cpu() for t in (self.hidden, self.kv, self.q_weight, self.k_weight)]
        mask = self.mask.cpu()
        return (naive_engram_post_wkv(*host, eps=ENGRAM_EPS, token_mask=mask),
                naive_engram_gate_sharded(*host, tp_size=self.RANKS, eps=ENGRAM_EPS, token_mask=mask))


def _check_resume(run: _Run, pre: _StepOut, res: _StepOut, bounds: DemoBounds, checks: DemoChecks) -> None:
    """The resumed prompt against the same tokens of the uninterrupted prefill."""
    r, p, caches, copy = run.resumed, run.checkpoints[run.resumed], run.caches, run.copy_slot
    same = slice(run.prefill_cu[r] + p, run.prefill_cu[r + 1])
    c = bounds.consistency
    checks.equal("resumed hash rows == uninterrupted", res.rows, pre.rows[same])
    checks.within("resumed Engram output vs uninterrupted", res.engram_out, pre.engram_out[same], c)
    checks.within("resumed KDA output vs uninterrupted", res.mixer_out, pre.mixer_out[same], c)
    checks.within("resumed KDA state vs uninterrupted", caches.state[copy], caches.state[r], c)
    checks.within("resumed conv window vs uninterrupted", caches.conv[copy], caches.conv[r], c)
    checks.equal("resumed hash history == uninterrupted", caches.history[copy], caches.history[r])


def _check_decode(run: _Run, dec: list[_StepOut], bounds: DemoBounds, checks: DemoChecks) -> None:
    """The resumed copy (last decode row) decodes as its original does."""
    r, copy, caches = run.resumed, run.N, run.caches
    c = bounds.consistency
    checks.equal("copy's decode hash rows == original's", torch.stack([d.rows[copy] for d in dec]),
                 torch.stack([d.rows[r] for d in dec]))
    checks.within("copy's decode KDA output vs original's", torch.stack([d.mixer_out[copy] for d in dec]),
                  torch.stack([d.mixer_out[r] for d in dec]), c)
    checks.within("copy's KDA state after decode vs original's", caches.state[run.copy_slot], caches.state[r], c)


def _references(run: _Run, mixer_in: torch.Tensor, ref_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Both layers in plain PyTorch over every sequence's whole token stream, each
    given what its kernel counterpart was given: the block's (rounded) input for
    Engram, the kernels' Engram output mean for KDA."""
    from ..engram.reference import naive_next_history, naive_ngram_hash
    from ..layers.reference import naive_engram_layer
    from ..layers.reference import naive_kda_layer

    ids, cu, kda = torch.cat(run.ids), run.full_cu, run.block.kda
    hidden_given = torch.cat([h.to(run.dtype) for h in run.hidden])
    engram = naive_engram_layer(run.layout, ENGRAM_LAYER_ID, run.engram_weights, hidden_given, ids, cu,
                                    eps=ENGRAM_EPS)
    y, state, conv = naive_kda_layer(run.kda_weights, mixer_in.float(), cu, num_heads=kda.num_heads,
                                         head_dim=kda.head_dim, lower_bound=kda.lower_bound, norm_eps=kda.norm_eps,
                                         dtype=ref_dtype)
    return {"rows": torch.as_tensor(naive_ngram_hash(ids, cu, run.layout)), "engram_out": engram, "mixer_out": y,
            "out": engram.double() + y.double()[:, None, :], "state": state, "conv": conv,
            "history": torch.as_tensor(naive_next_history(ids, cu, run.layout))}


def _check_references(run: _Run, got: dict, ref: dict, bounds: DemoBounds, checks: DemoChecks) -> None:
    N, caches = run.N, run.caches
    checks.equal("hash rows == reference", got["rows"], ref["rows"])
    checks.within("Engram output vs reference", got["engram_out"], ref["engram_out"], bounds.engram)
    checks.within("KDA output vs reference (on the same input)", got["mixer_out"], ref["mixer_out"], bounds.kda_out)
    checks.within("block output vs Engram + KDA references", got["out"], ref["out"], bounds.block)
    checks.within("KDA final states vs reference", caches.state[:N], ref["state"], bounds.kda_state)
    checks.within("conv windows vs reference", caches.conv[:N], ref["conv"], bounds.conv)
    checks.equal("hash histories == reference", caches.history[:N], ref["history"])


def _config_name(cfg: DemoConfig) -> str:
    return "real" if cfg == REAL else "small" if cfg == SMALL else "custom"


def run_demo(device: str | None = None, seed: int = 0, small: bool = False, config: DemoConfig | None = None) -> int:
    """Run the demo; returns the exit status (0: every check within its bound).

    ``small`` forces the CPU-sized configuration on a GPU (the CPU always uses it);
    ``config`` replaces the configuration altogether (the tests shrink it)."""
    check_seed(seed)
    dev = pick_device(device)
    # Kernel modules are imported only from here on, after pick_device has set up
    # the interpreter for a CPU run.
    from ..platform import interpreting

    on_gpu = dev.type == "cuda"
    # Under the interpreter (always on the CPU; on a GPU only if TRITON_INTERPRET
    # is set) real sizes would take hours and bf16 tl.dot is computed wrongly.
    compiled = on_gpu and not interpreting()
    cfg = config or (REAL if compiled and not small else SMALL)
    dtype = torch.bfloat16 if compiled else torch.float32
    ref_dtype = torch.float32 if dtype == torch.bfloat16 else torch.float64
    bounds = BF16_BOUNDS if dtype == torch.bfloat16 else FP32_BOUNDS
    checks = DemoChecks()
    where = torch.cuda.get_device_name(dev) if on_gpu else "CPU"
    where += "" if compiled else ", kernels under the Triton interpreter"
    print(f"kda-engram demo on {dev} ({where}), {str(dtype).replace('torch.', '')}, "
          f"{_config_name(cfg)} configuration")
    print(f"  block: Engram layer -> mean of the streams -> KDA layer, added to every stream; {cfg.describe()}")
    print(f"  references: plain PyTorch on the CPU in {str(ref_dtype).replace('torch.', '')}; bounds "
          + ("relative to the reference's max magnitude (bf16)" if bounds is BF16_BOUNDS else "absolute (fp32)")
          + "; exact for the integer hash rows and histories")
    total = time.perf_counter()

    with torch.no_grad():
        with _stage("build the block, weights, inputs, batches and caches", dev):
            run = _Run(cfg, dev, dtype, seed)
        print(f"  Engram table {run.layout.num_embeddings[0]:,} rows x {cfg.engram_head_dim}, "
              f"{sum(p.numel() for p in run.block.parameters()):,} block parameters, {run.slots} cache slots")

        gate = _GateCheck(cfg, dev, dtype, seed)
        if compiled:
            # The first call of every kernel compiles it; run everything once on
            # scratch caches so that the timed stages below are the steps' own.
            with _stage("warm-up: every step once while Triton compiles the kernels", dev):
                gate.kernels()
                run.prefill()
                run.resume()
                run.decode()
            run.caches = run.fresh_caches()

        with _stage(f"kernels on their own: the Engram gate, fused and dim-sharded over {gate.RANKS} ranks", dev):
            fused, sharded = gate.kernels()
        fused_ref, sharded_ref = gate.references()
        checks.within(f"fused gate vs reference, {gate.tokens} tokens", fused, fused_ref, bounds.gate_kernel)
        checks.within(f"dim-sharded gate vs reference, {gate.tokens} tokens", sharded, sharded_ref, bounds.gate_kernel)

        N, r, p = run.N, run.resumed, run.checkpoints[run.resumed]
        with _stage(f"prefill {N} prompts of {', '.join(map(str, run.lengths))} tokens, checkpoints at "
                    f"{', '.join(map(str, run.checkpoints))}", dev):
            pre = run.prefill()

        with _stage(f"resume prompt {r} from its checkpoint at {p}: rows copied to slot {run.copy_slot}, "
                    f"{run.lengths[r] - p} tokens prefilled", dev):
            res = run.resume()
        _check_resume(run, pre, res, bounds, checks)

        tokens = f"{run.D} token{'s' if run.D != 1 else ''}"
        with _stage(f"decode {tokens} for {N + 1} sequences ({N} prompts + the resumed copy)", dev):
            dec = run.decode()
        _check_decode(run, dec, bounds, checks)

        got = {name: run.per_sequence(getattr(pre, name), [getattr(d, name) for d in dec])
               for name in ("rows", "engram_out", "mixer_in", "mixer_out", "out")}
        with _stage(f"reference: the same {run.full_cu[-1]} tokens through the plain-PyTorch layers "
                    f"({str(ref_dtype).replace('torch.', '')}, CPU)", dev):
            ref = _references(run, got["mixer_in"], ref_dtype)
        _check_references(run, got, ref, bounds, checks)

    elapsed = time.perf_counter() - total
    if checks.failed:
        print(f"demo FAILED: {len(checks.failed)} of {checks.count} checks out of bounds: {', '.join(checks.failed)} "
              f"({elapsed:.1f} s)")
        return 1
    print(f"demo passed: all {checks.count} checks within their bounds ({elapsed:.1f} s)")
    return 0

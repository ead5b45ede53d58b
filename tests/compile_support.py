"""Shared machinery of the compile tests (``test_compile_sm90.py``, ``test_compile_amd.py``).

Drives the package's real entry points on CPU tensors with every ``*_kernel``
replaced by a recorder and the device facts of a target GPU patched in (so the
launchers make the choices they make on that GPU), then compiles each recorded
launch with Triton's own pipeline, its arguments specialised by Triton's launch
binder exactly as at a real launch (alignment and unit-stride facts decide
vectorisation, so registers and spills are the real kernel's).

Runs in a child process without ``TRITON_INTERPRET`` (the kernels must be real
``JITFunction``s); the test modules start it with :func:`run_child`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import triton


class Recorder:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` records the call."""

    def __init__(self, name, fn, calls):
        self.name, self.fn, self.calls = name, fn, calls

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((self.name, self.fn, args, kwargs))

        return launch

    def warmup(self, *args, grid, **kwargs):
        """The compile a launcher asks for to size a grid: recorded like a launch."""
        self.calls.append((self.name, self.fn, args, kwargs))


def specialize(fn, args, kwargs, backend):
    """``(signature, constexprs, attrs, options)`` of the compile that
    ``fn[grid](*args, **kwargs)`` would start on the GPU. Triton's own launch
    binder specialises the arguments as at a real launch: integers equal to 1
    become constexprs, pointers and integers divisible by 16 carry that fact
    (which is what lets the compiler vectorise loads and stores). Without it the
    compile is of a kernel no launch runs: all loads scalar, register and spill
    counts far from the real ones. (``create_function_from_signature`` and
    ``_pack_args`` are Triton's internals; triton is pinned to 3.6.0.)"""
    from triton.runtime.jit import create_function_from_signature

    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return signature, constexprs, attrs, options


def _import_kernel_modules():
    """Every module that defines or launches a kernel, before the recorders go in."""
    import importlib

    for name in ("kda_engram.engram.hashing", "kda_engram.engram.table", "kda_engram.engram.gate",
                 "kda_engram.engram.sharded_gate", "kda_engram.engram.history", "kda_engram.kda.chunk",
                 "kda_engram.kda.conv", "kda_engram.kda.decode", "kda_engram.kda.fused_decode",
                 "kda_engram.kda.prologue", "kda_engram.kda.hopper.folded_prologue", "kda_engram.kda.hopper.walk",
                 "kda_engram.kda.hopper.prologue",
                 "kda_engram.kda.metadata", "kda_engram.layers", "kda_engram.ops", "kda_engram.tools.demo",
                 "kda_engram.integrations.vllm_engram_history"):
        importlib.import_module(name)


def patch_device(calls, arch: str, compute_units: int) -> set[str]:
    """Replace every ``*_kernel`` of the package by a :class:`Recorder` and make the
    launchers see a compiled ``arch`` GPU with ``compute_units`` units (the facts are
    patched in :mod:`kda_engram.platform` and wherever a module imported them).
    Returns the names of all kernels the package defines."""
    import kda_engram.platform as platform

    _import_kernel_modules()
    facts = {
        "is_gpu": lambda device=None: True,
        "num_compute_units": lambda device=None: compute_units,
        "arch": lambda device=None: arch,
        "interpreting": lambda: False,
    }
    for fn in facts.values():
        fn.device_fact = True  # marks a patched fact, so a second patch finds it again
    originals = {name: getattr(platform, name) for name in facts}
    for name, fn in facts.items():
        setattr(platform, name, fn)
    modules = [m for n, m in sys.modules.items() if n.startswith("kda_engram") and m is not None]
    defined = set()
    for module in modules:
        for name, obj in list(vars(module).items()):
            if isinstance(obj, triton.runtime.jit.JITFunction) and name.endswith("_kernel"):
                setattr(module, name, Recorder(name, obj, calls))
                defined.add(name)
            elif isinstance(obj, Recorder):
                setattr(module, name, Recorder(obj.name, obj.fn, calls))
                defined.add(obj.name)
            if name == "check_kernel_device":
                # CPU tensors stand in for GPU ones here (the recorders launch nothing).
                setattr(module, name, lambda name, x: None)
            if name == "can_read_back":
                # The serving layers read their verdicts back by default; the
                # recorders compute none, so the layers run their host rules only
                # (as under a CUDA-graph capture).
                setattr(module, name, lambda: False)
            if name == "resident_programs_per_cu":
                # The persistent gate sizes its grid from the compiled kernel on the
                # GPU; here 4 programs per unit (what dim 5120 holds on an H200).
                setattr(module, name, lambda compiled, device: 4)
            if module is not platform and name in facts and (obj is originals[name] or getattr(obj, "device_fact", False)):
                setattr(module, name, facts[name])
    # The one-launch rule kernels are recorders too, so their verdicts are never
    # computed: reading one back is meaningless here (values are the other tests' job).
    # EntryChecks (the deferred verdict of every entry point) overrides run, so it
    # is silenced too: a verdict left pending here would be raised by the next call.
    from kda_engram.validation.common import DeviceChecks
    from kda_engram.validation.entry import EntryChecks

    DeviceChecks.run = lambda self: None
    EntryChecks.run = lambda self: None
    # Heuristics cached per device would keep the previous target's answer.
    import kda_engram.kda.groups as groups

    groups._chunk_groups_cached.cache_clear()
    return defined


def drive(calls, arch: str, compute_units: int) -> set[str]:
    """Run the package's entry points on CPU tensors with the recorders in place:
    the demo's production configuration (bf16, K = V = 128, Engram dim 5120 x hc 4)
    end to end, plus the launch variants the demo's batch does not reach. Returns
    the names of all kernels the package defines (a kernel defined and never
    launched here is one no compile test checks: the tests fail on it)."""
    import torch

    defined = patch_device(calls, arch, compute_units)
    import kda_engram.tools.demo as demo
    from kda_engram.engram import engram_gate_finish, engram_gate_partials, engram_post_wkv
    from kda_engram.engram.reference import shard_kv_by_dim
    from kda_engram.engram.table import EngramTable
    from kda_engram.kda.prefill import chunk_kda_prefill

    dev, dt = torch.device("cpu"), torch.bfloat16
    with torch.no_grad():
        # The Engram layer (hashing, table, gate, history) and the KDA layer
        # (prologue with the conv, chunk walk with state cache and checkpoints,
        # decode, conv decode and checkpoint).
        cfg = demo.REAL
        run = demo._Run(cfg, dev, dt, 0)
        demo._GateCheck(cfg, dev, dt, 0).kernels()
        run.prefill()
        run.resume()
        run.decode()
        # Gate geometries the demo's batch may not reach: the wide single pass
        # (dims 5120 and 2560), two passes (dim 6144), the register row (dim 1024).
        for T, dim in ((64, 5120), (4096, 2560), (64, 6144), (64, 1024)):
            hidden = torch.zeros(T, 4, dim, dtype=dt)
            kv = torch.zeros(T, 5 * dim, dtype=dt)
            w = torch.ones(4, dim, dtype=dt)
            engram_post_wkv(hidden, kv, w, w, eps=1e-6, token_mask=torch.ones(T, dtype=torch.bool))
        # The persistent single pass (its grid is sized from a compiled kernel on a
        # GPU; here forced to 4 programs per unit).
        for dim in (5120, 2560):
            hidden, kv, w = torch.zeros(4096, 4, dim, dtype=dt), torch.zeros(4096, 5 * dim, dtype=dt), torch.ones(4, dim, dtype=dt)
            engram_post_wkv(hidden, kv, w, w, eps=1e-6, programs=4 * compute_units)
        hidden, kv = torch.zeros(64, 4, 5120, dtype=dt), torch.zeros(64, 5 * 5120, dtype=dt)
        w = torch.ones(4, 5120, dtype=dt)
        local = shard_kv_by_dim(kv, 4, 4)[0].contiguous()
        send = engram_gate_partials(hidden, local, w, w, rank=0, tp_size=4)
        engram_gate_finish(hidden, torch.cat([send] * 4), tp_size=4, eps=1e-6)
        # Both fp8 decodes of the table gather.
        for decode in ("native", "integer"):
            table = EngramTable([1009, 1013], 256, storage="fp8", device=dev)
            table.fp8_decode = decode
            table.lookup(torch.tensor([[0, 1009]] * 8, dtype=torch.int32))  # a row of each column's table
        # A parallel-group prefill, with the conv and no conv state.
        H, K, T = 4, 128, 4096
        x = {n: torch.zeros(1, T, H, K, dtype=dt) for n in ("q", "k", "v", "raw_g")}
        chunk_kda_prefill(x["q"], x["k"], x["v"], x["raw_g"], torch.zeros(1, T, H, dtype=dt), torch.zeros(H),
                          torch.zeros(H * K), lower_bound=-5.0, cu_seqlens=torch.tensor([0, T], dtype=torch.int32),
                          initial_state=torch.zeros(1, H, K, K), output_final_state=True, groups=4,
                          conv_weight=torch.zeros(3 * H * K, 4, dtype=dt), check_inputs=False)
        # The chunk-metadata kernel: on CPU tensors prepare_chunk_metadata takes the
        # torch functions unless the interpreter runs, so it is told it does.
        import kda_engram.kda.metadata as metadata

        real = metadata.interpreting
        metadata.interpreting = lambda: True
        try:
            metadata.prepare_chunk_metadata(torch.tensor([0, 100, 4096], dtype=torch.int32), 4096)
        finally:
            metadata.interpreting = real
        drive_state_variants()
        drive_vllm_engram_hash()
        if arch == "sm_90":
            drive_hopper_variants()
    return defined if arch == "sm_90" else defined - HOPPER_KERNELS


def drive_vllm_engram_hash() -> None:
    """vLLM's DeepSeek-V4.1 n-gram hash (integrations/vllm_engram_history.py) at a
    serving batch, as vLLM passes it (int32 ids and map, int64 positions, bool masks,
    two layers of 3-grams over 8 heads): V2 (no cache) and the V1 slot cache, a
    lookback window of depth 2."""
    import torch

    from kda_engram.integrations.vllm_engram_history import vllm_engram_hash

    T, R, L, heads = 4096, 64, 2, 8
    tables = (torch.ones(L, 3, dtype=torch.int64), torch.ones(L, 2, heads, dtype=torch.int64),
              torch.zeros(L, 2 * heads, dtype=torch.int64))
    for cache, table in ((None, None), (torch.zeros(8192, dtype=torch.int32), torch.zeros(R, 32, dtype=torch.int32))):
        vllm_engram_hash(torch.zeros(T, dtype=torch.int32), torch.zeros(129280, dtype=torch.int32),
                         torch.zeros(T, dtype=torch.bool), torch.zeros(T, dtype=torch.int64),
                         torch.zeros(R + 1, dtype=torch.int32), torch.zeros(R, 2, dtype=torch.int32),
                         torch.zeros(R, 2, dtype=torch.bool), *tables, torch.zeros(T, L, 2 * heads, dtype=torch.int32),
                         max_ngram=3, n_heads=heads, pad_id=2, cache=cache, block_table=table, cache_block_size=64,
                         dead_id=-1)


#: The kernels of the Hopper prefill path, launched on sm_90 only.
HOPPER_KERNELS = {"_folded_walk_kernel", "_kda_prologue_fold_kernel", "_gluon_prologue_kernel", "_fused_prefill_kernel"}


def drive_hopper_variants() -> None:
    """The Hopper prefill path (folded prologue + Gluon walk) at the production
    shapes (bf16, K = V = 128), called directly (the dispatcher sends CPU tensors to
    the portable path): every state mode of the walk (none, dense fp32 state in and
    out, a bf16 cache with indexed bf16 checkpoints, an fp32 cache with staging-row
    checkpoints), both gate forms and the conv path."""
    import torch

    from kda_engram.bundles import ConvArgs, KDAInputs, StateArgs
    from kda_engram.kda.hopper import hopper_kda_prefill
    from kda_engram.kda.metadata import prepare_chunk_metadata

    dt, H, D, T = torch.bfloat16, 4, 128, 4096
    cu = torch.tensor([0, 1000, T], dtype=torch.int32)
    offsets, indices = prepare_chunk_metadata(cu, T)
    x = {n: torch.zeros(1, T, H, D, dtype=dt) for n in ("q", "k", "v", "raw_g")}
    x.update(raw_beta=torch.zeros(1, T, H, dtype=dt), A_log=torch.zeros(H), dt_bias=torch.zeros(H * D),
             scale=D ** -0.5)
    base = dict(cu_seqlens=cu, chunk_offsets=offsets, chunk_indices=indices)

    def run(state=StateArgs(), conv=ConvArgs(), **inputs):
        hopper_kda_prefill(KDAInputs.pick({**x, **inputs}), **base, out=out, state=state, conv=conv)

    with torch.no_grad():
        out = torch.empty(1, T, H, D, dtype=dt)
        run(lower_bound=-5.0)
        run(StateArgs(initial_state=torch.zeros(2, H, D, D), output_final_state=True), lower_bound=None)
        for sd, indexed in ((dt, True), (torch.float32, False)):
            cache = torch.zeros(6, H, D, D, dtype=sd)
            run(StateArgs(state_cache=cache, state_indices=torch.tensor([0, 1]),
                          has_initial_state=torch.ones(2, dtype=torch.bool), checkpoint_state=cache,
                          checkpoint_offsets=torch.tensor([512, 1024]),
                          checkpoint_state_indices=torch.tensor([2, 3]) if indexed else None), lower_bound=-5.0)
        C = 3 * H * D
        proj = torch.zeros(1, T, C, dtype=dt)
        bands = [proj[..., i * H * D:(i + 1) * H * D].view(1, T, H, D) for i in range(3)]
        run(conv=ConvArgs(conv_weight=torch.zeros(C, 4, dtype=dt)), q=bands[0], k=bands[1], v=bands[2],
            lower_bound=-5.0)
        # The walk with its warp-specialised TMA loader (the fused prefill's consumer side).
        from kda_engram.kda.hopper.walk import folded_walk

        cache = torch.zeros(6, H, D, D)
        qg, kd, tf = (torch.zeros(1, T, H, D, dtype=dt) for _ in range(3))
        folded_walk(qg, kd, tf, torch.zeros(1, T, H, 64, dtype=dt), x["v"], torch.zeros(int(offsets[-1]), H, D), out,
                    D ** -0.5, cu, offsets, state_cache=cache, state_indices=torch.tensor([0, 1]),
                    has_initial_state=torch.ones(2, dtype=torch.uint8), checkpoint_state=cache,
                    checkpoint_offsets=torch.tensor([512, 1024]), checkpoint_state_indices=torch.tensor([2, 3]),
                    warp_specialized=True)
    drive_gluon_prologue_variants()
    drive_fused_variants()


def drive_fused_variants() -> None:
    """The fused Hopper prefill (kda/hopper/fused.py) through its backend at the
    production shapes: no state, dense fp32 state in and out with an fp32 raw gate and
    q / k / beta as given, a bf16 cache with indexed bf16 checkpoints; with the exact
    diagonal blocks (``EXACT_DIAG``): the softplus gate on the cache, a precomputed log
    decay in fp32 with dense state, a bounded gate past the anchored span; and the
    kernel with two producer warpgroups (``producer_warps=8``, launched directly)."""
    import torch

    from kda_engram.bundles import ConvArgs, KDAInputs, StateArgs
    from kda_engram.kda.hopper.fused_prefill import fused_kda_prefill

    dt, H, D, T = torch.bfloat16, 4, 128, 4096
    cu = torch.tensor([0, 1000, T], dtype=torch.int32)
    x = {n: torch.zeros(1, T, H, D, dtype=dt) for n in ("q", "k", "v", "raw_g")}
    x.update(raw_beta=torch.zeros(1, T, H, dtype=dt), A_log=torch.zeros(H), dt_bias=torch.zeros(H * D),
             scale=D ** -0.5, lower_bound=-5.0)
    out = torch.empty(1, T, H, D, dtype=dt)

    def run(state=StateArgs(), **inputs):
        fused_kda_prefill(KDAInputs.pick({**x, **inputs}), cu_seqlens=cu, chunk_offsets=None, chunk_indices=None,
                          out=out, state=state, conv=ConvArgs())

    with torch.no_grad():
        run()
        run(StateArgs(initial_state=torch.zeros(2, H, D, D), output_final_state=True),
            raw_g=torch.zeros(1, T, H, D), qk_l2norm=False, beta_sigmoid=False)
        cache = torch.zeros(6, H, D, D, dtype=dt)
        cached = StateArgs(state_cache=cache, state_indices=torch.tensor([0, 1]),
                           has_initial_state=torch.ones(2, dtype=torch.bool), checkpoint_state=cache,
                           checkpoint_offsets=torch.tensor([512, 1024]), checkpoint_state_indices=torch.tensor([2, 3]))
        run(cached)
        run(cached, lower_bound=None)
        run(StateArgs(initial_state=torch.zeros(2, H, D, D), output_final_state=True), raw_g=torch.zeros(1, T, H, D),
            gate="log_decay", lower_bound=None, A_log=None, dt_bias=None)
        run(lower_bound=-8.0)
        # Two producer warpgroups (not the backend's default): the bounded gate, dense state.
        from kda_engram.kda.hopper.fused import fused_prefill

        fused_prefill(x["q"], x["k"], x["v"], x["raw_g"], x["raw_beta"], x["A_log"], x["dt_bias"], out, x["scale"],
                      cu, lower_bound=-5.0, initial_state=torch.zeros(2, H, D, D),
                      final_state=torch.zeros(2, H, D, D), producer_warps=8)


def drive_gluon_prologue_variants() -> None:
    """The Gluon folded prologue (kda/hopper/prologue.py; not yet on the prefill path)
    at the production shapes: the default input forms, q / k / beta as given
    (``qk_l2norm=False, beta_sigmoid=False``), and strided bands of a fused projection
    (the conv's output bands are packed; raw bands are what a caller without the conv passes)."""
    import torch

    from kda_engram.bundles import KDAInputs
    from kda_engram.kda.hopper.prologue import gluon_folded_prologue
    from kda_engram.kda.metadata import prepare_chunk_metadata

    dt, H, D, T = torch.bfloat16, 4, 128, 4096
    cu = torch.tensor([0, 1000, T], dtype=torch.int32)
    _, indices = prepare_chunk_metadata(cu, T)
    x = KDAInputs(*(torch.zeros(1, T, H, D, dtype=dt) for _ in range(4)), torch.zeros(1, T, H, dtype=dt),
                  torch.zeros(H), torch.zeros(H * D), lower_bound=-5.0)
    with torch.no_grad():
        gluon_folded_prologue(x, cu, indices)()
        gluon_folded_prologue(x.replace(qk_l2norm=False, beta_sigmoid=False), cu, indices)()
        proj = torch.zeros(1, T, 4 * H * D + H, dtype=dt)
        q, k, v, g = (proj[..., i * H * D:(i + 1) * H * D].view(1, T, H, D) for i in range(4))
        gluon_folded_prologue(x.replace(q=q, k=k, v=v, raw_g=g, raw_beta=proj[..., 4 * H * D:]), cu, indices)()


def drive_state_variants() -> None:
    """The bf16/fp32 state-cache variants (decode, multi-token decode, prefill walk
    with a bf16 cache and checkpoints, grouped walk on a bf16 cache) and the fused
    layer decode step, at the production shapes (bf16 inputs, K = V = 128)."""
    import torch

    from kda_engram.kda.conv import kda_conv_decode
    from kda_engram.kda.decode import kda_decode, kda_decode_multi
    from kda_engram.kda.fused_decode import kda_layer_decode_step
    from kda_engram.kda.prefill import chunk_kda_prefill

    dt, B, H, D = torch.bfloat16, 4, 32, 128
    with torch.no_grad():
        for sd in (torch.float32, dt):
            for S in (None, 4):
                lead = (B,) if S is None else (B, S)
                x = {n: torch.zeros(*lead, H, D, dtype=dt) for n in ("q", "k", "v", "raw_g")}
                idx = torch.arange(B * (S or 1), dtype=torch.int32).view(*lead)
                cache = torch.zeros(B * (S or 1), H, D, D, dtype=sd)
                fn = kda_decode if S is None else kda_decode_multi
                fn(**x, raw_beta=torch.zeros(*lead, H, dtype=dt), A_log=torch.zeros(H), dt_bias=torch.zeros(H * D),
                   state_cache=cache, state_indices=idx, lower_bound=-5.0, check_inputs=False)
                if S is not None:  # vLLM's speculative verify: packed tokens, accepted counts, null row 0
                    packed = {n: t.view(1, B * S, H, D) for n, t in x.items()}
                    kda_decode_multi(**packed, raw_beta=torch.zeros(1, B * S, H, dtype=dt), A_log=torch.zeros(H),
                                     dt_bias=torch.zeros(H * D), state_cache=cache, state_indices=idx,
                                     cu_seqlens=torch.arange(B + 1, dtype=torch.int32) * S,
                                     num_accepted_tokens=torch.ones(B, dtype=torch.int32), null_row=0,
                                     lower_bound=-5.0, check_inputs=False)
                # The fused step reads strided bands of one projection row (Kimi-Linear layout).
                C = 3 * H * D
                proj = torch.zeros(*lead, C + H * D + H + H * D, dtype=dt)
                kda_layer_decode_step(
                    proj[..., :C], proj[..., C: C + H * D], proj[..., C + H * D: C + H * D + H],
                    proj[..., C + H * D + H:], torch.zeros(C, 4, dtype=dt),
                    torch.zeros(B * (S or 1), C, 3, dtype=dt), idx, torch.zeros(H), torch.zeros(H * D),
                    torch.ones(D, dtype=dt), cache, idx, lower_bound=-5.0, check_inputs=False)
                if S is None:  # the layer's unfused decode step (fused_decode=False) still runs the conv launch
                    kda_conv_decode(proj[:, :C], torch.zeros(C, 4, dtype=dt), torch.zeros(B, C, 3, dtype=dt), idx,
                                    out_dtype=torch.float32, check_inputs=False)
        # The decode's index rules (one program): a serving batch and the largest.
        from kda_engram.validation.index_rules import MAX_ONE_PROGRAM_INDICES, index_rules

        from kda_engram.validation.common import DeviceChecks
        from kda_engram.validation.index_rules import cu_seqlens_rules, guard_tensors, index_set_rules

        for n in (256, MAX_ONE_PROGRAM_INDICES):
            index_rules(DeviceChecks(), "state_indices", torch.arange(n, dtype=torch.int32), n)
            cu_seqlens_rules(torch.arange(n + 1, dtype=torch.int32), n, covers_all=True)
            # A layer step's index sets (decode + prefill segments per cache) and its guards.
            rows = torch.arange(n, dtype=torch.int32)
            index_set_rules(DeviceChecks(), [(name, [rows[: n // 2], rows[n // 2:]], n) for name in ("s", "c", "k")])
            guard_tensors(torch.zeros(8, dtype=torch.int64), [(rows, -1)] * 8)
        drive_batch_rules()
        # A prefill's state and checkpoint rules (one program): every part on, the
        # snapshots into the state cache itself, at a serving size and the largest.
        from kda_engram.validation.index_rules import MAX_STATE_RULE_SEQS, state_rules

        for n in (256, MAX_STATE_RULE_SEQS):
            seqs = torch.arange(n, dtype=torch.int32)
            state_rules(DeviceChecks(), num_seqs=n, cu_seqlens=torch.arange(n + 1, dtype=torch.int32) * 64,
                        state_indices=seqs, slots=2 * n, checkpoint_offsets=torch.full((n,), 64, dtype=torch.int32),
                        checkpoint_state_indices=seqs + n, checkpoint_rows=2 * n, same_cache=True, alignment=64,
                        offsets_message="offsets {} {} {}")
        # kda_decode_multi's rules (one program): S = 4 steps, a serving batch and the largest.
        from kda_engram.validation.index_rules import decode_multi_rules

        for b in (64, MAX_STATE_RULE_SEQS // 4):
            written = torch.arange(4 * b, dtype=torch.int32).view(b, 4)
            decode_multi_rules(DeviceChecks(), written, written[:, 0], 4 * b)
        Hp, T = 4, 4096
        x = {n: torch.zeros(1, T, Hp, D, dtype=dt) for n in ("q", "k", "v", "raw_g")}
        common = dict(raw_beta=torch.zeros(1, T, Hp, dtype=dt), A_log=torch.zeros(Hp), dt_bias=torch.zeros(Hp * D),
                      lower_bound=-5.0, cu_seqlens=torch.tensor([0, T // 2, T], dtype=torch.int32),
                      check_inputs=False)
        cache = torch.zeros(6, Hp, D, D, dtype=dt)
        state = dict(state_cache=cache, state_indices=torch.tensor([0, 1]),
                     has_initial_state=torch.ones(2, dtype=torch.bool))
        # Serial walk: bf16 cache row and bf16 checkpoints into the cache.
        chunk_kda_prefill(**x, **common, **state, checkpoint_state=cache,
                          checkpoint_offsets=torch.tensor([1024, 2048]), checkpoint_state_indices=torch.tensor([2, 3]),
                          groups=1)
        # Grouped walk (pass one, scan, pass two) on a bf16 cache.
        chunk_kda_prefill(**x, **common, **state, groups=4)
        # The unbounded gates, which take the exact diagonal blocks: the softplus
        # gate, and the input form fla / Hugging Face callers pass
        # (kda_engram.integrations.fla): a precomputed log decay, beta after its
        # sigmoid; prefill and both decodes.
        forms = dict(A_log=None, dt_bias=None, lower_bound=None, gate="log_decay", beta_sigmoid=False)
        chunk_kda_prefill(**x, **{**common, "lower_bound": None}, initial_state=torch.zeros(2, Hp, D, D),
                          output_final_state=True)
        chunk_kda_prefill(**x, **{**common, **forms}, initial_state=torch.zeros(2, Hp, D, D), output_final_state=True)
        for S in (None, 4):
            lead = (B,) if S is None else (B, S)
            xd = {n: torch.zeros(*lead, H, D, dtype=dt) for n in ("q", "k", "v", "raw_g")}
            fn = kda_decode if S is None else kda_decode_multi
            fn(**xd, raw_beta=torch.zeros(*lead, H, dtype=dt), **forms,
               state_cache=torch.zeros(B * (S or 1), H, D, D), check_inputs=False,
               state_indices=torch.arange(B * (S or 1), dtype=torch.int32).view(*lead))


def drive_batch_rules() -> None:
    """A serving layer step's batch rules (one program, the guarded copies in the same
    launch): a decode-only batch of 256 rows (two sets, no prefill part), a mixed
    batch with checkpoints into the caches themselves (query lengths, offsets, the
    sets taking the checkpoint rows), and the largest batch with separate checkpoint
    buffers (four sets, every part on)."""
    import torch

    from kda_engram.layers.kda import KDABatch
    from kda_engram.validation.common import DeviceChecks
    from kda_engram.validation.index_rules import MAX_ONE_PROGRAM_INDICES
    from kda_engram.validation.kda_batch import check_kda_batch

    for B, N, ckpt, separate in ((256, 0, False, False), (64, 8, True, False),
                                 (MAX_ONE_PROGRAM_INDICES // 2, MAX_ONE_PROGRAM_INDICES // 4, True, True)):
        rows = torch.arange(B + N, dtype=torch.int32)
        lens = torch.tensor([1] * B + [128] * N, dtype=torch.int32)
        extra = {}
        if ckpt:
            extra = dict(checkpoint_offsets=torch.full((B + N,), 64, dtype=torch.int32),
                         checkpoint_indices=rows + B + N)
        batch = KDABatch.from_query_lens(lens, rows, num_decode=B, **extra)
        slots = 2 * (B + N)
        ck = dict(checkpoint_rows=slots, conv_checkpoint_rows=slots) if separate else {}
        check_kda_batch(batch, B + 128 * N, None, DeviceChecks(), state_slots=slots, conv_slots=slots, guard=True,
                        **ck)


def compile_calls(calls, target, resources, on_row=None):
    """Compile every distinct recorded launch for ``target``; ``resources(kernel,
    options)`` gives the row's resource fields. Returns ``(rows, failures)``."""
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

    backend = make_backend(target)
    seen, rows, failures = set(), [], []
    for name, fn, args, kwargs in calls:
        signature, constexprs, attrs, options = specialize(fn, args, dict(kwargs), backend)
        const = {fn.arg_names[path[0]]: value for path, value in constexprs.items() if len(path) == 1}
        key = (name, repr(signature), repr(sorted((k, repr(v)) for k, v in constexprs.items())),
               repr(sorted(attrs.items())), repr(options))
        if key in seen:
            continue
        seen.add(key)
        try:
            source = GluonASTSource if isinstance(fn, GluonJITFunction) else ASTSource
            kernel = triton.compile(source(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                                    target=target, options=options.__dict__)
        except Exception as exc:  # noqa: BLE001 - every failure is reported, then the run fails
            root = exc
            while root.__cause__ is not None or root.__context__ is not None:
                root = root.__cause__ or root.__context__
            cause = f" (root: {type(root).__name__}: {str(root)[-2000:]})" if root is not exc else ""
            failures.append(f"{name} {const}: {type(exc).__name__}: {str(exc)[:2000]}{cause}")
            continue
        const_json = {k: (v if isinstance(v, (int, float, bool, str)) or v is None else str(v)) for k, v in const.items()}
        row = dict(kernel=name, constexprs=const_json,
                   options=dict(num_warps=options.num_warps, num_stages=options.num_stages,
                                maxnreg=getattr(options, "maxnreg", None)),
                   **resources(kernel, options))
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows, failures


def shape_label(row) -> str:
    """The row's upper-case constexprs, ``K=V`` style (what tells launches apart)."""
    return " ".join(f"{k}={v}" for k, v in row["constexprs"].items() if k.isupper())


def run_child(script: str, args, tmp_path, timeout: int = 1800):
    """Run ``python script *args`` without ``TRITON_INTERPRET``, Triton's cache under
    ``tmp_path``; returns the ``CompletedProcess``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                    env.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, script, *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=timeout)


def load_rows(path):
    with open(path) as fh:
        return json.load(fh)

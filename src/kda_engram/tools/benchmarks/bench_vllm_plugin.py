"""vLLM 0.33's own KDA and Engram kernel calls against the kda-engram plugin's replacements, on one GPU in bf16.

    # where the vllm 0.33.0 wheel is (no GPU needed): the files the GPU run needs (0.5 MB)
    python -m kda_engram.tools.benchmarks.bench_vllm_plugin --prepare .vllm_files [--wheel PATH]
    # on the GPU machine, from the repository root, the folder carried along
    PYTHONPATH=src python -m kda_engram.tools.benchmarks.bench_vllm_plugin --vllm-files .vllm_files \\
        [--json FILE] [--quick] [--only SUBSTRING,...] [--no-graph] [--no-pdl]

``--prepare`` extracts vLLM's kernel-call files from the wheel, unmodified, with the
stubs around them and a CUDA platform (:mod:`kda_engram.tools.vllm_files`, the lists
the CPU conformance tests use). The GPU run puts that folder on ``sys.path`` as the
``vllm`` package and registers the plugin with its switch on (:func:`load_vllm`). For
each call a vLLM layer makes, vLLM's own function (``vllm_plugin.original``, checked to
reach none of ours) and the name as the layer reads it (ours) run on the same inputs,
built twice from one seed (calls update pools; vLLM's prefill without ``out`` writes
over ``v``). Each row, printed and saved as it finishes:

* ``max |d|`` / ``rel RMS`` of the outputs and states (final states, or the pool rows
  the call wrote; hash ids exactly); ``ok`` within ``--tolerance`` (rel RMS, bf16);
* each side's time (:func:`~kda_engram.tools.benchmarks.common.bench_ms`, one process,
  after a warm-up call each), ``ratio = vLLM ms / ours ms`` (above 1: ours faster).
  Eager timings include our device-side input checks; the decode-size calls are also
  replayed from a CUDA graph (``--no-graph`` skips).

The rows (bf16, H = 32, K = V = 128: Kimi-K3 and Kimi-Linear prefill, packed decode,
decode peel, speculative verify; the DeepSeek-V4.1 Engram gate and hash at 4096
tokens), their shapes and the measured runs: docs/design/vllm_plugin.md.
``--quick``: shorter timing, the prefill rows on the 16 x 2048 batch only. ``--no-pdl``:
vLLM's kernels without programmatic dependent launch. Exit status 0 when every row ran
and is ``ok``, 1 otherwise, 2 without a GPU or a prepared folder.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import math
import os
import sys
from types import SimpleNamespace

from ..vllm_files import VERSION, WheelNotFound, find_wheel, prepare, read_marker
from .common import bench_ms, cuda_graph_ms, no_gpu_exit

H, K, V = 32, 128, 128
LOWER_BOUND = -5.0
UNIFORM = [2048] * 16
RAGGED = [1, 7, 63, 64, 65, 127, 500, 1000, 1500, 2048, 3000, 4096, 5000, 17, 300, 2700]
DECODE_B, SPEC_N, SPEC_W, PADDING = 256, 256, 4, 8
ENGRAM_T, ENGRAM_DIM, ENGRAM_HC = 4096, 5120, 4
DEFAULT_TOLERANCE = 2e-2
#: Where the inputs live and the activations' dtype (module settings, so that a CPU
#: check can walk the rows at small sizes under the Triton interpreter).
DEVICE, DTYPE = "cuda", "bfloat16"

_KIMI = "vllm.models.kimi_k3"
_PREFILL = f"{_KIMI}.amd.ops.kda_prefill"
_KDA = {vendor: f"{_KIMI}.{vendor}.ops.third_party.kda" for vendor in ("amd", "nvidia")}
_ENGRAM = "vllm.models.deepseek_v41.common.engram"


# ------------------------------------------------------------------ loading vLLM


def load_vllm(folder: str):
    """vLLM's prepared files (``folder``) on ``sys.path`` as ``vllm``; every module
    the plugin patches imported, with those among the files that import a replaced
    name; then the plugin registered with its switch on, which replaces the names in
    them at once. Returns the plugin module; ``RuntimeError`` with one line when a
    target was not replaced.

    Imported before the plugin registers (in a vLLM process it registers first and
    its import hook patches each module as it loads), so that vLLM's own functions,
    the reference here, keep calling vLLM's own helpers: ``kda_prefill.py`` binds
    ``chunk_kda_with_fused_gate`` at import, and after the hook that is ours (which
    does not matter in vLLM, where ``chunk_kda_prefill`` itself is replaced).
    :func:`pair` checks that no reference reaches one of ours."""
    from ...integrations import vllm_plugin

    folder = os.path.abspath(folder)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    importlib.invalidate_caches()
    for module in dict.fromkeys(m for entry in vllm_plugin.REPLACEMENTS for m in (entry[0], *entry[3])):
        # The layers' own modules (kda.py) that import a name are not among the files.
        if importlib.util.find_spec(module) is not None:
            importlib.import_module(module)
    os.environ[vllm_plugin.SWITCH] = "all"  # every replacement, the slower ones too: they are timed
    vllm_plugin.register()
    missing = [f"{m}.{n}" for m, n, *_ in vllm_plugin.REPLACEMENTS if f"{m}.{n}" not in vllm_plugin.replaced()]
    if missing:
        where = sys.modules["vllm"].__file__
        raise RuntimeError(f"the plugin did not replace {', '.join(missing)} (vllm from {where})")
    return vllm_plugin


def reaches_ours(plugin, function) -> list[str]:
    """Where vLLM's ``function``, or a function of vLLM's it calls through its module
    globals (transitively), reads one of the plugin's replacements: ``module.function
    reads name`` for each (empty: vLLM's own code throughout)."""
    ours = {id(getattr(*plugin.resolve(sys.modules[m], n))) for m, n, *_ in plugin.REPLACEMENTS}
    found, seen, stack = [], set(), [function]
    while stack:
        f = inspect.unwrap(stack.pop())
        if not inspect.isfunction(f) or id(f) in seen:
            continue
        seen.add(id(f))
        for name in f.__code__.co_names:
            value = f.__globals__.get(name)
            if value is not None and id(value) in ours:
                found.append(f"{f.__module__}.{f.__qualname__} reads {name}")
            elif inspect.isfunction(value) and value.__module__.startswith("vllm."):
                stack.append(value)
    return found


def pair(plugin, module: str, name: str, layer_module: str | None = None, unread: tuple[str, ...] = ()):
    """``(vLLM's own, ours)`` for the target ``module.name``: ours is the name as the
    layer reads it (from ``layer_module``, default ``module``) after the plugin
    replaced it; ``RuntimeError`` when that is still vLLM's, or when vLLM's reaches
    one of ours (:func:`reaches_ours`) but for the names ``unread`` (replaced in the
    module that defines them, and not called with the arguments given here)."""
    theirs = plugin.original(f"{module}.{name}")
    ours = getattr(*plugin.resolve(sys.modules[layer_module or module], name))
    if ours is theirs:
        raise RuntimeError(f"{layer_module or module}.{name} is still vLLM's after the plugin registered")
    mixed = [r for r in reaches_ours(plugin, theirs) if r.rsplit(" ", 1)[-1] not in unread]
    if mixed:
        raise RuntimeError(f"vLLM's {module}.{name} reaches kda-engram's code: {'; '.join(mixed)}")
    return theirs, ours


# ------------------------------------------------------------------ inputs


def _gen(seed: int):
    import torch

    return torch.Generator(device=DEVICE).manual_seed(seed)


def _randn(g, *shape, scale=1.0, dtype=None):
    import torch

    x = torch.randn(*shape, generator=g, device=DEVICE) * scale
    return x if dtype is None else x.to(dtype)


def _rows(g, count: int, slots: int, padding: int = 0):
    """``count`` distinct pool rows in ``[1, slots)`` (int32), the last ``padding`` of
    them ``NULL_BLOCK_ID = 0``."""
    import torch

    rows = (torch.randperm(slots - 1, generator=g, device=DEVICE)[:count] + 1).to(torch.int32)
    if padding:
        rows[-padding:] = 0
    return rows


def prefill_inputs(lengths, seed: int, *, pool: bool = False) -> dict:
    """One prefill batch, as a layer hands it to the call: ``q, k, v, raw_g``
    ``[1, T, H, 128]``, ``raw_beta [1, T, H]`` bf16; ``A_log [H]``, ``g_bias
    [H*K]`` fp32; ``cu`` int32; every other sequence with an initial state (``h0``,
    zeros where none, as vLLM's gather gives it), or (``pool``) the paged pool of
    ``2N+1`` rows with ``rows`` / ``has`` and vLLM's precomputed chunk metadata;
    ``out [1, T, H, V]``."""
    import torch

    from vllm.third_party.flash_linear_attention.ops.index import prepare_chunk_indices, prepare_chunk_offsets

    g = _gen(seed)
    T, N = sum(lengths), len(lengths)
    bf = getattr(torch, DTYPE)
    x = dict(q=_randn(g, 1, T, H, K, dtype=bf), k=_randn(g, 1, T, H, K, dtype=bf), v=_randn(g, 1, T, H, V, dtype=bf),
             raw_g=_randn(g, 1, T, H, K, dtype=bf), raw_beta=_randn(g, 1, T, H, dtype=bf),
             A_log=_randn(g, H, scale=0.5), g_bias=_randn(g, H * K),
             cu=torch.tensor([0, *lengths], device=DEVICE).cumsum(0).to(torch.int32),
             out=torch.zeros(1, T, H, V, dtype=bf, device=DEVICE))
    has = torch.arange(N, device=DEVICE) % 2 == 0
    if pool:
        x.update(pool=_randn(g, 2 * N + 1, H, V, K, scale=0.5), rows=_rows(g, N, 2 * N + 1), has=has,
                 chunk_indices=prepare_chunk_indices(x["cu"], 64), chunk_offsets=prepare_chunk_offsets(x["cu"], 64))
    else:
        x["h0"] = _randn(g, N, H, V, K, scale=0.5) * has[:, None, None, None]
    return x


def decode_inputs(seed: int, *, tokens: int = 1, sequences: int | None = None) -> dict:
    """Decode-size inputs on a pool: ``packed`` ``[B, 2HK + HV]`` (the post-conv QKV),
    its per-token views ``q, k, v`` ``[1, T, H, 128]`` (one token stride, as the
    layers split it), ``raw_g``, ``raw_beta``, ``A_log``, ``dt_bias``; ``pool``; for
    one token per sequence ``rows [B]`` (the last :data:`PADDING` 0), else
    ``ssm [N, W]`` distinct rows, ``cu``, ``accepted`` in ``[1, W]``; ``out`` zeros."""
    import torch

    g = _gen(seed)
    bf = getattr(torch, DTYPE)
    sequences = sequences or DECODE_B
    T = sequences * tokens
    slots = T + sequences + 1
    packed = _randn(g, T, 2 * H * K + H * V, dtype=bf)
    q, k, v = (packed[:, i * H * K:(i + 1) * H * K].unflatten(1, (H, K))[None] for i in range(3))
    x = dict(packed=packed, q=q, k=k, v=v, raw_g=_randn(g, 1, T, H, K, dtype=bf), raw_beta=_randn(g, 1, T, H, dtype=bf),
             A_log=_randn(g, H, scale=0.5), dt_bias=_randn(g, H * K), pool=_randn(g, slots, H, V, K, scale=0.5),
             out=torch.zeros(1, T, H, V, dtype=bf, device=DEVICE),
             cu=(torch.arange(sequences + 1, device=DEVICE) * tokens).to(torch.int32))
    if tokens == 1:
        x["rows"] = _rows(g, sequences, slots, PADDING)
    else:
        x["ssm"] = _rows(g, T, slots).view(sequences, tokens)
        x["accepted"] = torch.randint(1, tokens + 1, (sequences,), generator=g, device=DEVICE).to(torch.int32)
    return x


def gate_inputs(seed: int, *, mask: bool) -> dict:
    """``Engram.forward``'s gate launch: ``hidden [T, hc, dim]``, ``kv [T, (hc+1)*dim]``
    (``wkv``'s output), ``q_weight``, ``k_weight`` ``[hc, dim]`` bf16, a token mask
    (about 1 in 8 tokens off) or none, ``out``."""
    import torch

    g = _gen(seed)
    bf = getattr(torch, DTYPE)
    T, hc, dim = ENGRAM_T, ENGRAM_HC, ENGRAM_DIM
    return dict(hidden=_randn(g, T, hc, dim, dtype=bf), kv=_randn(g, T, (hc + 1) * dim, dtype=bf),
                q_weight=_randn(g, hc, dim, dtype=bf), k_weight=_randn(g, hc, dim, dtype=bf),
                mask=(torch.rand(T, generator=g, device=DEVICE) > 0.125) if mask else None,
                out=torch.empty(T, hc, dim, dtype=bf, device=DEVICE), eps=1e-6, clamp_value=1e-6)


#: DeepSeek-V4.1's Engram hash configuration (``bench_engram_table``'s; the table
#: sizes are not read by the hash), and its tokenizer's vocabulary size (the token
#: map's length).
ENGRAM_CONFIG = dict(engram_layer_ids=[1, 14], engram_num_embeddings=[1 << 20] * 2, engram_max_ngram_size=4,
                     engram_n_heads=8, engram_head_dim=256, engram_vocab_size=16_000_000,
                     engram_compressed_vocab_size=99_092, engram_pad_token_id=2)
TOKENIZER_VOCAB = 129_280


def hash_inputs(seed: int, *, slot_cache: bool) -> dict:
    """``NgramHashState.forward``'s launch at :data:`ENGRAM_T` tokens: 8 prompt chunks
    (fresh ones from position 0, continued ones with a lookback window holding unknown
    ``-1`` and dead ids), 24 decodes, 8 CUDA-graph padding tokens past the last request;
    1 in 64 tokens dead. ``slot_cache``: vLLM's V1 runner, every lag before the chunk
    read from a cache of compressed ids (1 in 16 dead) through a block table of
    64-slot blocks (no lookback window: depth 0)."""
    import torch

    engram = sys.modules[_ENGRAM]
    g = _gen(seed)
    layout = engram.EngramLayout(SimpleNamespace(**ENGRAM_CONFIG))
    M, compressed = layout.max_ngram_size, layout.compressed_vocab_size
    token_map = torch.randint(0, compressed, (TOKENIZER_VOCAB,), generator=g, device=DEVICE).to(torch.int32)
    decodes, pad_tokens = 24, 8
    prompt = (ENGRAM_T - decodes - pad_tokens) // 8
    lengths = [prompt] * 7 + [ENGRAM_T - decodes - pad_tokens - 7 * prompt] + [1] * decodes
    R = len(lengths)
    starts = torch.randint(0, 20_000, (R,), generator=g, device=DEVICE)
    starts[::3] = 0  # fresh prompts (and some decodes at position 0)
    positions = torch.cat([torch.arange(n, device=DEVICE) + s for n, s in zip(lengths, starts.tolist())]
                          + [torch.randint(0, 20_000, (pad_tokens,), generator=g, device=DEVICE)])
    lookback = torch.randint(0, TOKENIZER_VOCAB, (R, M - 1), generator=g, device=DEVICE).to(torch.int32)
    lookback[torch.rand(R, M - 1, generator=g, device=DEVICE) < 0.05] = -1
    x = dict(input_ids=torch.randint(0, TOKENIZER_VOCAB, (ENGRAM_T,), generator=g, device=DEVICE).to(torch.int32),
             positions=positions, qsl=torch.tensor([0, *lengths], device=DEVICE).cumsum(0).to(torch.int32),
             dead=torch.rand(ENGRAM_T, generator=g, device=DEVICE) < 1 / 64, lookback=lookback,
             lookback_dead=torch.rand(R, M - 1, generator=g, device=DEVICE) < 0.02, token_map=token_map,
             pad_id=int(token_map[ENGRAM_CONFIG["engram_pad_token_id"]]),
             multipliers=engram.compute_hash_multipliers(layout.layer_ids, M, compressed).to(DEVICE),
             primes=torch.tensor(layout.primes, device=DEVICE), offsets=layout.offsets.to(DEVICE),
             cache=None, block_table=None, block_size=64,
             output=torch.empty(ENGRAM_T, len(layout.layer_ids), (M - 1) * layout.n_heads, dtype=torch.int32,
                                device=DEVICE))
    if slot_cache:
        blocks = int(positions.max()) // x["block_size"] + 1
        cache = torch.randint(0, compressed, (R * blocks * x["block_size"],), generator=g, device=DEVICE)
        cache[torch.rand(cache.shape[0], generator=g, device=DEVICE) < 1 / 16] = engram.DEAD_ID
        x.update(cache=cache.to(torch.int32), lookback=lookback[:, :0], lookback_dead=x["lookback_dead"][:, :0],
                 block_table=torch.randperm(R * blocks, generator=g, device=DEVICE).view(R, blocks).to(torch.int32))
    return x


# ------------------------------------------------------------------ the calls, as the layers make them


def call_chunk_gate(fn, x, *, out: bool, lower_bound):
    return fn(q=x["q"], k=x["k"], v=x["v"], raw_g=x["raw_g"], raw_beta=x["raw_beta"], A_log=x["A_log"],
              g_bias=x["g_bias"], lower_bound=lower_bound, initial_state=x["h0"], output_final_state=True,
              use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu"], **({"out": x["out"]} if out else {}))


def call_rocm_prefill(fn, x):
    return fn(q=x["q"], k=x["k"], v=x["v"], raw_g=x["raw_g"], raw_beta=x["raw_beta"], A_log=x["A_log"],
              g_bias=x["g_bias"], lower_bound=LOWER_BOUND, state_cache=x["pool"], state_indices=x["rows"],
              has_initial_state=x["has"], use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu"],
              chunk_indices=x["chunk_indices"], chunk_offsets=x["chunk_offsets"], backend="triton", out=x["out"],
              checkpoint_state=None, checkpoint_offsets=None, checkpoint_state_indices=None)


def call_packed(fn, x, *, out: bool):
    return fn(mixed_qkv=x["packed"], raw_g=x["raw_g"], raw_beta=x["raw_beta"], A_log=x["A_log"],
              dt_bias=x["dt_bias"], lower_bound=LOWER_BOUND, initial_state=x["pool"], state_indices=x["rows"],
              **({"out": x["out"]} if out else {}))


def call_recurrent(fn, x, *, uniform: int | None = None):
    kw = {} if uniform is None else {"uniform_sequence_length": uniform}
    spec = "ssm" in x
    return fn(q=x["q"], k=x["k"], v=x["v"], raw_g=x["raw_g"], raw_beta=x["raw_beta"], A_log=x["A_log"],
              dt_bias=x["dt_bias"], lower_bound=LOWER_BOUND, initial_state=x["pool"], cu_seqlens=x["cu"],
              ssm_state_indices=x["ssm"] if spec else x["rows"], num_accepted_tokens=x["accepted"] if spec else None,
              out=x["out"], **kw)


def launch_gate(kernel, x):
    """``Engram.forward``'s launch (no sequence parallelism: ``num_kv_tokens = T``)."""
    import triton

    hidden, kv, qw, kw, mask, out = (x[n] for n in ("hidden", "kv", "q_weight", "k_weight", "mask", "out"))
    T, hc, dim = hidden.shape
    block = triton.next_power_of_2(dim)
    kernel[(T * hc,)](hidden, kv, qw, kw, mask if mask is not None else hidden, out, T, *hidden.stride(),
                      *kv.stride(), *qw.stride(), *kw.stride(), mask.stride(0) if mask is not None else 0,
                      *out.stride(), x["eps"], x["clamp_value"], DIM=dim, HC_MULT=hc, BLOCK_SIZE=block,
                      HAS_MASK=mask is not None, num_warps=8 if block >= 2048 else 4)
    return out


def launch_hash(kernel, x):
    """``NgramHashState.forward``'s launch of the hash kernel (the V1 cache write
    before it is vLLM's own on both sides and is not timed)."""
    import triton

    engram = sys.modules[_ENGRAM]
    ids, positions, qsl, dead = x["input_ids"], x["positions"], x["qsl"], x["dead"]
    lookback, lookback_dead, cache, table, out = (x[n] for n in ("lookback", "lookback_dead", "cache",
                                                                 "block_table", "output"))
    T = ids.shape[0]
    L, M = x["multipliers"].shape
    heads = x["primes"].shape[-1]
    kernel[(triton.cdiv(T, 32), L)](
        ids, x["token_map"], dead, positions, table, qsl, x["multipliers"], x["primes"], x["offsets"], cache,
        lookback, lookback_dead, out, T, cache.shape[0] if cache is not None else 0, x["pad_id"],
        input_stride=ids.stride(0), mask_stride=dead.stride(0), position_stride=positions.stride(0),
        table_stride=table.stride(0) if table is not None else 0,
        table_col_stride=table.stride(1) if table is not None else 0, query_stride=qsl.stride(0),
        num_query_rows=qsl.numel() - 1, num_table_rows=table.shape[0] if table is not None else 0,
        max_blocks=table.shape[1] if table is not None else 0, cache_block_size=x["block_size"], MAX_NGRAM=M,
        num_heads=heads, BLOCK_T=32, BLOCK_H=triton.next_power_of_2(heads), dead_id=engram.DEAD_ID,
        lookback_depth=lookback.shape[1], lookback_row_stride=lookback.stride(0),
        lookback_col_stride=lookback.stride(1), lookback_mask_row_stride=lookback_dead.stride(0),
        lookback_mask_col_stride=lookback_dead.stride(1), num_warps=4)
    return out


def _final(x, result):
    return {"out": result[0], "state": result[1]}


def _written(x, result):
    """The output, and the pool rows the call wrote."""
    rows = x["ssm"] if "ssm" in x else x["rows"]
    if "accepted" in x:  # the verify writes a row per token
        rows = rows.flatten()
    rows = rows[rows > 0].long()
    out = result[0] if isinstance(result, tuple) else x["out"]
    return {"out": out, "state": x["pool"][rows]}


def cases(plugin, quick: bool) -> list[SimpleNamespace]:
    """Every row: ``call`` (its name), ``target``, ``shape``, ``make()`` (fresh inputs,
    the same each time), ``run(fn, x)``, ``observe(x, result)`` (what is compared),
    ``graph`` (time a CUDA-graph replay too), ``fns`` (vLLM's, ours)."""
    import functools

    rows = []

    def add(call, module, name, layer_module, shape, make, run, observe, graph=False, unread=()):
        rows.append(SimpleNamespace(call=call, target=f"{module}.{name}", shape=shape, make=make, run=run,
                                    observe=observe, graph=graph, layer_module=layer_module or module,
                                    fns=lambda m=module, n=name, lm=layer_module: pair(plugin, m, n, lm, unread)))

    batches = [("16x2048", UNIFORM)] + ([] if quick else [("ragged16", RAGGED)])
    for label, lengths in batches:
        shape = f"{label} T={sum(lengths)}"
        plain = functools.partial(prefill_inputs, lengths, 1)
        add("K3 NVIDIA prefill (out)", f"{_KDA['nvidia']}.chunk", "chunk_kda_with_fused_gate", _KDA["nvidia"], shape,
            plain, functools.partial(call_chunk_gate, out=True, lower_bound=LOWER_BOUND), _final)
        add("Kimi-Linear prefill, NVIDIA copy", f"{_KDA['nvidia']}.chunk", "chunk_kda_with_fused_gate", _KDA["nvidia"],
            shape, plain, functools.partial(call_chunk_gate, out=False, lower_bound=None), _final)
        add("Kimi-Linear prefill, ROCm copy", f"{_KDA['amd']}.chunk", "chunk_kda_with_fused_gate", _KDA["amd"],
            shape, plain, functools.partial(call_chunk_gate, out=False, lower_bound=None), _final)
        # backend="triton": vLLM's call never asks is_fused_kda_chunk_supported (which the
        # plugin answers True) and runs its Triton chunk path.
        add("K3 ROCm prefill (pool, triton)", _PREFILL, "chunk_kda_prefill", None, shape,
            functools.partial(prefill_inputs, lengths, 2, pool=True), call_rocm_prefill, _written,
            unread=("is_fused_kda_chunk_supported",))
    decode = f"B={DECODE_B} pool={2 * DECODE_B + 1}"
    add("K3 NVIDIA packed decode", f"{_KDA['nvidia']}.fused_recurrent", "fused_recurrent_kda_packed_decode",
        _KDA["nvidia"], decode, functools.partial(decode_inputs, 3), functools.partial(call_packed, out=True),
        _written, graph=True)
    add("K3 ROCm packed decode", f"{_KDA['amd']}.fused_recurrent", "fused_recurrent_kda_packed_decode",
        _KDA["amd"], decode, functools.partial(decode_inputs, 3), functools.partial(call_packed, out=False),
        _written, graph=True)
    add("K3 ROCm decode peel", f"{_KDA['amd']}.fused_recurrent", "fused_recurrent_kda", _KDA["amd"], decode,
        functools.partial(decode_inputs, 4), call_recurrent, _written, graph=True)
    spec = f"N={SPEC_N}x{SPEC_W} pool={SPEC_N * (SPEC_W + 1) + 1}"
    spec_inputs = functools.partial(decode_inputs, 5, tokens=SPEC_W, sequences=SPEC_N)
    add("K3 NVIDIA spec verify", f"{_KDA['nvidia']}.fused_recurrent", "fused_recurrent_kda", _KDA["nvidia"], spec,
        spec_inputs, call_recurrent, _written, graph=True)
    add("K3 ROCm spec verify", f"{_KDA['amd']}.fused_recurrent", "fused_recurrent_kda", _KDA["amd"], spec,
        spec_inputs, functools.partial(call_recurrent, uniform=SPEC_W), _written, graph=True)
    gate = f"T={ENGRAM_T} hc={ENGRAM_HC} dim={ENGRAM_DIM}"
    for masked in (False, True):
        add("Engram gate" + (" (mask)" if masked else ""), _ENGRAM, "_fused_engram_post_wkv_kernel", None, gate,
            functools.partial(gate_inputs, 6, mask=masked), launch_gate, lambda x, r: {"out": r}, graph=True)
    for v1 in (False, True):
        add(f"Engram hash {'V1 (slot cache)' if v1 else 'V2'}", _ENGRAM, "_hash_ids_kernel", None, f"T={ENGRAM_T}",
            functools.partial(hash_inputs, 7, slot_cache=v1), launch_hash, lambda x, r: {"out": r}, graph=True)
    return rows


# ------------------------------------------------------------------ measuring


def errors(ref, got) -> tuple[float, float]:
    """``(max |got - ref|, RMS(got - ref) / RMS(ref))`` in float64 (nan where either
    holds a non-finite value; the ratio nan where ``ref`` is all zeros)."""
    import torch

    if ref.shape != got.shape:
        raise ValueError(f"shapes differ: vLLM's {list(ref.shape)}, ours {list(got.shape)}")
    a, b = ref.double(), got.double()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return math.nan, math.nan
    d = b - a
    rms = a.pow(2).mean().sqrt().item()
    # An all-zero reference says nothing: not ok (nan).
    return d.abs().max().item(), (d.pow(2).mean().sqrt().item() / rms) if rms else math.nan


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(case, quick: bool, graph: bool, tolerance: float) -> dict:
    """One row: the comparison on fresh inputs, then the timings."""
    from ...validation.entry import raise_pending_errors

    theirs, ours = case.fns()
    row = {"call": case.call, "target": case.target, "layer_module": case.layer_module, "shape": case.shape}
    warm = case.make()  # compilation and vLLM's autotuning, on inputs that are then dropped
    case.run(theirs, warm)
    case.run(ours, warm)
    _sync()
    del warm
    x_theirs, x_ours = case.make(), case.make()
    seen_theirs = {k: t.clone() for k, t in case.observe(x_theirs, case.run(theirs, x_theirs)).items()}
    seen_ours = {k: t.clone() for k, t in case.observe(x_ours, case.run(ours, x_ours)).items()}
    _sync()
    raise_pending_errors()
    ok = True
    for key, ref in seen_theirs.items():
        max_abs, rel = errors(ref, seen_ours[key])
        row[f"max_abs_{key}"], row[f"rel_rms_{key}"] = max_abs, rel
        exact = not ref.is_floating_point()
        ok = ok and not math.isnan(rel) and (max_abs == 0 if exact else rel <= tolerance)
    row["ok"] = bool(ok)
    del seen_theirs, seen_ours
    row["vllm_ms"] = bench_ms(lambda: case.run(theirs, x_theirs), quick)
    row["ours_ms"] = bench_ms(lambda: case.run(ours, x_ours), quick)
    raise_pending_errors()
    row["ratio"] = row["vllm_ms"] / row["ours_ms"] if row["ours_ms"] else None
    if graph and case.graph:
        for side, fn, x in (("vllm", theirs, x_theirs), ("ours", ours, x_ours)):
            try:
                row[f"{side}_graph_ms"] = cuda_graph_ms(lambda fn=fn, x=x: case.run(fn, x))
            except Exception as e:  # a call that cannot be captured: said in the row, the others go on
                row[f"{side}_graph_ms"] = None
                row[f"{side}_graph_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if row.get("vllm_graph_ms") and row.get("ours_graph_ms"):
            row["graph_ratio"] = row["vllm_graph_ms"] / row["ours_graph_ms"]
    return row


def _fmt(value, spec) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


HEADER = (f"{'call':<34} {'shape':<22} {'vLLM ms':>8} {'ours ms':>8} {'ratio':>6} {'graph':>6} "
          f"{'max|d| out':>10} {'rRMS out':>9} {'max|d| st':>10} {'rRMS st':>9}  ok")


def format_row(row: dict) -> str:
    if "error" in row:
        return f"{row['call']:<34} {row['shape']:<22} ERROR {row['error']}"
    return (f"{row['call']:<34} {row['shape']:<22} {_fmt(row['vllm_ms'], '.4f'):>8} {_fmt(row['ours_ms'], '.4f'):>8} "
            f"{_fmt(row['ratio'], '.2f'):>6} {_fmt(row.get('graph_ratio'), '.2f'):>6} "
            f"{_fmt(row.get('max_abs_out'), '.2e'):>10} {_fmt(row.get('rel_rms_out'), '.2e'):>9} "
            f"{_fmt(row.get('max_abs_state'), '.2e'):>10} {_fmt(row.get('rel_rms_state'), '.2e'):>9}  "
            f"{'yes' if row['ok'] else 'NO'}")


def _set_triton_scratch_allocator() -> None:
    """Device scratch for Triton kernels that build tensor descriptors on the device
    (vLLM's ROCm KDA copy calls ``make_tensor_descriptor`` in its kernels; on an
    NVIDIA GPU those need a runtime allocation, which Triton refuses without an
    allocator: "Kernel requires a runtime memory allocation, but no allocator was
    set"). The caching allocator's memory, as vLLM's own runners give it. Our
    kernels allocate nothing at run time."""
    import torch
    import triton

    def scratch(size: int, alignment: int, stream):
        return torch.empty(size, dtype=torch.int8, device="cuda")

    triton.set_allocator(scratch)


def run(folder: str, *, quick: bool = False, only=None, graph: bool = True, tolerance: float = DEFAULT_TOLERANCE,
        json_path: str | None = None) -> list[dict]:
    """Every row (those whose call contains one of ``only``), printed and saved to
    ``json_path`` as each finishes."""
    import torch

    plugin = load_vllm(folder)
    device = torch.cuda.get_device_name()
    _set_triton_scratch_allocator()
    pdl = sys.modules["vllm.platforms"].current_platform.is_arch_support_pdl()
    print(f"vLLM {sys.modules['vllm'].__version__} from {folder}; {device}; torch {torch.__version__}; "
          f"PDL {'on' if pdl else 'off'}; ratio = vLLM ms / ours ms (> 1: ours faster), graph = the same from "
          f"CUDA-graph replays")
    print(HEADER)
    print("-" * len(HEADER))
    rows = []
    for case in cases(plugin, quick):
        if only and not any(o.lower() in case.call.lower() for o in only):
            continue
        try:
            row = measure(case, quick, graph, tolerance)
        except Exception as e:  # one row's failure is reported in its row; the others still run
            row = {"call": case.call, "target": case.target, "shape": case.shape, "ok": False,
                   "error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"}
        row.update(device=device, pdl=pdl)
        rows.append(row)
        print(format_row(row), flush=True)
        if json_path:
            with open(json_path, "w") as f:
                json.dump(rows, f, indent=2, default=str)
        torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------ the command line


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-files", metavar="DIR", help="the folder --prepare wrote (carried to the GPU machine)")
    p.add_argument("--prepare", metavar="DIR", help="extract vLLM's files for a GPU run into DIR (no GPU needed)")
    p.add_argument("--wheel", metavar="PATH", help=f"the vllm {VERSION} wheel, or a folder holding it (--prepare; "
                   "default $KDA_ENGRAM_VLLM_WHEEL, else pip download)")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON (rewritten after each row)")
    p.add_argument("--quick", action="store_true", help="shorter timing; the 16 x 2048 prefill batch only")
    p.add_argument("--only", metavar="TEXT", help="comma-separated: only the calls whose name contains one")
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph timings")
    p.add_argument("--no-pdl", action="store_true", help="vLLM's kernels without programmatic dependent launch")
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                   help=f"largest relative RMS difference of a row that is ok (default {DEFAULT_TOLERANCE})")
    args = p.parse_args(argv)
    if args.prepare:
        return _prepare(args.prepare, args.wheel)
    if (code := no_gpu_exit("bench_vllm_plugin")) is not None:
        return code
    if not args.vllm_files:
        print("bench_vllm_plugin: --vllm-files DIR is needed (prepare DIR with --prepare DIR where the wheel is)",
              file=sys.stderr)
        return 2
    marker = read_marker(args.vllm_files)
    if marker is None or marker.get("platform") != "cuda" or marker.get("vllm") != VERSION:
        print(f"bench_vllm_plugin: {args.vllm_files} is not a folder --prepare wrote for vLLM {VERSION} on CUDA "
              f"(found {marker})", file=sys.stderr)
        return 2
    if args.no_pdl:
        os.environ["KDA_ENGRAM_VLLM_PDL"] = "0"
    only = [o.strip() for o in args.only.split(",") if o.strip()] if args.only else None
    rows = run(args.vllm_files, quick=args.quick, only=only, graph=not args.no_graph, tolerance=args.tolerance,
               json_path=args.json)
    if args.json:
        print(f"wrote {args.json}")
    failed = [r["call"] + (f" ({r['shape']})" if r.get("shape") else "") for r in rows if not r.get("ok")]
    if failed:
        print(f"not ok: {'; '.join(failed)}")
    return 1 if failed or not rows else 0


def _prepare(folder: str, wheel: str | None) -> int:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="vllm-wheel-") as download:
        try:
            record = prepare(folder, find_wheel(wheel, download_to=download))
        except (WheelNotFound, FileExistsError) as e:
            print(f"bench_vllm_plugin --prepare: {e}", file=sys.stderr)
            return 2
    print(f"prepared {folder}: {record['files']} files, {record['bytes'] / 1e6:.1f} MB of vLLM {record['vllm']} "
          f"from {record['wheel']}, with the {record['platform']} platform stub")
    return 0


if __name__ == "__main__":
    sys.exit(main())

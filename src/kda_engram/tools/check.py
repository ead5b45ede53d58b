"""``kda-engram check``: a correctness sweep of every kernel against its reference.

Each case draws a random shape (ragged lengths, head counts, dims, gate form,
masks) from a seeded generator, runs the kernel and the plain-PyTorch
reference, and prints the max error against the bound it must meet. Any case out
of bounds fails the run. On the CPU the kernels run under the Triton interpreter
in fp32 (the interpreter's bf16 ``tl.dot`` is wrong); on a GPU in bf16.
"""

from __future__ import annotations

import random

import torch

from .benchmarks.common import random_kda_inputs
from .reporting import Checks, Stage, check_seed, pick_device


def _kda_inputs(rng: random.Random, lengths, H, dtype, device, gen):
    T = sum(lengths)
    K = 128
    rnd = lambda *s: torch.randn(*s, generator=gen, device=device, dtype=torch.float32)  # noqa: E731
    x = random_kda_inputs(rnd, (1, T), H, K, K, dtype, dt_bias_scale=0.5)
    cu = torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)
    return x, cu


def _case_prefill(rng, device, dtype, gen, checks):
    from ..kda.prefill import chunk_kda_prefill
    from ..kda.reference import naive_recurrent_kda

    small = device.type == "cpu"
    n = rng.randint(1, 3 if small else 6)
    lengths = [rng.choice([0, 1, 15, 63, 64, 65, rng.randint(1, 150 if small else 1500)]) for _ in range(n)]
    if sum(lengths) == 0:
        lengths[0] = 17
    H = rng.randint(1, 2 if small else 8)
    lower_bound = rng.choice([None, -5.0])
    x, cu = _kda_inputs(rng, lengths, H, dtype, device, gen)
    h0 = torch.randn(n, H, 128, 128, generator=gen, device=device) * 0.1
    o, final = chunk_kda_prefill(**x, lower_bound=lower_bound, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    o_ref, f_ref, _ = naive_recurrent_kda(**x, lower_bound=lower_bound, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    bound = 2e-3 if dtype == torch.float32 else 5e-2
    name = f"prefill lengths={lengths} H={H} lower_bound={lower_bound}"
    checks.error(name + " out", o.float(), o_ref, bound)
    checks.error(name + " state", final, f_ref, bound)


def _case_decode(rng, device, dtype, gen, checks):
    from ..kda.decode import kda_decode
    from ..kda.reference import naive_recurrent_kda

    B = rng.randint(1, 8 if device.type == "cpu" else 256)
    H = rng.randint(1, 4 if device.type == "cpu" else 32)
    lower_bound = rng.choice([None, -5.0])
    x, _ = _kda_inputs(rng, [1] * B, H, dtype, device, gen)
    step = {k: (v[0] if v.dim() >= 3 else v) for k, v in x.items()}  # [B, H, *]
    slots = 2 * B + 1
    cache = torch.randn(slots, H, 128, 128, generator=gen, device=device) * 0.1
    idx = torch.tensor(rng.sample(range(slots), B), device=device)
    h0 = cache[idx].clone()
    out = kda_decode(**step, state_cache=cache, state_indices=idx, lower_bound=lower_bound)
    cu = torch.arange(B + 1, device=device, dtype=torch.int32)
    o_ref, f_ref, _ = naive_recurrent_kda(**x, lower_bound=lower_bound, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    bound = 1e-4 if dtype == torch.float32 else 2e-2
    name = f"decode B={B} H={H} lower_bound={lower_bound}"
    checks.error(name + " out", out.float(), o_ref[0], bound)
    checks.error(name + " state", cache[idx], f_ref, bound)


def _case_engram(rng, device, dtype, gen, checks):
    from ..engram.gate import engram_post_wkv
    from ..engram.reference import naive_engram_gate_sharded, naive_engram_post_wkv, shard_kv_by_dim
    from ..engram.sharded_gate import engram_gate_finish, engram_gate_partials

    T = rng.randint(0, 24 if device.type == "cpu" else 4096)
    hc = rng.choice([1, 2, 4])
    P = rng.choice([1, 2, 4])
    dim = P * 2 * rng.randint(4, 48 if device.type == "cpu" else 1280)
    rnd = lambda *s: torch.randn(*s, generator=gen, device=device).to(dtype)  # noqa: E731
    hidden, kv = rnd(T, hc, dim), rnd(T, (hc + 1) * dim)
    qw, kw = rnd(hc, dim), rnd(hc, dim)
    mask = torch.rand(T, generator=gen, device=device) > 0.2
    bound = 1e-4 if dtype == torch.float32 else 3e-2
    want = naive_engram_post_wkv(hidden, kv, qw, kw, eps=1e-6, token_mask=mask).float()
    got = engram_post_wkv(hidden, kv, qw, kw, eps=1e-6, token_mask=mask)
    checks.error(f"engram gate T={T} hc={hc} dim={dim}", got.float(), want, bound)
    sends = [
        engram_gate_partials(hidden, local, qw, kw, rank=r, tp_size=P) for r, local in enumerate(shard_kv_by_dim(kv, hc, P))
    ]
    gathered = torch.cat(sends, dim=0)
    sharded = engram_gate_finish(hidden, gathered, tp_size=P, eps=1e-6, token_mask=mask)
    want_sharded = naive_engram_gate_sharded(hidden, kv, qw, kw, tp_size=P, eps=1e-6, token_mask=mask).float()
    checks.error(f"engram sharded gate T={T} hc={hc} dim={dim} P={P}", sharded.float(), want_sharded, bound)


CASES = {"kda-prefill": _case_prefill, "kda-decode": _case_decode, "engram": _case_engram}


def run_check(device: str | None = None, examples: int = 20, seed: int = 0) -> int:
    if examples < 1:
        raise ValueError(f"examples: expected a positive number of cases per kernel, got {examples}")
    check_seed(seed)
    dev = pick_device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    checks = Checks()
    rng = random.Random(seed)
    gen = torch.Generator(device=dev).manual_seed(seed)
    print(f"kda-engram check on {dev} ({str(dtype).replace('torch.', '')}), {examples} random cases per kernel")
    for name, case in CASES.items():
        with Stage(name):
            for _ in range(examples):
                case(rng, dev, dtype, gen, checks)
    if checks.failed:
        print(f"check FAILED: {len(checks.failed)} case(s) out of bounds")
        return 1
    print("check passed: every case within its bound")
    return 0

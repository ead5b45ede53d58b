"""The Engram gate module (layers/engram_gate.py): the shard policy, checkpoint loading, and the two TP paths.

The multi-process tests run P = 2 and 4 gloo ranks on the CPU (kernels under the
interpreter) and check that the sharded layer equals the unsharded one within fp32
tolerance and gives bit-identical outputs on every rank.
"""

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kda_engram.layers.engram_gate import SHARD_GATE_ENV, Engram, shards_engram_gate
from kda_engram.engram.reference import naive_engram_post_wkv
from kda_engram.parallel import TensorParallelGroup

from ..helpers import free_port

EPS = 1e-6


def fake_group(rank: int, world_size: int) -> TensorParallelGroup:
    group = TensorParallelGroup.single()
    group.rank, group.world_size = rank, world_size
    return group


def checkpoint(dim, hc, in_dim, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    wkv = torch.randn((hc + 1) * dim, in_dim, generator=gen) * in_dim**-0.5
    q = 1 + 0.5 * torch.randn(hc, dim, generator=gen)
    k = 1 + 0.5 * torch.randn(hc, dim, generator=gen)
    return wkv.to(dtype), q.to(dtype), k.to(dtype)


def batch(T, hc, dim, in_dim, seed=1, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, hc, dim, generator=gen).to(dtype)
    embeddings = torch.randn(T, in_dim, generator=gen).to(dtype)
    mask = torch.rand(T, generator=gen) > 0.25
    return hidden, embeddings, mask


def reference(hidden, embeddings, mask, wkv, q, k):
    kv = embeddings.double() @ wkv.double().t()
    return naive_engram_post_wkv(hidden.double(), kv, q.double(), k.double(), eps=EPS, token_mask=mask)


# --------------------------------------------------------------------------------------
# Policy
# --------------------------------------------------------------------------------------


def test_policy_defaults(monkeypatch):
    monkeypatch.delenv(SHARD_GATE_ENV, raising=False)
    assert not shards_engram_gate(1, False, torch.device("cpu"))
    assert not shards_engram_gate(4, True, torch.device("cpu"))  # sequence parallel
    assert shards_engram_gate(2, False, torch.device("cpu"))
    assert shards_engram_gate(8, False, None)


def test_policy_environment_override(monkeypatch):
    monkeypatch.setenv(SHARD_GATE_ENV, "0")
    assert not shards_engram_gate(4, False, None)
    assert not Engram(64, 2, 16, eps=EPS, tp=fake_group(0, 4)).shard_gate
    assert Engram(64, 2, 16, eps=EPS, tp=fake_group(0, 4), shard_gate=True).shard_gate  # the argument wins
    monkeypatch.setenv(SHARD_GATE_ENV, "1")
    assert shards_engram_gate(4, False, None)
    assert not shards_engram_gate(1, False, None) and not shards_engram_gate(4, True, None)
    assert not Engram(64, 2, 16, eps=EPS, tp=fake_group(0, 4), shard_gate=False).shard_gate
    monkeypatch.setenv(SHARD_GATE_ENV, "maybe")
    with pytest.raises(ValueError, match=SHARD_GATE_ENV):
        shards_engram_gate(4, False, None)


# --------------------------------------------------------------------------------------
# One process
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("shard_gate", [None, False, True])
def test_single_process_layer_matches_reference(shard_gate):
    dim, hc, in_dim, T = 96, 4, 24, 5
    layer = Engram(dim, hc, in_dim, eps=EPS, shard_gate=shard_gate)
    assert layer.shard_gate is bool(shard_gate)
    wkv, q, k = checkpoint(dim, hc, in_dim)
    layer.load_checkpoint(wkv, q, k)
    hidden, embeddings, mask = batch(T, hc, dim, in_dim)
    out = layer(hidden, embeddings, mask)
    torch.testing.assert_close(out.double(), reference(hidden, embeddings, mask, wkv, q, k), rtol=2e-5, atol=2e-5)
    assert torch.equal(out[~mask], hidden[~mask])


def test_layouts_load_the_same_checkpoint_into_their_shards():
    dim, hc, in_dim = 8, 2, 3
    wkv, q, k = checkpoint(dim, hc, in_dim)
    blocks = wkv.reshape(hc + 1, dim, in_dim)
    for rank in range(2):
        sharded = Engram(dim, hc, in_dim, eps=EPS, tp=fake_group(rank, 2), shard_gate=True)
        gather = Engram(dim, hc, in_dim, eps=EPS, tp=fake_group(rank, 2), shard_gate=False)
        sharded.load_checkpoint(wkv, q, k)
        gather.load_checkpoint(wkv, q, k)
        want = blocks[:, rank * 4 : rank * 4 + 4].reshape(-1, in_dim)
        assert torch.equal(sharded.wkv.weight, want)
        assert torch.equal(gather.wkv.weight, wkv[rank * 12 : rank * 12 + 12])
        assert torch.equal(sharded.q_weight, q) and torch.equal(gather.k_weight, k)


def test_reset_parameters_gives_a_finite_layer():
    layer = Engram(32, 2, 8, eps=EPS)
    layer.reset_parameters(torch.Generator().manual_seed(0))
    hidden, embeddings, _ = batch(3, 2, 32, 8)
    assert torch.isfinite(layer(hidden, embeddings)).all()


def test_bad_input_raises_clear_errors():
    with pytest.raises(ValueError, match="dim 96 is not divisible by tp_size 5"):
        Engram(96, 2, 8, eps=EPS, tp=fake_group(0, 5), shard_gate=True)
    layer = Engram(96, 2, 8, eps=EPS)
    layer.load_checkpoint(*checkpoint(96, 2, 8))
    hidden, embeddings, mask = batch(4, 2, 96, 8)
    with pytest.raises(ValueError, match=r"hidden_states: expected shape \[\*, 2, 96\]"):
        layer(hidden[:, :1], embeddings)
    with pytest.raises(ValueError, match=r"embeddings: expected shape \[4, 8\]"):
        layer(hidden, embeddings[:3])
    with pytest.raises(TypeError, match="embeddings: expected dtype float32"):
        layer(hidden, embeddings.half())
    with pytest.raises(ValueError, match=r"token_mask: expected shape \[4\]"):
        layer(hidden, embeddings, mask[:3])
    with pytest.raises(ValueError, match=r"wkv_weight|full_weight: expected shape \[288, 8\]"):
        layer.load_checkpoint(torch.zeros(287, 8), *checkpoint(96, 2, 8)[1:])


# --------------------------------------------------------------------------------------
# gloo ranks
# --------------------------------------------------------------------------------------


def _layer_worker(rank, world_size, port, dim, hc, in_dim, T):
    torch.set_num_threads(1)  # the ranks share the CPU
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        tp = TensorParallelGroup()
        wkv, q, k = checkpoint(dim, hc, in_dim, seed=3)  # the same full checkpoint on every rank
        hidden, embeddings, mask = batch(T, hc, dim, in_dim, seed=4)

        outs = {}
        for name, shard_gate in (("sharded (policy)", None), ("gather", False)):
            layer = Engram(dim, hc, in_dim, eps=EPS, tp=tp, shard_gate=shard_gate)
            assert layer.shard_gate is (shard_gate is None)  # the default policy shards for P > 1
            layer.load_checkpoint(wkv, q, k)
            assert layer.wkv.weight.shape[0] == (hc + 1) * dim // world_size
            outs[name] = layer(hidden, embeddings, mask)
            # every rank holds the same bits
            everyone = tp.all_gather(outs[name][None], dim=0)
            for r in range(world_size):
                assert torch.equal(everyone[r], everyone[0]), f"{name}: rank {r} differs from rank 0"
        if world_size == 2:  # fp16 activations: the pairs are packed as 4 halves
            layer16 = Engram(dim, hc, in_dim, eps=EPS, tp=tp, dtype=torch.float16)
            layer16.load_checkpoint(wkv, q, k)
            out16 = layer16(hidden.half(), embeddings.half(), mask)
            everyone = tp.all_gather(out16[None], dim=0)
            assert all(torch.equal(everyone[r], everyone[0]) for r in range(world_size))
            if rank == 0:
                want16 = reference(hidden.half(), embeddings.half(), mask, wkv.half(), q.half(), k.half())
                torch.testing.assert_close(out16.double(), want16, rtol=4e-3, atol=4e-3)
        if rank == 0:  # the outputs are identical on all ranks: compare once
            unsharded = Engram(dim, hc, in_dim, eps=EPS)  # one process, whole wkv
            unsharded.load_checkpoint(wkv, q, k)
            single = unsharded(hidden, embeddings, mask)
            want = reference(hidden, embeddings, mask, wkv, q, k)
            for name, out in outs.items():
                torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5, msg=lambda m: f"{name}: {m}")
                torch.testing.assert_close(out, single, rtol=2e-5, atol=2e-5, msg=lambda m: f"{name} vs unsharded: {m}")
                assert torch.equal(out[~mask], hidden[~mask])
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 4])
def test_sharded_layer_equals_unsharded_and_ranks_agree(world_size):
    dim, hc, in_dim, T = 64, 2, 16, 4
    mp.spawn(_layer_worker, args=(world_size, free_port(), dim, hc, in_dim, T), nprocs=world_size, join=True)


# --------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_layer_paths_agree(gpu):
    dim, hc, in_dim, T = 5120, 4, 1024, 512
    wkv, q, k = checkpoint(dim, hc, in_dim, dtype=torch.bfloat16)
    hidden, embeddings, mask = batch(T, hc, dim, in_dim, dtype=torch.bfloat16)
    hidden, embeddings, mask = hidden.to(gpu), embeddings.to(gpu), mask.to(gpu)
    outs = []
    for shard_gate in (False, True):
        layer = Engram(dim, hc, in_dim, eps=EPS, shard_gate=shard_gate, dtype=torch.bfloat16, device=gpu)
        layer.load_checkpoint(wkv.to(gpu), q.to(gpu), k.to(gpu))
        outs.append(layer(hidden, embeddings, mask))
    torch.testing.assert_close(outs[0].float(), outs[1].float(), rtol=8e-3, atol=1e-2)
    kv = (embeddings @ wkv.to(gpu).t()).double()  # bf16 matmul, as the layer does it
    want = naive_engram_post_wkv(hidden.double(), kv, q.to(gpu).double(), k.to(gpu).double(), eps=EPS, token_mask=mask)
    torch.testing.assert_close(outs[1].double(), want, rtol=8e-3, atol=1e-2)

"""kda_engram.parallel: the TP group (single process and gloo ranks) and the wkv layouts."""

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kda_engram.engram.reference import shard_kv_by_dim
from kda_engram.parallel import (
    ColumnParallelLinear,
    TensorParallelGroup,
    column_parallel_shard,
    merged_column_parallel_shard,
)

from .helpers import free_port


def init_gloo(rank: int, world_size: int, port: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=120),
    )


def fake_group(rank: int, world_size: int) -> TensorParallelGroup:
    """A group object that only reports a rank and size (for the layouts; no collective)."""
    group = TensorParallelGroup.single()
    group.rank, group.world_size = rank, world_size
    return group


# --------------------------------------------------------------------------------------
# Single process
# --------------------------------------------------------------------------------------


def test_single_group_is_a_no_op():
    group = TensorParallelGroup.single()
    assert (group.rank, group.world_size) == (0, 1)
    x = torch.randn(3, 4)
    assert group.all_gather(x) is x and group.all_gather(x, dim=-1) is x


def test_group_needs_an_initialised_process_group():
    if dist.is_initialized():  # pragma: no cover - pytest never initialises it
        pytest.fail("torch.distributed unexpectedly initialised in the test process")
    with pytest.raises(RuntimeError, match="not initialised"):
        TensorParallelGroup()


def test_column_parallel_shard_takes_contiguous_output_rows():
    w = torch.arange(12 * 2).reshape(12, 2)
    assert column_parallel_shard(w, 1, 3).tolist() == w[4:8].tolist()
    assert column_parallel_shard(w, 0, 1).data_ptr() == w.data_ptr()
    with pytest.raises(ValueError, match="12 output rows are not divisible by tp_size 5"):
        column_parallel_shard(w, 0, 5)
    with pytest.raises(ValueError, match=r"rank: expected an int in \[0, 3\)"):
        column_parallel_shard(w, 3, 3)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_merged_shard_is_the_dim_sharded_kv_layout(tp_size):
    hc, dim, in_dim, T = 2, 8, 5, 3
    gen = torch.Generator().manual_seed(tp_size)
    w = torch.randn((hc + 1) * dim, in_dim, generator=gen, dtype=torch.float64)
    x = torch.randn(T, in_dim, generator=gen, dtype=torch.float64)
    kv = x @ w.t()
    for rank, want in enumerate(shard_kv_by_dim(kv, hc, tp_size)):
        shard = merged_column_parallel_shard(w, [dim] * (hc + 1), rank, tp_size)
        assert shard.shape == ((hc + 1) * dim // tp_size, in_dim)
        torch.testing.assert_close(x @ shard.t(), want, rtol=1e-12, atol=1e-12)


def test_merged_shard_rows_and_errors():
    w = torch.arange(9).reshape(9, 1)  # blocks [4, 2, 3]... not divisible by 2
    with pytest.raises(ValueError, match="weight block 2: 3 output rows are not divisible by tp_size 2"):
        merged_column_parallel_shard(w, [4, 2, 3], 0, 2)
    w = torch.arange(12).reshape(12, 1)
    assert merged_column_parallel_shard(w, [4, 4, 4], 1, 2).flatten().tolist() == [2, 3, 6, 7, 10, 11]
    with pytest.raises(ValueError, match=r"weight: expected shape \[8, \*\]"):
        merged_column_parallel_shard(w, [4, 4], 0, 2)


@pytest.mark.parametrize("merged", [False, True])
def test_column_parallel_linear_loads_a_full_weight_in_one_call(merged):
    sizes, in_dim = [6, 6, 6], 4
    full = torch.randn(18, in_dim, generator=torch.Generator().manual_seed(0))
    x = torch.randn(5, in_dim)
    for rank in range(3):
        layer = ColumnParallelLinear(in_dim, sizes, tp=fake_group(rank, 3), merged=merged)
        layer.load_full_weight(full)
        want = merged_column_parallel_shard(full, sizes, rank, 3) if merged else full[6 * rank : 6 * rank + 6]
        assert torch.equal(layer.weight, want)
        torch.testing.assert_close(layer(x), x @ want.t())
    single = ColumnParallelLinear(in_dim, sizes, dtype=torch.float64)
    single.load_full_weight(full)
    assert single.weight.dtype == torch.float64 and torch.equal(single.weight, full.double())
    with pytest.raises(ValueError, match=r"full_weight: expected shape \[18, 4\]"):
        single.load_full_weight(full[:-1])
    with pytest.raises(ValueError, match="output_sizes\\[0\\]: 6 output rows are not divisible by tp_size 4"):
        ColumnParallelLinear(in_dim, sizes, tp=fake_group(0, 4), merged=True)


# --------------------------------------------------------------------------------------
# gloo ranks
# --------------------------------------------------------------------------------------


def _all_gather_worker(rank, world_size, port):
    torch.set_num_threads(1)  # the ranks share the CPU
    init_gloo(rank, world_size, port)
    try:
        for mode in (None, True, False):
            group = TensorParallelGroup(use_gather_into_tensor=mode)
            assert (group.rank, group.world_size) == (rank, world_size)
            x = torch.full((2, 3, 4), float(rank)) + torch.arange(24.0).reshape(2, 3, 4)
            parts = [torch.full((2, 3, 4), float(r)) + torch.arange(24.0).reshape(2, 3, 4) for r in range(world_size)]
            for dim in (0, 1, -1):
                got = group.all_gather(x, dim=dim)
                assert torch.equal(got, torch.cat(parts, dim=dim)), (mode, dim)
            # non-contiguous input and a low-precision dtype
            got = group.all_gather(x.transpose(0, 2).half(), dim=0)
            assert torch.equal(got, torch.cat([p.transpose(0, 2).half() for p in parts], dim=0))
            if mode is not None:
                assert group.uses_gather_into_tensor is mode
            else:
                assert group.uses_gather_into_tensor in (True, False)
    finally:
        dist.destroy_process_group()


def test_all_gather_is_rank_major_on_gloo():
    world_size = 3
    mp.spawn(_all_gather_worker, args=(world_size, free_port()), nprocs=world_size, join=True)

import random
import re

import pytest
import torch

import kda_engram.kda.metadata as metadata_mod
from kda_engram import raise_pending_errors
from kda_engram.kda.metadata import max_chunks, prepare_chunk_indices, prepare_chunk_metadata, prepare_chunk_offsets

from ..helpers import refused


def host_chunk_indices(lengths, C=64):
    rows = [(n, c) for n, l in enumerate(lengths) for c in range(-(-l // C))]
    bound = sum(lengths) // C + len(lengths)
    return rows + [(-1, -1)] * (bound - len(rows))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(
    "lengths",
    [[], [0], [0, 0], [1], [64], [65], [0, 5, 0, 0, 130, 0], [63, 64, 65, 0, 1, 1000], [128] * 5],
)
def test_indices_and_offsets(lengths, dtype):
    cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(dtype)
    T = int(cu[-1])
    idx = prepare_chunk_indices(cu, total_tokens=T)
    assert idx.dtype == torch.int32 and idx.shape == (max_chunks(T, len(lengths)), 2)
    assert idx.tolist() == [list(r) for r in host_chunk_indices(lengths)]
    assert prepare_chunk_indices(cu).tolist() == idx.tolist()  # T read from cu_seqlens
    off = prepare_chunk_offsets(cu)
    assert off.dtype == torch.int32
    counts = [-(-l // 64) for l in lengths]
    assert off.tolist() == [sum(counts[:i]) for i in range(len(lengths) + 1)]


def ragged_cases():
    rng = random.Random(5)
    many = [rng.choice([0, 0, 1, 63, 64, 65, 200]) for _ in range(150)]  # > one 64-sequence step
    long = [0, 128 * 64 + 5, 0, 3]  # > one 128-row block
    return [[], [0], [0, 0], [1], [64], [65], [0, 5, 0, 0, 130, 0], [63, 64, 65, 0, 1, 1000], many, long,
            [0] * 70]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("chunk_size", [64, 16])
def test_metadata_kernel_matches_torch(dtype, chunk_size):
    # The one-launch kernel (interpreter here, compiled in the GPU test) against
    # the torch constructions, on ragged batches with zero-length runs, more
    # sequences than one step of its running cumsum and more rows than a block.
    for lengths in ragged_cases():
        cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(dtype)
        T = int(cu[-1])
        off, idx = prepare_chunk_metadata(cu, T, chunk_size)
        assert off.dtype == idx.dtype == torch.int32
        assert off.tolist() == prepare_chunk_offsets(cu, chunk_size).tolist(), lengths
        assert idx.tolist() == prepare_chunk_indices(cu, chunk_size, total_tokens=T).tolist(), lengths
    # A static bound larger than the tokens: the extra rows are padding.
    cu = torch.tensor([0, 70, 70], dtype=dtype)
    off, idx = prepare_chunk_metadata(cu, 1000, chunk_size)
    assert idx.tolist() == prepare_chunk_indices(cu, chunk_size, total_tokens=1000).tolist()


def test_metadata_cpu_fallback(monkeypatch):
    # A CPU tensor without the interpreter takes the torch path (no kernel launch).
    monkeypatch.setattr(metadata_mod, "interpreting", lambda: False)

    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("kernel launched for a CPU tensor")

    monkeypatch.setattr(metadata_mod, "_chunk_metadata_kernel", NoLaunch())
    cu = torch.tensor([0, 0, 65, 66])
    off, idx = prepare_chunk_metadata(cu, 66)
    assert off.tolist() == [0, 0, 2, 3]
    assert idx.tolist() == [[1, 0], [1, 1], [2, 0], [-1, -1]]
    with pytest.raises(TypeError, match="cu_seqlens"):
        prepare_chunk_metadata(torch.tensor([0.0, 1.0]), 1)
    with pytest.raises(ValueError, match="total_tokens"):
        prepare_chunk_metadata(cu, -1)
    with pytest.raises(TypeError, match="total_tokens"):
        prepare_chunk_metadata(cu, 66.0)
    with pytest.raises(ValueError, match="chunk_size"):
        prepare_chunk_metadata(cu, 66, 0)


def test_zero_length_sequences_keep_later_ids():
    cu = torch.tensor([0, 0, 0, 70])
    idx = prepare_chunk_indices(cu, total_tokens=70)
    assert idx[:2].tolist() == [[2, 0], [2, 1]]


def test_other_chunk_size():
    cu = torch.tensor([0, 17, 17, 50])
    assert prepare_chunk_indices(cu, 16)[:5].tolist() == [[0, 0], [0, 1], [2, 0], [2, 1], [2, 2]]


@pytest.mark.parametrize("bad", [torch.tensor([[0, 1]]), torch.tensor([0.0, 1.0]), [0, 1], torch.zeros(0, dtype=torch.int32)])
def test_bad_cu_seqlens(bad):
    with pytest.raises((TypeError, ValueError), match="cu_seqlens"):
        prepare_chunk_offsets(bad)


@pytest.mark.gpu
def test_no_host_sync_and_graph_capture(gpu):
    lengths, new_lengths = [0, 100, 1, 155], [64, 0, 127, 65]
    cu = torch.tensor([0] + lengths, device=gpu).cumsum(0).to(torch.int32)
    T = sum(lengths)
    torch.cuda.set_sync_debug_mode("error")  # any device->host sync raises
    try:
        prepare_chunk_indices(cu, total_tokens=T)
        prepare_chunk_metadata(cu, T)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        prepare_chunk_indices(cu, total_tokens=T)  # warm-up outside capture
        prepare_chunk_metadata(cu, T)  # (compiles the kernel)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        idx = prepare_chunk_indices(cu, total_tokens=T)
        off = prepare_chunk_offsets(cu)
        off_k, idx_k = prepare_chunk_metadata(cu, T)
    cu.copy_(torch.tensor([0] + new_lengths, device=gpu).cumsum(0).to(torch.int32))
    graph.replay()
    assert idx.cpu().tolist() == [list(r) for r in host_chunk_indices(new_lengths)]
    counts = [-(-l // 64) for l in new_lengths]
    assert off.cpu().tolist() == [sum(counts[:i]) for i in range(len(new_lengths) + 1)]
    assert torch.equal(idx_k, idx) and torch.equal(off_k, off)


@pytest.mark.gpu
def test_gpu_metadata_kernel_matches_torch(gpu):
    for lengths in ragged_cases() + [[131072], [2048] * 16, [512] * 64, [1] * 3000]:
        cu = torch.tensor([0] + lengths, device=gpu).cumsum(0).to(torch.int32)
        T = sum(lengths)
        off, idx = prepare_chunk_metadata(cu, T)
        assert torch.equal(off, prepare_chunk_offsets(cu)), lengths[:8]
        assert torch.equal(idx, prepare_chunk_indices(cu, total_tokens=T)), lengths[:8]


HELPERS = {
    "offsets": lambda cu, T=None, C=64: prepare_chunk_offsets(cu, C),
    "indices": lambda cu, T=None, C=64: prepare_chunk_indices(cu, C, total_tokens=T),
    "metadata": lambda cu, T=None, C=64: prepare_chunk_metadata(cu, 200 if T is None else T, C),
}


@pytest.mark.parametrize("helper", HELPERS)
@pytest.mark.parametrize("bad, message", [
    (torch.tensor([0, 100, 70, 130]), "cu_seqlens: must be non-decreasing, got a sequence of length -30"),
    (torch.tensor([0, -64, 70]), "cu_seqlens: must be non-decreasing, got a sequence of length -64"),
    (torch.tensor([5, 70, 130]), "cu_seqlens: must start at 0, got 5"),
])
def test_the_helpers_check_cu_seqlens_values_as_the_kernels_do(helper, bad, message):
    # Issue 54: a decreasing cu_seqlens gave negative offsets, e.g. [0, -1, 2].
    with refused(ValueError, match=f"^{re.escape(message)} \\(from an earlier prepare_chunk_"):
        HELPERS[helper](bad)


@pytest.mark.parametrize("helper", HELPERS)
def test_cpu_metadata_without_the_interpreter_is_checked_on_the_host(helper, monkeypatch):
    """A CPU ``cu_seqlens`` where kernels do not run on the CPU (a GPU machine; seen on an
    H100: the rules' launch failed with "cannot be accessed from Triton (cpu tensor?)"):
    the values are read in place, no rule kernel is launched, a broken rule raises in
    the call, in the same words."""
    import kda_engram.validation.index_rules as index_rules_mod

    monkeypatch.setattr(metadata_mod, "interpreting", lambda: False)

    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("a rule kernel was launched for a CPU cu_seqlens")

    monkeypatch.setattr(index_rules_mod, "_cu_seqlens_rules_kernel", NoLaunch())
    monkeypatch.setattr(metadata_mod, "_chunk_metadata_kernel", NoLaunch())
    good = torch.tensor([0, 0, 65, 66])
    assert prepare_chunk_offsets(good).tolist() == [0, 0, 2, 3]
    HELPERS[helper](good, 66)
    for bad, message in ((torch.tensor([0, 100, 70, 130]), "must be non-decreasing, got a sequence of length -30"),
                         (torch.tensor([5, 70, 130]), "must start at 0, got 5")):
        with pytest.raises(ValueError, match=f"^cu_seqlens: {re.escape(message)}$"):
            HELPERS[helper](bad)
    if helper != "offsets":
        with pytest.raises(ValueError, match=r"^cu_seqlens: last entry 130 exceeds the 100 tokens of the inputs$"):
            HELPERS[helper](torch.tensor([0, 70, 130]), 100)


@pytest.mark.parametrize("helper", ["indices", "metadata"])
def test_a_token_count_below_the_last_offset_is_refused(helper):
    # Issue 54: total_tokens=100 with cu_seqlens ending at 130 left chunks without a row.
    with refused(ValueError, match=r"^cu_seqlens: last entry 130 exceeds the 100 tokens of the inputs \(from an earlier prepare_chunk_"):
        HELPERS[helper](torch.tensor([0, 70, 130]), 100)


@pytest.mark.parametrize("helper", HELPERS)
@pytest.mark.parametrize("chunk_size", [0, -64, 2.0, True])
def test_a_chunk_size_below_one_is_refused_in_one_line(helper, chunk_size):
    # Issue 54: chunk_size=0 raised ZeroDivisionError from torch.div.
    with pytest.raises((ValueError, TypeError), match=r"^chunk_size: "):
        HELPERS[helper](torch.tensor([0, 70, 130]), 130, chunk_size)
    with pytest.raises((ValueError, TypeError), match=r"^chunk_size: "):
        max_chunks(130, 2, chunk_size)


def test_max_chunks_refuses_negative_counts():
    with pytest.raises(ValueError, match=r"^total_tokens: "):
        max_chunks(-1, 2)
    with pytest.raises(ValueError, match=r"^num_seqs: "):
        max_chunks(10, -2)


def test_unchecked_helpers_run_no_rule_and_checked_ones_no_sync_on_the_host_path():
    cu = torch.tensor([0, 100, 70])
    prepare_chunk_offsets(cu, check_inputs=False)  # the caller's word: no verdict pending
    prepare_chunk_indices(cu, total_tokens=100, check_inputs=False)
    prepare_chunk_metadata(cu, 100, check_inputs=False)
    raise_pending_errors()
    with pytest.raises(ValueError, match="non-decreasing"):
        prepare_chunk_offsets(cu, check_inputs="sync")


def test_where_no_verdict_can_be_read_the_helpers_run_host_rules_only(monkeypatch):
    # While a CUDA graph is captured (stood in for here), a queued verdict could not
    # be read: the helpers stay capturable, their values the caller's contract.
    monkeypatch.setattr(metadata_mod, "can_read_back", lambda: False)
    cu = torch.tensor([0, 100, 70])
    prepare_chunk_offsets(cu)
    prepare_chunk_metadata(cu, 100)
    raise_pending_errors()
    with pytest.raises(ValueError, match="^chunk_size: "):
        prepare_chunk_offsets(cu, 0)
    with pytest.raises(TypeError, match="^check_inputs: "):
        prepare_chunk_offsets(cu, check_inputs="yes")

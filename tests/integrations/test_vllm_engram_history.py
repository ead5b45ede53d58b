"""The one launch that serves vLLM's n-gram hash ids
(integrations/vllm_engram_history.py) against the torch ops ``hash_ids`` ran before
(kept below as the reference rows: ``own`` and ``history``, each lag's id as vLLM's
kernel selects it) hashed by kda-engram's n-gram hash kernel, bit for bit, on random
batches with every convention of vLLM 0.33's ``_hash_ids_kernel`` (zero-length
padding requests, tokens past the last end, negative positions, dead tokens,
lookback windows with unknown and dead ids, the V1 slot cache and V2)."""

import pytest
import torch

from kda_engram.engram.hashing import launch_ngram_hash
from kda_engram.integrations.vllm_deepseek_v41 import hash_ids_kernel
from kda_engram.integrations.vllm_engram_history import vllm_engram_hash

VOCAB, COMPRESSED, DEAD_ID = 97, 40, -1


def _torch_rows(input_ids, token_map, dead_mask, positions, block_table, query_start_loc, cache, lookback_token_ids,
                lookback_dead_mask, *, pad_id, cache_block_size, dead_id, MAX_NGRAM):
    """``hash_ids``' former torch ops (about 15 per lag): ``(own, history)``."""
    T = input_ids.shape[0]
    num_query_rows = query_start_loc.numel() - 1
    device = input_ids.device
    t = torch.arange(T, device=device)
    ends = query_start_loc[1:].to(torch.int64).contiguous()  # (contiguous: no searchsorted warning)
    req = torch.searchsorted(ends, t, right=True).clamp_(max=num_query_rows - 1)
    first = query_start_loc.to(torch.int64)[req].clamp_(max=T - 1)
    chunk_start = positions.to(torch.int64)[first]
    position = positions.to(torch.int64)
    compressed = token_map[input_ids.long()].to(torch.int64)
    depth = lookback_token_ids.shape[1]
    shifts = []
    for s in range(MAX_NGRAM):
        lookback = position - s
        batch = (t - s).clamp_(min=0)
        value = torch.where(dead_mask[batch].bool(), -1, compressed[batch])
        in_batch = lookback >= chunk_start
        col = chunk_start - 1 - lookback
        fallback = torch.full_like(value, int(pad_id))
        if cache is not None:
            num_table_rows, max_blocks = block_table.shape
            num_slots = cache.shape[0]
            clamped = lookback.clamp(0, max_blocks * cache_block_size - 1)
            block = block_table[req.clamp(max=num_table_rows - 1), clamped // cache_block_size].to(torch.int64)
            slot = (block * cache_block_size + clamped % cache_block_size).clamp_(0, num_slots - 1)
            fallback = cache[slot].to(torch.int64)
            fallback = torch.where(fallback == dead_id, -1, fallback)
        if depth > 0:
            in_window = (col >= 0) & (col < depth)
            col = col.clamp(0, depth - 1)
            window = lookback_token_ids[req, col].to(torch.int64)
            known = in_window & (window >= 0)
            window_value = torch.where(lookback_dead_mask[req, col].bool(), -1,
                                       token_map[torch.where(known, window, 0)].to(torch.int64))
            fallback = torch.where(known, window_value, fallback)
        value = torch.where(in_batch, value, fallback)
        shifts.append(torch.where(lookback < 0, -1, value))
    own = shifts[0]
    history = torch.stack(shifts[:0:-1], dim=1) if MAX_NGRAM > 1 else own.new_empty(T, 0)
    return own, history


def _strided(x, g):
    """``x``, or the same values in a strided view (every other element of a larger buffer)."""
    if torch.rand((), generator=g) < 0.5:
        return x
    big = torch.empty((x.shape[0] * 2, *x.shape[1:]), dtype=x.dtype, device=x.device)
    big[::2] = x
    return big[::2]


def random_batch(seed, *, max_ngram, slot_cache, depth, pos_dtype, device="cpu", requests=None, max_len=9):
    """A vLLM batch: ``(inputs dict for hash_ids' tensors, scalars)``."""
    g = torch.Generator().manual_seed(seed)
    R = requests or int(torch.randint(1, 6, (), generator=g))
    lengths = torch.randint(0, max_len, (R,), generator=g)
    lengths[torch.rand(R, generator=g) < 0.25] = 0  # zero-length padding requests
    extra = int(torch.randint(0, 4, (), generator=g))  # tokens past the last end (CUDA-graph padding)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    starts = torch.randint(0, 12, (R,), generator=g)
    positions = [torch.arange(int(s), int(s) + int(n)) for s, n in zip(starts, lengths)]
    positions.append(torch.randint(-3, 20, (extra,), generator=g))
    positions = torch.cat(positions)
    T = positions.numel()
    odd = torch.rand(T, generator=g) < 0.1
    positions[odd] = torch.randint(-4, 16, (int(odd.sum()),), generator=g)  # negative and off-sequence positions
    id_dtype = (torch.int32, torch.int64)[seed % 2]
    input_ids = torch.randint(0, VOCAB, (T,), generator=g, dtype=id_dtype)
    token_map = torch.randint(0, COMPRESSED, (VOCAB,), generator=g, dtype=(torch.int64, torch.int32)[seed % 2])
    dead = torch.rand(T, generator=g) < 0.15
    lookback = torch.randint(-1, VOCAB, (R + int(torch.randint(0, 2, (), generator=g)), depth), generator=g,
                             dtype=id_dtype)
    lookback[torch.rand(lookback.shape, generator=g) < 0.2] = -1
    lookback_dead = torch.rand(lookback.shape, generator=g) < 0.2
    cache = block_table = None
    block_size = int(torch.randint(1, 5, (), generator=g))
    dead_id = (DEAD_ID, COMPRESSED + 3)[seed % 2]  # vLLM's -1, or a sentinel the kernel must turn into -1
    if slot_cache:
        num_slots = int(torch.randint(1, 48, (), generator=g))
        cache = torch.randint(0, COMPRESSED, (num_slots,), generator=g, dtype=torch.int32)
        cache[torch.rand(num_slots, generator=g) < 0.2] = dead_id
        rows = int(torch.randint(1, R + 2, (), generator=g))  # fewer rows than requests: the last row repeats
        block_table = torch.randint(-1, num_slots // block_size + 2, (rows, int(torch.randint(1, 6, (), generator=g))),
                                    generator=g, dtype=torch.int32)
    tensors = dict(input_ids=input_ids, token_map=token_map, dead_mask=dead, positions=positions.to(pos_dtype),
                   block_table=block_table, query_start_loc=qsl.to((torch.int32, torch.int64)[seed % 3 == 0]),
                   cache=cache, lookback_token_ids=lookback, lookback_dead_mask=lookback_dead)
    tensors = {k: None if v is None else _strided(v.to(device), g) for k, v in tensors.items()}
    scalars = dict(pad_id=int(torch.randint(0, COMPRESSED, (), generator=g)), cache_block_size=block_size,
                   dead_id=dead_id, MAX_NGRAM=max_ngram)
    return tensors, scalars


def hash_tables(L, max_ngram, heads, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    C = (max_ngram - 1) * heads
    multipliers = torch.randint(1, 2**20, (L, max_ngram), generator=g) * 2 + 1
    primes = torch.randint(50, 1000, (L, max_ngram - 1, heads), generator=g)
    offsets = torch.randint(0, 10**6, (L, C), generator=g)
    return multipliers.to(device), primes.to(device), offsets.to(device)


def run_hash_ids(x, s, tables, heads, block_t=32):
    """``hash_ids`` launched as vLLM's ``NgramHashState.forward`` launches ``_hash_ids_kernel``."""
    multipliers, primes, offsets = tables
    L, T = multipliers.shape[0], x["input_ids"].shape[0]
    out = torch.full((T, L, (s["MAX_NGRAM"] - 1) * heads), -7, dtype=torch.int32, device=x["input_ids"].device)
    bt, lb, lbd = x["block_table"], x["lookback_token_ids"], x["lookback_dead_mask"]
    hash_ids_kernel[(-(-T // block_t), L)](
        x["input_ids"], x["token_map"], x["dead_mask"], x["positions"], bt, x["query_start_loc"], multipliers,
        primes, offsets, x["cache"], lb, lbd, out, T, x["cache"].shape[0] if x["cache"] is not None else 0,
        s["pad_id"], input_stride=x["input_ids"].stride(0), mask_stride=x["dead_mask"].stride(0),
        position_stride=x["positions"].stride(0), table_stride=bt.stride(0) if bt is not None else 0,
        table_col_stride=bt.stride(1) if bt is not None else 0, query_stride=x["query_start_loc"].stride(0),
        num_query_rows=x["query_start_loc"].numel() - 1, num_table_rows=bt.shape[0] if bt is not None else 0,
        max_blocks=bt.shape[1] if bt is not None else 0, cache_block_size=s["cache_block_size"],
        MAX_NGRAM=s["MAX_NGRAM"], num_heads=heads, BLOCK_T=block_t, BLOCK_H=4, dead_id=s["dead_id"],
        lookback_depth=lb.shape[1], lookback_row_stride=lb.stride(0), lookback_col_stride=lb.stride(1),
        lookback_mask_row_stride=lbd.stride(0), lookback_mask_col_stride=lbd.stride(1), num_warps=4)
    return out


def reference_hash(x, s, tables, heads, own, history):
    """The hash launch ``hash_ids`` made on the torch rows."""
    multipliers, primes, offsets = tables
    T, L = own.shape[0], multipliers.shape[0]
    out = torch.full((T, L, (s["MAX_NGRAM"] - 1) * heads), -7, dtype=torch.int32, device=own.device)
    launch_ngram_hash(own.clamp(min=0), torch.arange(T + 1, device=own.device), primes.contiguous(),
                      offsets.contiguous(), multipliers.contiguous(), out, s["pad_id"], max_ngram=s["MAX_NGRAM"],
                      n_heads=heads, history=history, dead_mask=own < 0)
    return out


def check_rows(x, s):
    """The reference rows (``own [T]``, ``history [T, MAX_NGRAM - 1]``, int64, -1 where a
    lag is blocked)."""
    own, history = _torch_rows(**x, **s)
    T = x["input_ids"].shape[0]
    assert own.dtype == history.dtype == torch.int64 and history.shape == (T, s["MAX_NGRAM"] - 1)
    return own, history


def check_hash(x, s, heads, seed, L=2):
    """``hash_ids`` on the batch against the reference rows hashed; returns the rows."""
    own, history = check_rows(x, s)
    tables = hash_tables(L, s["MAX_NGRAM"], heads, seed, device=x["input_ids"].device)
    got = run_hash_ids(x, s, tables, heads)
    assert torch.equal(got, reference_hash(x, s, tables, heads, own, history))
    return own, history


@pytest.mark.parametrize("pos_dtype", [torch.int64, torch.int32], ids=["pos64", "pos32"])
@pytest.mark.parametrize("slot_cache", [False, True], ids=["v2", "v1_cache"])
@pytest.mark.parametrize("depth", [0, 1, 3])
@pytest.mark.parametrize("max_ngram", [2, 3, 4])
def test_rows_and_hash_match_the_torch_ops(max_ngram, depth, slot_cache, pos_dtype):
    heads = 3
    for seed in range(6):
        x, s = random_batch(seed * 131 + max_ngram * 7 + depth, max_ngram=max_ngram, slot_cache=slot_cache,
                            depth=depth, pos_dtype=pos_dtype)
        if x["input_ids"].shape[0] == 0:
            continue
        check_hash(x, s, heads, seed)


def test_a_larger_batch_crosses_program_blocks():
    """More tokens than one program's block, many requests (several search steps)."""
    for slot_cache in (False, True):
        x, s = random_batch(5, max_ngram=3, slot_cache=slot_cache, depth=2, pos_dtype=torch.int64, requests=40,
                            max_len=14)
        assert x["input_ids"].shape[0] > 128
        check_hash(x, s, 2, 1)


def test_edge_batches():
    """One request; every request empty (all tokens past the last end); no token."""
    x, s = random_batch(3, max_ngram=4, slot_cache=True, depth=2, pos_dtype=torch.int64, requests=3)
    T = x["input_ids"].shape[0]
    for qsl in ([0, T], [0, 0, 0], [0, 0, T, T]):
        x = {**x, "query_start_loc": torch.tensor(qsl)}
        check_hash(x, s, 2, len(qsl))
    # T = 0: hash_ids returns before any launch.
    empty = {**x, "input_ids": x["input_ids"][:0], "dead_mask": x["dead_mask"][:0], "positions": x["positions"][:0]}
    tables = hash_tables(2, 4, 2, 0)
    assert run_hash_ids(empty, s, tables, 2).shape == (0, 2, 6)


def test_the_example_conventions():
    """A hand-made batch: an unknown lookback id reads pad and older ids still count; a
    dead one hides the older; a padding token past the last end belongs to the last
    request; a negative position reads -1."""
    token_map = torch.arange(VOCAB) + 100
    qsl = torch.tensor([0, 2, 2, 3])  # request 1 has no token
    input_ids = torch.tensor([1, 2, 3, 4, 5])
    positions = torch.tensor([5, 6, 2, 3, -1])  # tokens 3, 4: padding past the last end (request 2)
    dead = torch.zeros(5, dtype=torch.bool)
    lookback = torch.tensor([[-1, 7, 8], [0, 0, 0], [9, 10, 11]])  # newest first
    lookback_dead = torch.tensor([[False, False, False], [False, False, False], [False, True, False]])
    x = dict(input_ids=input_ids, token_map=token_map, dead_mask=dead, positions=positions, block_table=None,
             query_start_loc=qsl, cache=None, lookback_token_ids=lookback, lookback_dead_mask=lookback_dead)
    s = dict(pad_id=0, cache_block_size=1, dead_id=DEAD_ID, MAX_NGRAM=4)
    own, history = check_hash(x, s, 2, 5)
    assert own.tolist() == [101, 102, 103, 104, -1]
    assert history[0].tolist() == [108, 107, 0]  # lags 3, 2, 1: window cols 2, 1, 0 (0 unknown: pad)
    assert history[1].tolist() == [107, 0, 101]
    assert history[2].tolist() == [-1, -1, 109]  # window col 1 dead (hides col 2); col 0 = 9
    assert history[3].tolist() == [-1, 109, 103]  # request 2's: token 2 at position 2, then its window
    assert history[4].tolist() == [-1, -1, -1]  # a negative position


def test_bool_masks_load_as_flags_under_the_interpreter():
    """The dead masks reach the kernel as uint8 views (no copy) and any non-zero flag counts."""
    x, s = random_batch(11, max_ngram=3, slot_cache=False, depth=2, pos_dtype=torch.int64)
    assert x["dead_mask"].any() and x["lookback_dead_mask"].any()
    tables = hash_tables(2, 3, 2, 4)
    want = run_hash_ids(x, s, tables, 2)
    as_bytes = {**x, "dead_mask": x["dead_mask"].to(torch.uint8) * 3,
                "lookback_dead_mask": x["lookback_dead_mask"].to(torch.int32)}
    assert torch.equal(run_hash_ids(as_bytes, s, tables, 2), want)
    no_dead = {**x, "dead_mask": torch.zeros_like(x["dead_mask"]),
               "lookback_dead_mask": torch.zeros_like(x["lookback_dead_mask"])}
    assert not torch.equal(run_hash_ids(no_dead, s, tables, 2), want)  # the masks are read


def test_refuses_a_cache_it_cannot_address():
    x, s = random_batch(2, max_ngram=3, slot_cache=True, depth=1, pos_dtype=torch.int64)
    multipliers, primes, offsets = hash_tables(2, 3, 2, 0)
    out = torch.zeros(x["input_ids"].shape[0], 2, 4, dtype=torch.int32)

    def launch(x, s):
        vllm_engram_hash(x["input_ids"], x["token_map"], x["dead_mask"], x["positions"], x["query_start_loc"],
                         x["lookback_token_ids"], x["lookback_dead_mask"], multipliers, primes, offsets, out,
                         max_ngram=3, n_heads=2, pad_id=s["pad_id"], cache=x["cache"], block_table=x["block_table"],
                         cache_block_size=s["cache_block_size"], dead_id=s["dead_id"])

    with pytest.raises(ValueError, match="cache"):
        launch(x, {**s, "cache_block_size": 0})
    with pytest.raises(ValueError, match="cache"):
        launch({**x, "block_table": None}, s)


@pytest.mark.gpu
def test_gpu_rows_and_hash_at_a_serving_batch(gpu):
    """A serving batch on the GPU (256 requests, about 4000 tokens, int32 positions and
    ids as vLLM passes them): the hash output bit for bit against the torch rows hashed
    on the same device, V2 and the V1 slot cache."""
    for slot_cache in (False, True):
        x, s = random_batch(21, max_ngram=3, slot_cache=slot_cache, depth=2, pos_dtype=torch.int32, device=gpu,
                            requests=256, max_len=32)
        check_hash(x, s, 8, 3)
        torch.cuda.synchronize()

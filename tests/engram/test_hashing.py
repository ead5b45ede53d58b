import numpy as np
import pytest
import torch

from kda_engram.engram.hashing import build_compressed_token_map, ngram_hash, next_history
from kda_engram.engram.layout import EngramLayout
from kda_engram.engram.reference import (
    naive_compressed_token_map,
    naive_next_history,
    naive_ngram_hash_padded,
    naive_ngram_hash,
)

from ..helpers import refused

VOCAB = 50


def small_layout(max_ngram=4, n_heads=3, vocab=VOCAB):
    return EngramLayout.build(
        layer_ids=[1, 3], max_ngram=max_ngram, n_heads=n_heads, head_dim=8,
        vocab_size=[101, 203, 307][: max_ngram - 1], compressed_vocab_size=vocab, pad_id=2,
    )


def batch(lengths, extra=2, seed=0, dtype=torch.int64, vocab=VOCAB):
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    T = int(cu[-1]) + extra
    tok = torch.randint(0, vocab, (T,), generator=gen).to(dtype)
    hist = torch.randint(-1, vocab, (len(lengths), 3), generator=gen).to(dtype)
    dead = torch.rand(T, generator=gen) < 0.2
    return tok, cu, hist, dead


LENGTHS = [1, 0, 5, 9, 3, 0]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("use_history", [False, True])
@pytest.mark.parametrize("use_dead", [False, True])
def test_hash_matches_reference(dtype, use_history, use_dead):
    layout = small_layout()
    tok, cu, hist, dead = batch(LENGTHS, dtype=dtype)
    kw = {}
    if use_history:
        kw["history"] = hist
    if use_dead:
        kw["dead_mask"] = dead
    got = ngram_hash(tok, cu, layout, **kw)
    assert got.dtype == torch.int32 and got.shape == (tok.shape[0], 2, 9)
    np.testing.assert_array_equal(got.numpy(), naive_ngram_hash(tok, cu, layout, **kw))
    # Tokens past the last sequence have no rows.
    assert (got[int(cu[-1]) :] == -1).all()


def test_hash_equals_the_papers_batch_form():
    layout = small_layout()
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (3, 11), generator=gen)
    got = ngram_hash(x.reshape(-1), torch.tensor([0, 11, 22, 33]), layout).numpy().reshape(3, 11, 2, -1)
    for li in range(2):
        np.testing.assert_array_equal(got[:, :, li] - layout.row_offsets()[li], naive_ngram_hash_padded(x, layout, li))


def test_rows_lie_in_their_column_tables_and_global_rows():
    layout = small_layout()
    tok, cu, _, _ = batch([40], extra=0)
    rows = ngram_hash(tok, cu, layout).numpy()
    off = layout.row_offsets()
    sizes = layout.primes.reshape(2, -1)
    assert ((rows >= off[None]) & (rows < (off + sizes)[None])).all()
    glob = ngram_hash(tok, cu, layout, global_rows=True).numpy()
    np.testing.assert_array_equal(glob, rows + (layout.row_offsets(global_rows=True) - off)[None])


def test_token_map_and_strided_ids():
    layout = small_layout()
    gen = torch.Generator().manual_seed(2)
    token_map = torch.randint(0, VOCAB, (1000,), generator=gen)[::2]  # every input strided
    raw = torch.randint(0, 500, (20, 2), generator=gen)[:, 1]
    cu = torch.tensor([[0, 9], [7, 9], [20, 9]])[:, 0]
    hist = torch.tensor([[-1, 4, 499], [3, -1, 17]])
    got = ngram_hash(raw, cu, layout, token_map=token_map, history=hist)
    mapped_hist = torch.where(hist >= 0, token_map[hist.clamp(min=0)], hist)
    np.testing.assert_array_equal(got.numpy(), ngram_hash(token_map[raw], cu, layout, history=mapped_hist).numpy())
    np.testing.assert_array_equal(got.numpy(), naive_ngram_hash(raw, cu, layout, token_map=token_map, history=hist))
    nh = next_history(raw, cu, layout, history=hist)
    np.testing.assert_array_equal(nh.numpy(), naive_next_history(raw, cu, layout, history=hist))


def test_continuing_a_sequence_equals_hashing_it_whole():
    """Chunked prefill of two sequences, then decode one token at a time, with
    next_history carried between calls, gives the rows of hashing them whole."""
    layout = small_layout()
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (17, 12)]
    deads = [torch.rand(n, generator=gen) < 0.15 for n in (17, 12)]
    whole = [ngram_hash(s, torch.tensor([0, len(s)]), layout, dead_mask=d) for s, d in zip(seqs, deads)]
    cuts = [[0, 5, 6, 13, 14, 15, 16, 17], [0, 1, 9, 10, 10, 11, 12, 12]]  # chunks, then 1-token steps
    history = torch.full((2, 3), -1, dtype=torch.int64)
    pieces = [[], []]
    for k in range(len(cuts[0]) - 1):
        toks = torch.cat([seqs[n][cuts[n][k] : cuts[n][k + 1]] for n in range(2)])
        dead = torch.cat([deads[n][cuts[n][k] : cuts[n][k + 1]] for n in range(2)])
        lens = [cuts[n][k + 1] - cuts[n][k] for n in range(2)]
        cu = torch.tensor([0, lens[0], lens[0] + lens[1]])
        rows = ngram_hash(toks, cu, layout, history=history, dead_mask=dead)
        pieces[0].append(rows[: lens[0]])
        pieces[1].append(rows[lens[0] :])
        new = next_history(toks, cu, layout, history=history, dead_mask=dead)
        np.testing.assert_array_equal(new.numpy(), naive_next_history(toks, cu, layout, history=history, dead_mask=dead))
        # In place into the caller's buffer gives the same.
        inplace = history.clone()
        next_history(toks, cu, layout, history=inplace, dead_mask=dead, out=inplace)
        assert torch.equal(inplace, new)
        history = new
    for n in range(2):
        assert torch.equal(torch.cat(pieces[n]), whole[n])


def test_dead_token_blocks_everything_older():
    layout = small_layout()
    tok = torch.tensor([5, 6, 7, 8, 9, 10])
    dead = torch.tensor([False, False, True, False, False, False])
    cu = torch.tensor([0, 6])
    got = ngram_hash(tok, cu, layout, dead_mask=dead)
    # After the dead token the sequence hashes as if it started at token 3.
    fresh = ngram_hash(tok[3:], torch.tensor([0, 3]), layout)
    assert torch.equal(got[3:], fresh)
    # The dead token itself hashes as a pad run, like a history of -1.
    pads = ngram_hash(torch.tensor([layout.hash_pad_id]), torch.tensor([0, 1]), layout)
    assert torch.equal(got[2], pads[0])


def test_v41_layout_large_multipliers():
    layout = EngramLayout.from_config(
        {
            "engram_layer_ids": [1, 14], "engram_max_ngram_size": 4, "engram_n_heads": 8,
            "engram_head_dim": 256, "engram_vocab_size": 16_000_000,
            "engram_compressed_vocab_size": 99_092, "engram_pad_token_id": 2,
        }
    )
    gen = torch.Generator().manual_seed(4)
    tok = torch.cat([torch.tensor([99_091, 99_090, 0, 1]), torch.randint(0, 99_092, (40,), generator=gen)])
    cu = torch.tensor([0, 30, 44], dtype=torch.int32)
    hist = torch.tensor([[-1, -1, -1], [99_091, 5, 7]])
    got = ngram_hash(tok, cu, layout, history=hist)
    np.testing.assert_array_equal(got.numpy(), naive_ngram_hash(tok, cu, layout, history=hist))


def test_empty_batches():
    layout = small_layout()
    assert ngram_hash(torch.zeros(0, dtype=torch.int64), torch.tensor([0]), layout).shape == (0, 2, 9)
    out = ngram_hash(torch.zeros(3, dtype=torch.int64), torch.tensor([0]), layout)
    assert (out == -1).all()
    assert next_history(torch.zeros(3, dtype=torch.int64), torch.tensor([0]), layout).shape == (0, 3)


def test_strided_out():
    layout = small_layout()
    tok, cu, hist, _ = batch([4, 6], extra=0)
    buf = torch.full((10, 2, 18), 7, dtype=torch.int32)
    out = buf[:, :, ::2]
    ngram_hash(tok, cu, layout, out=out)
    np.testing.assert_array_equal(out.numpy(), naive_ngram_hash(tok, cu, layout))
    assert (buf[:, :, 1::2] == 7).all()


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda t, c, h: dict(token_ids=t.float(), cu_seqlens=c), TypeError, "token_ids"),
        (lambda t, c, h: dict(token_ids=t.reshape(1, -1), cu_seqlens=c), ValueError, "token_ids"),
        (lambda t, c, h: dict(token_ids=t, cu_seqlens=c.flip(0)), ValueError, "cu_seqlens"),
        (lambda t, c, h: dict(token_ids=t + VOCAB, cu_seqlens=c), ValueError, "token_ids"),
        (lambda t, c, h: dict(token_ids=t, cu_seqlens=c, history=h[:, :2]), ValueError, "history"),
        (lambda t, c, h: dict(token_ids=t, cu_seqlens=c, history=h.float()), TypeError, "history"),
        (lambda t, c, h: dict(token_ids=t, cu_seqlens=c, dead_mask=t[:3] > 0), ValueError, "dead_mask"),
        (lambda t, c, h: dict(token_ids=t, cu_seqlens=c, token_map=torch.tensor([0, 1])), ValueError, "token_ids"),
        (lambda t, c, h: dict(token_ids=t, cu_seqlens=c, token_map=torch.tensor([0, VOCAB])), ValueError, "token_map"),
    ],
)
def test_bad_inputs(make, exc, match):
    layout = small_layout()
    tok, cu, hist, _ = batch([3, 4])
    with refused(exc, match=match):
        ngram_hash(layout=layout, **make(tok, cu, hist))


def test_bad_layout_and_out():
    layout = small_layout()
    tok, cu, _, _ = batch([3])
    with refused(TypeError, match="layout"):
        ngram_hash(tok, cu, {"layers": 2})
    with refused(TypeError, match="out"):
        ngram_hash(tok, cu, layout, out=torch.empty(tok.shape[0], 2, 9, dtype=torch.int64))


# -- tokenizer compression -------------------------------------------------------------


def tiny_tokenizer():
    """A byte-level BPE tokenizer built from a hand-written vocabulary: case and
    accent variants, whitespace tokens, a ligature, two partial UTF-8 byte tokens."""
    import tokenizers  # in the test extra
    from tokenizers import AddedToken, decoders, models

    pieces = ["<pad>", "<s>", "Hello", "hello", "ĠHello", "Ġhello", "cafÃ©", "cafe", "Ã", "©",
              "Ġ", "Ċ", "ĠĠ", "ï¬ģ", "fi", "ĉ", "HELLO"]  # fmt: skip
    tok = tokenizers.Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[]))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<pad>", special=True), AddedToken("<s>", special=True), AddedToken("<|User|>", special=True)])
    return tok


def test_compressed_token_map():
    tok = tiny_tokenizer()
    got = build_compressed_token_map(tok)
    # hello x5 -> 2, cafe x2 -> 3, two byte pieces stay apart, whitespace -> one
    # " " id, the "fi" ligature joins "fi", ids in first-seen order.
    expect = [0, 1, 2, 2, 2, 2, 3, 3, 4, 5, 6, 6, 6, 7, 7, 6, 2, 8]
    assert got.token_map.tolist() == expect and got.num_compressed == 9
    n = tok.get_vocab_size(with_added_tokens=True)
    texts = [tok.decode([i], skip_special_tokens=False) for i in range(n)]
    ref, size = naive_compressed_token_map(texts, [tok.id_to_token(i) for i in range(n)])
    assert got.token_map.tolist() == ref.tolist() and got.num_compressed == size


def test_compressed_map_drives_layout_and_hash():
    tok = tiny_tokenizer()
    cmap = build_compressed_token_map(tok)
    layout = EngramLayout.build(
        layer_ids=[2], max_ngram=3, n_heads=2, head_dim=8, vocab_size=61,
        compressed_vocab_size=cmap.num_compressed, pad_id=0, token_map=cmap.token_map,
    )
    ids = torch.tensor([1, 2, 4, 6, 9, 16, 3, 17])
    cu = torch.tensor([0, 8])
    a = ngram_hash(ids, cu, layout, token_map=cmap.token_map)
    b = ngram_hash(cmap.token_map[ids], cu, layout)
    assert torch.equal(a, b)
    # "Hello" and "hello" hash alike once compressed.
    assert torch.equal(ngram_hash(torch.tensor([2, 2]), torch.tensor([0, 2]), layout, token_map=cmap.token_map),
                       ngram_hash(torch.tensor([3, 16]), torch.tensor([0, 2]), layout, token_map=cmap.token_map))


# -- GPU ---------------------------------------------------------------------------------


def v41_layout():
    return EngramLayout.from_config(
        {
            "engram_layer_ids": [1, 14], "engram_max_ngram_size": 4, "engram_n_heads": 8,
            "engram_head_dim": 256, "engram_vocab_size": 16_000_000,
            "engram_compressed_vocab_size": 99_092, "engram_pad_token_id": 2,
        }
    )


@pytest.mark.gpu
def test_gpu_hash_prefill_size(gpu):
    layout = v41_layout()
    gen = torch.Generator().manual_seed(0)
    lengths = [1, 63, 64, 65, 0, 4000, 12191]
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    T = int(cu[-1])
    tok = torch.randint(0, 99_092, (T,), generator=gen)
    hist = torch.randint(-1, 99_092, (len(lengths), 3), generator=gen)
    dead = torch.rand(T, generator=gen) < 0.01
    got = ngram_hash(tok.to(gpu), cu.to(gpu), layout, history=hist.to(gpu), dead_mask=dead.to(gpu))
    np.testing.assert_array_equal(got.cpu().numpy(), naive_ngram_hash(tok, cu, layout, history=hist, dead_mask=dead))
    nh = next_history(tok.to(gpu), cu.to(gpu), layout, history=hist.to(gpu), dead_mask=dead.to(gpu))
    np.testing.assert_array_equal(nh.cpu().numpy(), naive_next_history(tok, cu, layout, history=hist, dead_mask=dead))


@pytest.mark.gpu
def test_gpu_hash_graph_capture(gpu):
    """With checks off the hash and the history update are capturable in a CUDA graph."""
    layout = v41_layout()
    tok = torch.randint(0, 99_092, (64,), device=gpu)
    cu = torch.arange(65, device=gpu, dtype=torch.int32)  # 64 decode steps
    hist = torch.randint(-1, 99_092, (64, 3), device=gpu)
    out = torch.empty(64, 2, 24, dtype=torch.int32, device=gpu)
    ngram_hash(tok, cu, layout, history=hist, out=out, check_inputs=False)  # compile outside the capture
    next_history(tok, cu, layout, history=hist, check_inputs=False)
    expect_rows = naive_ngram_hash(tok.cpu(), cu.cpu(), layout, history=hist.cpu())
    expect_hist = naive_next_history(tok.cpu(), cu.cpu(), layout, history=hist.cpu())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ngram_hash(tok, cu, layout, history=hist, out=out, check_inputs=False)
        next_history(tok, cu, layout, history=hist, out=hist, check_inputs=False)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    np.testing.assert_array_equal(out.cpu().numpy(), expect_rows)
    np.testing.assert_array_equal(hist.cpu().numpy(), expect_hist)


@pytest.mark.parametrize("bad", [-2, -5, VOCAB, 99])
def test_a_history_id_outside_the_vocabulary_or_minus_one_is_refused_naming_history(bad):
    # Issue 54: any negative id was read as "none" (the docstring says -1), and an
    # id past the vocabulary was blamed on token_ids.
    layout = small_layout()
    tok, cu, hist, _ = batch([3, 4])
    hist = hist.clone()
    hist[1, 0] = bad
    with refused(ValueError, match=rf"^history: expected ids in \[0, {VOCAB}\) \(layout.compressed_vocab_size\) "
                                   rf"or -1 \(none\), got \[{min(bad, -1) if bad < 0 else '-?[0-9]+'}, "):
        ngram_hash(tok, cu, layout, history=hist)
    if bad < -1:  # next_history knows no vocabulary: only the sign rule
        with refused(ValueError, match=rf"^history: expected ids >= 0 or -1 \(none\), got {bad}"):
            next_history(tok, cu, layout, history=hist)


def test_a_history_of_minus_one_and_vocabulary_ids_is_accepted():
    layout = small_layout()
    tok, cu, hist, _ = batch([3, 4])
    hist = hist.clone()
    hist[0] = -1
    hist[1, 0] = VOCAB - 1
    ngram_hash(tok, cu, layout, history=hist)
    next_history(tok, cu, layout, history=hist)

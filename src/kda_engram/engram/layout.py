"""Where every hashed n-gram lands: table sizes, multipliers and row offsets.

Engram (DeepSeek-V4.1) hashes, at every Engram layer ``l``, each n-gram of
order ``n = 2..max_ngram`` ending at a token into ``n_heads`` tables whose sizes
are distinct primes. A layer's tables are concatenated into one embedding table
of ``engram_num_embeddings[l]`` rows; the hash of (order ``n``, head ``j``) is
its *hash column* ``c = (n - 2) * n_heads + j``, and its table starts at row
``column_offsets(l)[c]``. So a token's embedding is the concatenation of
``n_hash_cols = (max_ngram - 1) * n_heads`` rows of ``head_dim`` values.

The numbers must match the checkpoint bit for bit, so the rules are exactly the
ones the published table sizes come from (checked by the tests against
DeepSeek-V4.1-Flash's ``engram_num_embeddings = [384006168, 384016682]``):

* **Primes.** Walking layers in ``engram_layer_ids`` order, then orders, then
  heads, the first head of order ``n`` takes the smallest prime ``>=
  vocab_size[n - 2]`` not used yet, and every further head the smallest unused
  prime above its predecessor. One set of used primes is shared by all layers,
  so no two (layer, order, head) tables have the same size (their hashes stay
  independent). Primality is a deterministic Miller-Rabin test (exact for every
  ``n < 3.3e24``), so building V4.1's layout takes milliseconds and needs no
  sympy.
* **Multipliers.** Per layer, ``max_ngram`` odd int64s ``2 r + 1`` with ``r``
  drawn by ``numpy.random.default_rng(seed + 10007 * layer_id).integers(0,
  half_bound, size=max_ngram, dtype=int64)`` and ``half_bound = max(1,
  (2**63 - 1) // compressed_vocab_size // 2)``: a compressed token id times a
  multiplier cannot overflow int64, and XOR of non-negative products stays
  non-negative, so ``mix mod prime`` is the same in NumPy and in the kernel.
  NumPy's ``default_rng`` (PCG64) stream is stable across NumPy versions.
* **Pad id.** Positions before a sequence's first token hash as the pad token
  *in the compressed vocabulary*: ``token_map[engram_pad_token_id]`` when a
  compressed-token map is given, else the configured id itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

#: The layer-seed stride of the multiplier RNG: layer ``l`` seeds it with
#: ``seed + LAYER_SEED_STRIDE * l`` (DeepSeek's Engram reference).
LAYER_SEED_STRIDE = 10007

_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin: exact for all ``n < 3.3 * 10**24`` (bases up to 41)."""
    n = int(n)
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x == 1 or x == n - 1:
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def next_unused_prime(start: int, used: set[int]) -> int:
    """Smallest prime ``>= start`` that is not in ``used``."""
    candidate = max(int(start), 2)
    while candidate in used or not is_prime(candidate):
        candidate += 1
    return candidate


def config_value(cfg: Any, key: str, default: Any = dataclasses.MISSING) -> Any:
    """``cfg[key]`` of a mapping or ``cfg.key`` of an object (a Hugging Face config);
    ``default`` when missing, a ``ValueError`` naming the key when there is none."""
    if isinstance(cfg, Mapping):
        if key in cfg:
            return cfg[key]
    elif hasattr(cfg, key):
        return getattr(cfg, key)
    if default is dataclasses.MISSING:
        raise ValueError(f"cfg: the config needs the key {key!r}, which is missing")
    return default


@dataclasses.dataclass(frozen=True, eq=False)
class EngramLayout:
    """Prime table sizes, hash multipliers and row offsets of every Engram layer.

    Arrays (host NumPy, int64):

    * ``primes [n_layers, max_ngram - 1, n_heads]``: table size of (layer, order, head).
    * ``multipliers [n_layers, max_ngram]``: odd; lag ``i`` (token ``t - i``) uses ``[l, i]``.

    Use :meth:`from_config` to build one from a model config; the plain
    constructor recomputes nothing and is for tests and custom layouts.
    """

    layer_ids: tuple[int, ...]
    max_ngram: int
    n_heads: int
    head_dim: int
    vocab_sizes: tuple[int, ...]
    compressed_vocab_size: int
    pad_id: int
    hash_pad_id: int
    seed: int
    primes: np.ndarray
    multipliers: np.ndarray
    _device_cache: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    # -- construction ---------------------------------------------------------------

    @classmethod
    def build(
        cls,
        *,
        layer_ids: Sequence[int],
        max_ngram: int,
        n_heads: int,
        head_dim: int,
        vocab_size: int | Sequence[int],
        compressed_vocab_size: int,
        pad_id: int,
        seed: int = 0,
        token_map: torch.Tensor | np.ndarray | None = None,
    ) -> "EngramLayout":
        """Compute primes and multipliers (see the module docstring for the rules).

        ``vocab_size``: one table-size floor for every order, or one per order
        (``max_ngram - 1`` values). ``token_map``: the raw -> compressed id map of
        :func:`kda_engram.engram.hashing.build_compressed_token_map`; when given,
        the pad id is mapped through it and its size is checked against
        ``compressed_vocab_size``.
        """
        layer_ids = tuple(int(x) for x in layer_ids)
        max_ngram, n_heads, head_dim = int(max_ngram), int(n_heads), int(head_dim)
        compressed_vocab_size, pad_id, seed = int(compressed_vocab_size), int(pad_id), int(seed)
        if not layer_ids:
            raise ValueError("layer_ids: expected at least one Engram layer, got none")
        if len(set(layer_ids)) != len(layer_ids):
            raise ValueError(f"layer_ids: expected distinct layer ids, got {list(layer_ids)}")
        if max_ngram < 2:
            raise ValueError(f"max_ngram: expected >= 2 (bigrams and up), got {max_ngram}")
        if n_heads < 1 or head_dim < 1:
            raise ValueError(f"n_heads, head_dim: expected >= 1, got {n_heads}, {head_dim}")
        if compressed_vocab_size < 1:
            raise ValueError(f"compressed_vocab_size: expected >= 1, got {compressed_vocab_size}")
        if isinstance(vocab_size, (int, np.integer)):
            vocab_sizes = (int(vocab_size),) * (max_ngram - 1)
        else:
            vocab_sizes = tuple(int(v) for v in vocab_size)
            if len(vocab_sizes) != max_ngram - 1:
                raise ValueError(
                    f"vocab_size: expected one value or max_ngram - 1 = {max_ngram - 1} values, got {len(vocab_sizes)}"
                )
        if min(vocab_sizes) < 2:
            raise ValueError(f"vocab_size: expected table sizes >= 2, got {list(vocab_sizes)}")

        hash_pad_id = pad_id
        if token_map is not None:
            tm = torch.as_tensor(token_map).cpu()
            if tm.dim() != 1 or not (0 <= pad_id < tm.numel()):
                raise ValueError(f"token_map: expected a 1-d map covering pad_id {pad_id}, got shape {list(tm.shape)}")
            size = int(tm.max()) + 1 if tm.numel() else 0
            if size != compressed_vocab_size:
                raise ValueError(
                    f"token_map: maps onto {size} compressed ids, the config says compressed_vocab_size "
                    f"{compressed_vocab_size}"
                )
            hash_pad_id = int(tm[pad_id])
        if not 0 <= hash_pad_id < compressed_vocab_size:
            raise ValueError(f"pad_id: expected a compressed id in [0, {compressed_vocab_size}), got {hash_pad_id}")

        n_layers, n_orders = len(layer_ids), max_ngram - 1
        primes = np.empty((n_layers, n_orders, n_heads), dtype=np.int64)
        used: set[int] = set()
        for li in range(n_layers):
            for o in range(n_orders):
                candidate = vocab_sizes[o]
                for j in range(n_heads):
                    p = next_unused_prime(candidate, used)
                    used.add(p)
                    primes[li, o, j] = p
                    candidate = p + 1

        half_bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
        multipliers = np.empty((n_layers, max_ngram), dtype=np.int64)
        for li, layer_id in enumerate(layer_ids):
            rng = np.random.default_rng(seed + LAYER_SEED_STRIDE * layer_id)
            r = rng.integers(low=0, high=half_bound, size=(max_ngram,), dtype=np.int64)
            multipliers[li] = r * 2 + 1
        primes.setflags(write=False)
        multipliers.setflags(write=False)
        return cls(
            layer_ids=layer_ids,
            max_ngram=max_ngram,
            n_heads=n_heads,
            head_dim=head_dim,
            vocab_sizes=vocab_sizes,
            compressed_vocab_size=compressed_vocab_size,
            pad_id=pad_id,
            hash_pad_id=hash_pad_id,
            seed=seed,
            primes=primes,
            multipliers=multipliers,
        )

    @classmethod
    def from_config(cls, cfg: Any, *, token_map=None, verify: bool = True) -> "EngramLayout":
        """From a model config (a dict or an object with attributes, e.g. a Hugging
        Face ``PretrainedConfig``) with DeepSeek-V4.1's keys:

        ``engram_layer_ids``, ``engram_max_ngram_size``, ``engram_n_heads``,
        ``engram_head_dim``, ``engram_vocab_size`` (one int, or one per order),
        ``engram_compressed_vocab_size``, ``engram_pad_token_id``; optional
        ``engram_seed`` (default 0). When the config also lists
        ``engram_num_embeddings`` (rows per layer) and ``verify`` is on, the
        computed sizes must equal it: a mismatch means the hashes would index
        the checkpoint's tables wrongly, so it raises ``ValueError``.
        """
        layout = cls.build(
            layer_ids=config_value(cfg, "engram_layer_ids"),
            max_ngram=config_value(cfg, "engram_max_ngram_size"),
            n_heads=config_value(cfg, "engram_n_heads"),
            head_dim=config_value(cfg, "engram_head_dim"),
            vocab_size=config_value(cfg, "engram_vocab_size"),
            compressed_vocab_size=config_value(cfg, "engram_compressed_vocab_size"),
            pad_id=config_value(cfg, "engram_pad_token_id"),
            seed=config_value(cfg, "engram_seed", 0),
            token_map=token_map,
        )
        published = config_value(cfg, "engram_num_embeddings", None)
        if verify and published is not None:
            published = [int(x) for x in (published if isinstance(published, Sequence) else [published])]
            if published != list(layout.num_embeddings):
                raise ValueError(
                    f"cfg.engram_num_embeddings: the config says {published}, the prime rule gives "
                    f"{list(layout.num_embeddings)}"
                )
        return layout

    # -- shapes ---------------------------------------------------------------------

    @property
    def n_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def n_hash_cols(self) -> int:
        """Hash columns per token and layer: ``(max_ngram - 1) * n_heads``."""
        return (self.max_ngram - 1) * self.n_heads

    @property
    def embedding_dim(self) -> int:
        """Width of a token's flattened embedding: ``n_hash_cols * head_dim`` (``wkv``'s input)."""
        return self.n_hash_cols * self.head_dim

    @property
    def num_embeddings(self) -> tuple[int, ...]:
        """Rows of each layer's table (DeepSeek-V4.1's ``engram_num_embeddings``)."""
        return tuple(self.primes.reshape(self.n_layers, -1).sum(axis=1).tolist())  # Python ints

    def layer_index(self, layer_id: int) -> int:
        """Position of model layer ``layer_id`` in :attr:`layer_ids` (dim 1 of the hash output)."""
        try:
            return self.layer_ids.index(int(layer_id))
        except ValueError:
            raise ValueError(f"layer_id: expected one of the Engram layers {list(self.layer_ids)}, got {layer_id}") from None

    def column_sizes(self, layer_id: int) -> np.ndarray:
        """Table size of every hash column of ``layer_id``: int64 ``[n_hash_cols]``."""
        return self.primes[self.layer_index(layer_id)].reshape(-1).copy()

    def column_offsets(self, layer_id: int) -> np.ndarray:
        """First row of every hash column's table inside the layer table: int64 ``[n_hash_cols]``."""
        sizes = self.column_sizes(layer_id)
        return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)

    def row_offsets(self, *, global_rows: bool = False) -> np.ndarray:
        """int64 ``[n_layers, n_hash_cols]``: the row each column's table starts at.

        Per layer table by default (DeepSeek-V4.1 keeps one table per Engram
        layer); with ``global_rows`` all layers' tables are taken as one,
        concatenated in ``layer_ids`` order.
        """
        sizes = self.primes.reshape(self.n_layers, -1)
        flat = np.concatenate([[0], np.cumsum(sizes.reshape(-1))[:-1]]).reshape(sizes.shape)
        if global_rows:
            return flat.astype(np.int64)
        return (flat - flat[:, :1]).astype(np.int64)

    def total_rows(self, *, global_rows: bool = False) -> int:
        """Largest table (per layer) or the sum of all tables (``global_rows``)."""
        sizes = self.num_embeddings
        return int(sum(sizes)) if global_rows else int(max(sizes))

    def device_arrays(self, device: torch.device | str, *, global_rows: bool = False):
        """``(primes [L, C], offsets [L, C], multipliers [L, max_ngram])`` as int64
        tensors on ``device``, built once per device and cached (the hash kernel
        reads them; copying them per call would cost a host->device transfer)."""
        device = torch.device(device)
        key = (str(device), bool(global_rows))
        got = self._device_cache.get(key)
        if got is None:
            got = (
                torch.from_numpy(self.primes.reshape(self.n_layers, -1).copy()).to(device),
                torch.from_numpy(self.row_offsets(global_rows=global_rows)).to(device),
                torch.from_numpy(self.multipliers.copy()).to(device),
            )
            self._device_cache[key] = got
        return got

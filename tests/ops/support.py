"""Shared pieces of the op tests: tiny CPU shapes, ``opcheck`` with the utilities
the ops must pass (schema and ``mutates_args``, fake implementation, AOT dispatch
with dynamic shapes)."""

import pytest
import torch

from kda_engram.engram.layout import EngramLayout

H, K = 1, 16
OPCHECK = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


def opcheck(op, args):
    torch.library.opcheck(op, args, test_utils=OPCHECK)


def rnd(*shape, seed=0, device="cpu", scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).mul_(scale).to(device)


def kda_raw(T, device, seed=0):
    """q, k, v, raw_g [1, T, H, K], raw_beta [1, T, H], A_log, dt_bias."""
    return (rnd(1, T, H, K, seed=seed, device=device), rnd(1, T, H, K, seed=seed + 1, device=device),
            rnd(1, T, H, K, seed=seed + 2, device=device), rnd(1, T, H, K, seed=seed + 3, device=device),
            rnd(1, T, H, seed=seed + 4, device=device), rnd(H, seed=seed + 5, device=device, scale=0.5),
            rnd(H * K, seed=seed + 6, device=device))


def idx(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def small_layout(head_dim=16):
    return EngramLayout.build(layer_ids=[0, 3], max_ngram=3, n_heads=2, head_dim=head_dim, vocab_size=[20, 30],
                              compressed_vocab_size=25, pad_id=0, seed=1)

"""The KDA custom ops (:mod:`kda_engram.ops.kda`): ``torch.library.opcheck`` on
every op, the Python wrappers against the kernel entry points, and the wrappers
generated from an entry point's signature (:class:`kda_engram.ops.common.EntryOp`).

CPU shapes are tiny (the opcheck utilities run each op several times under the
Triton interpreter).
"""

import collections
import inspect

import pytest
import torch

from kda_engram import ops
from kda_engram.kda import chunk as chunk_mod
from kda_engram.kda import conv as conv_mod
from kda_engram.kda import decode as decode_mod
from kda_engram.kda import fused_decode as fused_mod
from kda_engram.kda import prefill as prefill_mod
from kda_engram.kda import prologue as prologue_mod
from kda_engram.kda.chunk import kda_prefill_walk as walk_direct
from kda_engram.kda.conv import kda_conv_checkpoint as conv_checkpoint_direct
from kda_engram.kda.conv import kda_conv_decode as conv_decode_direct
from kda_engram.kda.decode import kda_decode as kda_decode_direct
from kda_engram.kda.decode import kda_decode_multi as decode_multi_direct
from kda_engram.kda.fused_decode import kda_layer_decode_step as layer_step_direct
from kda_engram.kda.prefill import chunk_kda_prefill as prefill_direct
from kda_engram.kda.prologue import kda_prefill_prologue as prologue_direct

from .support import DEVICES, H, K, idx, kda_raw, opcheck, rnd


def op_args(entry, *args, **kwargs):
    """An :class:`~kda_engram.ops.common.EntryOp`'s positional arguments, bound by name."""
    return tuple(entry.bind(args, kwargs).values())


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_kda_decode_ops(device):
    q, k, v, g, b, A, dt = (x[0, :2] if x.dim() > 1 else x for x in kda_raw(2, device))
    cache = rnd(3, H, K, K, seed=9, device=device, scale=0.3)
    opcheck(ops.kda_decode.op, op_args(ops.kda_decode, q, k, v, g, b, A, dt, cache, idx([2, -1], device),
                                         lower_bound=-5.0))
    qm, km, vm, gm, bm = (x.reshape(1, 2, *x.shape[1:]) for x in (q, k, v, g, b))
    multi = ops.kda_decode_multi
    opcheck(multi.op, op_args(multi, qm, km, vm, gm, bm, A, dt, cache, idx([[0, 1]], device), idx([2], device),
                              scale=0.2))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_kda_prefill_ops(device):
    # Lengths 10 and 70: T // 64 + N = 3 chunk rows, all real (the prologue leaves
    # the rows of the static bound that no chunk uses undefined, which opcheck's
    # output comparison would trip over).
    T = 80
    q, k, v, g, b, A, dt = kda_raw(T, device)
    cu = idx([0, 10, 80], device)
    C = 3 * H * K
    cw = rnd(C, 4, seed=11, device=device, scale=0.5)
    conv = rnd(4, C, 3, seed=12, device=device)
    conv_idx, has = idx([0, 3], device), torch.tensor([True, False], device=device)
    prologue = ops.kda_prefill_prologue
    opcheck(prologue.op, op_args(prologue, q, k, v, g, b, A, dt, K**-0.5, -5.0, cu, cw, conv, conv_idx, has))
    opr = ops.kda_prefill_prologue(q, k, v, g, b, A, dt, K**-0.5, -5.0, cu)
    operands = [opr[n] for n in ("qg", "w", "u", "kg_t", "aqk", "decay")]
    cache = rnd(4, H, K, K, seed=13, device=device, scale=0.3)
    state_idx, ck_off, ck_idx = idx([1, 2], device), idx([0, 64], device), idx([-1, 3], device)
    walk = ops.kda_prefill_walk
    # Checkpoints into the state cache itself (checkpoint_state=None), then a final state.
    opcheck(walk.op, op_args(walk, *operands, K**-0.5, cu, None, False, checkpoint_offsets=ck_off,
                             checkpoint_state_indices=ck_idx, state_cache=cache, state_indices=state_idx,
                             has_initial_state=has))
    opcheck(walk.op, op_args(walk, *operands, K**-0.5, cu, None, True))
    ck = torch.zeros(2, H, K, K, device=device)
    prefill = ops.chunk_kda_prefill
    opcheck(prefill.op, op_args(prefill, q, k, v, g, b, A, dt, cu_seqlens=cu, lower_bound=-5.0, state_cache=cache,
                                state_indices=state_idx, has_initial_state=has, checkpoint_state=ck,
                                checkpoint_offsets=ck_off, conv_weight=cw, conv_state=conv,
                                conv_state_indices=conv_idx, conv_has_initial_state=has))
    # A bf16 final state (the fake follows final_state_dtype) on the portable path.
    opcheck(prefill.op, op_args(prefill, q, k, v, g, b, A, dt, cu_seqlens=cu, output_final_state=True,
                                final_state_dtype=torch.bfloat16, path="portable"))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_kda_conv_ops(device):
    C = 40
    x = rnd(5, C + 8, seed=1, device=device)[:3, 4 : 4 + C]  # a strided column slice
    w = rnd(C, 4, seed=2, device=device)
    conv = rnd(4, C, 3, seed=3, device=device)
    conv_decode, conv_checkpoint = ops.kda_conv_decode, ops.kda_conv_checkpoint
    opcheck(conv_decode.op, op_args(conv_decode, x, w, conv, idx([3, -1, 0], device), out_dtype=torch.float32))
    opcheck(conv_decode.op, op_args(conv_decode, x, w, conv, idx([3, -1, 0], device)))
    xt = rnd(130, C, seed=4, device=device)
    opcheck(conv_checkpoint.op, op_args(conv_checkpoint, xt, idx([0, 64, 130], device), idx([64, 64], device),
                                        idx([1, -1], device), conv))


def layer_step_args(device, S=None):
    """``kda_layer_decode_step``'s positional arguments for two sequences (``S``
    tokens each, or one token), every input a strided band as the layer passes it."""
    lead, C = ((2,) if S is None else (2, S)), 3 * H * K
    x = rnd(*lead, C + 5, seed=1, device=device)[..., :C]
    g, b, g_out = (rnd(*lead, n, seed=s, device=device) for s, n in ((2, H * K), (3, H), (4, H * K)))
    w, conv = rnd(C, 4, seed=5, device=device, scale=0.5), rnd(5, C, 3, seed=6, device=device)
    A, dt, norm_w = rnd(H, seed=7, device=device, scale=0.5), rnd(H * K, seed=8, device=device), rnd(K, seed=9,
                                                                                                    device=device)
    cache = rnd(5, H, K, K, seed=10, device=device, scale=0.3)
    conv_idx, state_idx = (idx([2, -1], device), idx([0, -1], device)) if S is None else (
        idx([[1, 2], [3, -1]], device), idx([[0, 1], [3, 4]], device))
    return x, g, b, g_out, w, conv, conv_idx, A, dt, norm_w, cache, state_idx


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_kda_layer_decode_step_op(device):
    step = ops.kda_layer_decode_step
    for out_dtype in (None, torch.float32):
        opcheck(step.op, op_args(step, *layer_step_args(device), lower_bound=-5.0, out_dtype=out_dtype))
    # S tokens from other initial rows (arguments the op gained from the entry point's signature)
    opcheck(step.op, op_args(step, *layer_step_args(device, S=2), initial_state_indices=idx([2, -1], device),
                             initial_conv_indices=idx([0, 4], device)))


def test_wrappers_match_the_entry_points(monkeypatch):
    T = 70
    q, k, v, g, b, A, dt = kda_raw(T, "cpu", seed=20)
    cu = idx([0, 64, 70], "cpu")
    cache0 = rnd(4, H, K, K, seed=21, scale=0.3)
    has = torch.tensor([True, False])
    kw = dict(lower_bound=-5.0, cu_seqlens=cu, state_indices=idx([1, 2], "cpu"), has_initial_state=has,
              checkpoint_offsets=idx([64, 0], "cpu"), checkpoint_state_indices=idx([3, -1], "cpu"))
    c1, c2 = cache0.clone(), cache0.clone()
    o1, f1 = prefill_direct(q, k, v, g, b, A, dt, state_cache=c1, checkpoint_state=c1, **kw)
    o2, f2 = ops.chunk_kda_prefill(q, k, v, g, b, A, dt, state_cache=c2, checkpoint_state=c2, **kw)  # into the cache
    assert f1 is None and f2 is None
    assert torch.equal(o1, o2) and torch.equal(c1, c2)
    o3, f3 = ops.chunk_kda_prefill(q, k, v, g, b, A, dt, cu_seqlens=cu, lower_bound=-5.0, output_final_state=True)
    assert f3.shape == (2, H, K, K)
    qd, kd, vd, gd, bd = (x[0, :2] for x in (q, k, v, g, b))
    d1, d2 = cache0.clone(), cache0.clone()
    assert torch.equal(kda_decode_direct(qd, kd, vd, gd, bd, A, dt, d1, idx([0, 2], "cpu")),
                       ops.kda_decode(qd, kd, vd, gd, bd, A, dt, d2, idx([0, 2], "cpu")))
    assert torch.equal(d1, d2)
    assert hasattr(torch.ops.kda_engram, "chunk_kda_prefill") and hasattr(torch.ops.kda_engram, "engram_lookup")
    with pytest.raises(ValueError, match="state_cache needs"):
        ops.chunk_kda_prefill(q, k, v, g, b, A, dt, cu_seqlens=cu, state_cache=c1)
    with pytest.raises(ValueError, match="conv_state_indices"):
        ops.chunk_kda_prefill(q, k, v, g, b, A, dt, cu_seqlens=cu, conv_weight=torch.zeros(48, 4),
                              conv_state=torch.zeros(2, 48, 3))
    with pytest.raises(ValueError, match="q: expected shape"):
        ops.kda_decode(q, kd, vd, gd, bd, A, dt, d1, idx([0, 2], "cpu"))


    # checkpoint_state=None with checkpoint_offsets: the snapshots go into the cache
    # itself, in both functions (the op's form of checkpoint_state=state_cache).
    c3, c4 = cache0.clone(), cache0.clone()
    o3, _ = prefill_direct(q, k, v, g, b, A, dt, state_cache=c3, **kw)
    o4, _ = ops.chunk_kda_prefill(q, k, v, g, b, A, dt, state_cache=c4, **kw)
    assert torch.equal(o3, o1) and torch.equal(c3, c1) and torch.equal(c4, c1)
    # The cache passed as its own checkpoint buffer crosses the op as None on every
    # crossing, .unchecked included: mutated arguments of a custom op must not alias
    # (torch leaves it undefined, and detects it nowhere here, so the op's body is spied).
    import kda_engram.ops.kda as ops_kda

    real, seen = ops_kda.run_prefill, []

    def spy(x, cu_seqlens, state, conv, **kwargs):
        seen.append(state.checkpoint_state)
        return real(x, cu_seqlens, state, conv, **kwargs)

    monkeypatch.setattr(ops_kda, "run_prefill", spy)
    for cross in (lambda **a: ops.chunk_kda_prefill(**a, check_inputs=False), ops.chunk_kda_prefill.unchecked):
        c5 = cache0.clone()
        o5, _ = cross(q=q, k=k, v=v, raw_g=g, raw_beta=b, A_log=A, dt_bias=dt, state_cache=c5, checkpoint_state=c5,
                      **kw)
        assert torch.equal(o5, o1) and torch.equal(c5, c1)
    assert seen == [None, None]


def test_the_op_wrappers_have_their_entry_points_signatures():
    """Every KDA op wrapper takes its entry point's arguments by the same names, in
    the same order, with the same defaults, but those that cannot cross an op
    (``out``; launch overrides; the walk's ``config``, ``group_workspace``), then
    the functions' ``check_inputs`` switch (issue 46), keyword-only, default True."""
    for wrapper, entry, host_only in (
        (ops.chunk_kda_prefill, prefill_direct, {"out", "check_inputs"}),
        (ops.kda_prefill_walk, walk_direct, {"out", "check_inputs", "config", "group_workspace"}),
        (ops.kda_decode, kda_decode_direct, {"out", "check_inputs"}),
        (ops.kda_decode_multi, decode_multi_direct, {"out", "check_inputs"}),
        (ops.kda_prefill_prologue, prologue_direct, {"num_warps", "check_inputs"}),
        (ops.kda_conv_decode, conv_decode_direct, {"out", "check_inputs"}),
        (ops.kda_conv_checkpoint, conv_checkpoint_direct, {"check_inputs"}),
        (ops.kda_layer_decode_step, layer_step_direct, {"out", "block_v", "num_warps", "check_inputs"}),
    ):
        want = [p for n, p in inspect.signature(entry).parameters.items() if n not in host_only]
        got = list(inspect.signature(wrapper).parameters.values())
        assert got[:-1] == want
        assert got[-1].name == "check_inputs" and got[-1].kind is inspect.Parameter.KEYWORD_ONLY
        assert got[-1].default is True
    with pytest.raises(TypeError, match="unexpected keyword argument 'out'"):
        ops.chunk_kda_prefill(*kda_raw(64, "cpu"), cu_seqlens=idx([0, 64], "cpu"), out=torch.empty(1))
    with pytest.raises(TypeError, match="missing required arguments: cu_seqlens"):
        ops.chunk_kda_prefill(*kda_raw(64, "cpu"))


def conv_decode_args():
    C = 40
    x = rnd(5, C + 8, seed=1)[:3, 4 : 4 + C]  # a strided column slice
    return (x, rnd(C, 4, seed=2), rnd(4, C, 3, seed=3), idx([3, -1, 0], "cpu")), dict(out_dtype=torch.float32)


def conv_checkpoint_args():
    C = 40
    return (rnd(20, C, seed=4), idx([0, 10, 20], "cpu"), idx([5, 0], "cpu"), idx([1, -1], "cpu"),
            rnd(4, C, 3, seed=3)), {}


def decode_multi_args():
    q, k, v, g, b, A, dt = kda_raw(2, "cpu")  # B = 1 sequence of S = 2 tokens
    return (q, k, v, g, b, A, dt, rnd(3, H, K, K, seed=9, scale=0.3), idx([[0, 1]], "cpu")), dict(lower_bound=-5.0)


def prologue_args():
    return (*kda_raw(16, "cpu"), K**-0.5, -5.0, idx([0, 5, 16], "cpu")), {}


def decode_args():
    q, k, v, g, b, A, dt = (x[0, :2] if x.dim() > 1 else x for x in kda_raw(2, "cpu"))
    return (q, k, v, g, b, A, dt, rnd(3, H, K, K, seed=9, scale=0.3), idx([2, -1], "cpu")), dict(lower_bound=-5.0)


def prefill_args():
    cache = rnd(4, H, K, K, seed=13, scale=0.3)
    return kda_raw(80, "cpu"), dict(cu_seqlens=idx([0, 10, 80], "cpu"), lower_bound=-5.0, state_cache=cache,
                                    state_indices=idx([1, 2], "cpu"), has_initial_state=torch.tensor([True, False]),
                                    checkpoint_offsets=idx([0, 64], "cpu"), checkpoint_state_indices=idx([-1, 3], "cpu"))


def walk_args():
    cu = idx([0, 10, 80], "cpu")
    opr = ops.kda_prefill_prologue(*kda_raw(80, "cpu"), K**-0.5, -5.0, cu)
    return (*(opr[n] for n in ("qg", "w", "u", "kg_t", "aqk", "decay")), K**-0.5, cu, None, True), {}


#: One valid call of each op here: (args, kwargs), tiny CPU shapes, and the host rules
#: (the functions of validation/kda_*.py) its op path runs.
OP_CASES = {
    "kda_decode": (decode_args, {"check_input_forms", "check_decode_inputs", "check_decode_indices"}),
    "chunk_kda_prefill": (prefill_args, {"check_state_structure", "check_lower_bound", "check_input_forms",
                                         "check_prologue_arguments", "check_state_arguments"}),
    "kda_prefill_walk": (walk_args, {"check_state_structure", "check_chunk_operands", "check_scale",
                                     "check_cu_seqlens", "check_state_arguments"}),
    "kda_decode_multi": (decode_multi_args, {"check_input_forms", "check_decode_multi_arguments"}),
    "kda_prefill_prologue": (prologue_args, {"check_lower_bound", "check_input_forms",
                                             "check_prologue_arguments"}),
    "kda_conv_decode": (conv_decode_args, {"check_conv_decode"}),
    "kda_conv_checkpoint": (conv_checkpoint_args, {"check_conv_checkpoint"}),
    "kda_layer_decode_step": (lambda: (layer_step_args("cpu", S=2), dict(initial_state_indices=idx([2, -1], "cpu"))),
                              {"check_fused_decode_arguments"}),
}
HOST_RULES = ("check_input_forms", "check_lower_bound", "check_decode_inputs", "check_decode_indices",
              "check_decode_multi_indices", "check_decode_multi_arguments",
              "check_prologue_arguments", "check_conv_decode", "check_conv_checkpoint",
              "check_fused_decode_arguments", "check_state_structure", "check_state_arguments",
              "check_chunk_operands", "check_scale", "check_cu_seqlens")


def count_host_rules(monkeypatch) -> collections.Counter:
    """Count the host-rule calls the op module and the entry points' modules make."""
    import kda_engram.ops.kda as ops_kda

    calls = collections.Counter()

    def counted(name, real):
        def rule(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        return rule

    for mod in (ops_kda, decode_mod, prologue_mod, conv_mod, fused_mod, prefill_mod, chunk_mod):
        for name in HOST_RULES:
            if hasattr(mod, name):
                monkeypatch.setattr(mod, name, counted(name, getattr(mod, name)))
    return calls


@pytest.mark.parametrize("name", sorted(OP_CASES))
def test_each_host_rule_runs_once(name, monkeypatch):
    """Issue 45: ``check_inputs=False`` runs the entry point's host rules once, in the
    wrapper; the op's body (the entry point's launch without rules, what
    ``.unchecked`` calls) runs none; the default call is the entry point, which runs
    its rules itself, once each."""
    make, rules = OP_CASES[name]
    fn = getattr(ops, name)
    args, kwargs = make()
    calls = count_host_rules(monkeypatch)
    fn(*args, **kwargs, check_inputs=False)
    assert calls == collections.Counter(rules)
    calls.clear()
    fn.unchecked(*args, **kwargs)
    assert not calls
    fn(*args, **kwargs)
    # The entry point queues its index rules through their guarded form (kda_decode:
    # guard_decode_indices runs check_decode_indices inside validation).
    assert rules - {"check_decode_indices"} <= set(calls) and max(calls.values()) == 1, calls


def test_converted_ops_take_their_entry_points_options():
    """The input forms, the initial rows and ``out_dtype`` cross the ops (the
    schema comes from the entry points' signatures): the op path gives the entry
    point's outputs and caches; its host rules refuse what the entry point refuses."""
    from ..helpers import refused

    # decode_multi: a precomputed log decay, q / k normalised and beta given by the caller
    q, k, v, g, b, _, _ = kda_raw(2, "cpu", seed=40)
    rows, cache0 = idx([[0, 1]], "cpu"), rnd(3, H, K, K, seed=41, scale=0.3)
    forms = dict(gate="log_decay", qk_l2norm=False, beta_sigmoid=False)
    c1, c2 = cache0.clone(), cache0.clone()
    o1 = decode_multi_direct(q, k, v, -g.abs(), b.sigmoid(), None, None, c1, rows, **forms)
    o2 = ops.kda_decode_multi(q, k, v, -g.abs(), b.sigmoid(), None, None, c2, rows, **forms, check_inputs=False)
    assert torch.equal(o1, o2) and torch.equal(c1, c2)
    with pytest.raises(ValueError, match="gate: expected one of"):
        ops.kda_decode_multi(q, k, v, g, b, None, None, c2, rows, gate="bogus", check_inputs=False)
    # the prologue without the norms and the beta sigmoid
    args, _ = prologue_args()
    forms = dict(qk_l2norm=False, beta_sigmoid=False)
    d1, d2 = prologue_direct(*args, **forms), ops.kda_prefill_prologue(*args, **forms, check_inputs=False)
    assert list(d2) == ["qg", "w", "u", "kg_t", "aqk", "decay"]
    assert all(torch.equal(d1[n], d2[n]) for n in d1)
    assert not torch.equal(d2["w"], ops.kda_prefill_prologue(*args, check_inputs=False)["w"])
    # the layer step: S tokens from other initial rows, a new out of out_dtype
    x, g, b, g_out, w, conv, conv_idx, A, dt, norm_w, cache, state_idx = layer_step_args("cpu", S=2)
    kw = dict(initial_state_indices=idx([2, -1], "cpu"), initial_conv_indices=idx([0, 4], "cpu"),
              out_dtype=torch.float16)
    c1, c2, s1, s2 = conv.clone(), conv.clone(), cache.clone(), cache.clone()
    o1 = layer_step_direct(x, g, b, g_out, w, c1, conv_idx, A, dt, norm_w, s1, state_idx, **kw)
    o2 = ops.kda_layer_decode_step(x, g, b, g_out, w, c2, conv_idx, A, dt, norm_w, s2, state_idx, **kw,
                                   check_inputs=False)
    assert o2.dtype == torch.float16 and torch.equal(o1, o2) and torch.equal(c1, c2) and torch.equal(s1, s2)
    with pytest.raises(TypeError, match="out_dtype: expected None or one of"):
        ops.kda_layer_decode_step(x, g, b, g_out, w, c2, conv_idx, A, dt, norm_w, s2, state_idx,
                                  out_dtype=torch.int32, check_inputs=False)
    with refused(TypeError, match="out_dtype: expected None or one of"):
        ops.kda_conv_decode(*conv_decode_args()[0], out_dtype=torch.int32)
    # the checkpoint copy gives conv_state back on both paths, as its entry point does
    args, _ = conv_checkpoint_args()
    assert ops.kda_conv_checkpoint(*args) is args[4]
    assert ops.kda_conv_checkpoint(*args, check_inputs=False) is args[4]


def test_prefill_options_cross_the_op():
    """``groups``, ``final_state_dtype``, the input forms and ``path`` reach the
    kernels through the op: the results equal the entry point's."""
    q, k, v, g, b, A, dt = kda_raw(130, "cpu", seed=30)
    cu = idx([0, 130], "cpu")
    kw = dict(cu_seqlens=cu, output_final_state=True, final_state_dtype=torch.bfloat16, groups=2, path="portable")
    o1, f1 = prefill_direct(q, k, v, g, b, A, dt, **kw)
    o2, f2 = ops.chunk_kda_prefill(q, k, v, g, b, A, dt, **kw)
    assert f2.dtype == torch.bfloat16 and torch.equal(o1, o2) and torch.equal(f1, f2)
    log_decay = -torch.rand(1, 130, H, K, generator=torch.Generator().manual_seed(3))
    kw = dict(cu_seqlens=cu, output_final_state=True, gate="log_decay", beta_sigmoid=False)
    o1, f1 = prefill_direct(q, k, v, log_decay, b.sigmoid(), None, None, **kw)
    o2, f2 = ops.chunk_kda_prefill(q, k, v, log_decay, b.sigmoid(), None, None, **kw)
    assert torch.equal(o1, o2) and torch.equal(f1, f2)
    with pytest.raises(ValueError, match="gate: expected one of"):
        ops.chunk_kda_prefill(q, k, v, g, b, A, dt, cu_seqlens=cu, gate="bogus")


def test_state_structure_runs_once_per_prefill(monkeypatch):
    """One prefill, through the op (checked or not) or the function, checks the
    state's argument combinations once: the rules run at entry, the op's eager body
    and the paths run none (issue 45: no ``host_checked`` flag)."""
    import kda_engram.kda.chunk as chunk_mod
    import kda_engram.kda.prefill as prefill_mod

    calls = []
    real = chunk_mod.check_state_structure

    def counting(*args):
        calls.append(args)
        return real(*args)

    for mod in (prefill_mod, chunk_mod):
        monkeypatch.setattr(mod, "check_state_structure", counting)
    q, k, v, g, b, A, dt = kda_raw(64, "cpu")
    for run in (lambda **kw: ops.chunk_kda_prefill(q, k, v, g, b, A, dt, **kw),
                lambda **kw: prefill_direct(q, k, v, g, b, A, dt, **kw)):
        for check in (True, False):
            calls.clear()
            run(cu_seqlens=idx([0, 64], "cpu"), output_final_state=True, check_inputs=check)
            assert len(calls) == 1, check
    operands = ops.kda_prefill_prologue(q, k, v, g, b, A, dt, K**-0.5, None, idx([0, 64], "cpu"))
    operands = [operands[n] for n in ("qg", "w", "u", "kg_t", "aqk", "decay")]
    for check in (True, False):
        calls.clear()
        ops.kda_prefill_walk(*operands, K**-0.5, idx([0, 64], "cpu"), None, True, check_inputs=check)
        assert len(calls) == 1, check


def test_ops_run_the_functions_device_rules_by_default():
    """Issue 46: ``ops.kda_decode`` wrote an out-of-range row (outside the tensor that
    was passed, into its base) with no error. The ops follow the functions' policy:
    by default the device rules run on guarded launches and the verdict is deferred;
    ``"sync"`` raises in the call; ``False`` (a captured engine) runs host rules only."""
    from kda_engram import raise_pending_errors

    from ..helpers import refused

    q, k, v, g, b, A, dt = (x[0, :2] if x.dim() > 1 else x for x in kda_raw(2, "cpu"))
    big = torch.zeros(8, H, K, K)
    before = big.clone()
    with refused(ValueError, match="state_indices") as info:
        ops.kda_decode(q, k, v, g, b, A, dt, big[:4], idx([0, 5], "cpu"), lower_bound=-5.0)
    assert "\n" not in str(info.value) and str(info.value).startswith("state_indices")
    assert torch.equal(big, before)
    with pytest.raises(ValueError, match="state_indices"):
        ops.kda_decode(q, k, v, g, b, A, dt, big[:4], idx([0, 5], "cpu"), lower_bound=-5.0, check_inputs="sync")
    assert torch.equal(big, before)
    with pytest.raises(TypeError, match="check_inputs"):
        ops.kda_decode(q, k, v, g, b, A, dt, big[:4], idx([0, 1], "cpu"), check_inputs="yes")
    # A duplicate row through the prefill op, and its walk's state rows.
    qp, kp, vp, gp, bp, Ap, dtp = kda_raw(70, "cpu", seed=3)
    cache = torch.zeros(4, H, K, K)
    with refused(ValueError, match="state_indices"):
        ops.chunk_kda_prefill(qp, kp, vp, gp, bp, Ap, dtp, cu_seqlens=idx([0, 64, 70], "cpu"), state_cache=cache,
                              state_indices=idx([1, 1], "cpu"), has_initial_state=torch.tensor([False, False]))
    assert torch.equal(cache, torch.zeros_like(cache))
    raise_pending_errors()


@pytest.mark.parametrize("how", ["check_inputs=False", "unchecked"])
def test_an_op_crossed_without_checks_raises_an_earlier_broken_verdict_first(how):
    """The op's body raises the pending verdict of an earlier checked call before it
    runs (as every entry point does), so crossing the op with ``check_inputs=False``
    or ``.unchecked`` does not let an earlier call's broken rule pass unsaid, and the
    crossing call writes nothing when it raises."""
    from kda_engram import raise_pending_errors

    q, k, v, g, b, A, dt = (x[0, :2] if x.dim() > 1 else x for x in kda_raw(2, "cpu"))
    raise_pending_errors()
    big = torch.zeros(8, H, K, K)
    ops.kda_decode(q, k, v, g, b, A, dt, big[:4], idx([0, 5], "cpu"), lower_bound=-5.0)  # broken: deferred
    good = torch.zeros(4, H, K, K)
    call = ops.kda_decode.unchecked if how == "unchecked" else ops.kda_decode
    kw = {} if how == "unchecked" else {"check_inputs": False}
    with pytest.raises(ValueError, match="state_indices"):
        call(q, k, v, g, b, A, dt, good, idx([0, 1], "cpu"), lower_bound=-5.0, **kw)
    assert torch.equal(good, torch.zeros_like(good))
    raise_pending_errors()  # nothing left

"""What every op module shares: the namespace, the object handles, and the two
ways an op is registered from one definition (:func:`kernel_op`,
:class:`EntryOp`)."""

from __future__ import annotations

import inspect
import itertools
import types
import weakref

import torch

from ..engram.layout import EngramLayout
from ..engram.table import EngramTable
from ..validation.entry import check_mode

Tensor = torch.Tensor
NAMESPACE = "kda_engram"

__all__ = ["NAMESPACE", "EntryOp", "entry_checks", "handle", "kernel_op", "opt_float", "resolve"]

# --------------------------------------------------------------------- object handles

_counter = itertools.count(1)
_handle_of: "weakref.WeakKeyDictionary[object, int]" = weakref.WeakKeyDictionary()
_object_of: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()


def handle(obj) -> int:
    """A stable integer handle for ``obj`` (an ``EngramLayout`` or ``EngramTable``),
    valid while ``obj`` lives; the registry holds it weakly. An ``int`` is returned
    as it is (already a handle). Layers take their handles at construction: the
    registry lookup is plain Python that ``torch.compile`` need not trace."""
    if isinstance(obj, int):
        return obj
    if not isinstance(obj, (EngramLayout, EngramTable)):
        raise TypeError(f"obj: expected an EngramLayout or EngramTable, got {type(obj).__name__}")
    h = _handle_of.get(obj)
    if h is None:
        h = next(_counter)
        _handle_of[obj] = h
        _object_of[h] = obj
    return h


def resolve(h: int, kind: type):
    """The object behind handle ``h``; ``ValueError`` when it is gone or of another kind."""
    obj = _object_of.get(int(h))
    if obj is None or not isinstance(obj, kind):
        raise ValueError(f"handle {h}: no live {kind.__name__} is registered under it (see kda_engram.ops.handle)")
    return obj


def opt_float(x):
    """A Python float (or None) for a ``float?`` schema argument."""
    return None if x is None else float(x)


def entry_checks(check_inputs) -> bool:
    """Whether an op's Python wrapper hands the call to its entry point with
    ``check_inputs`` (the functions' policy: every host rule, the device rules
    queued, guarded launches, the deferred or ``"sync"`` verdict) instead of
    crossing the op: yes when ``check_inputs`` is ``True`` or ``"sync"`` and
    ``torch.compile`` is not tracing. While it traces (no read-back there), and with
    ``check_inputs=False`` (what a CUDA-graph-captured or compiled engine passes),
    the wrapper runs the host rules (no device read) and calls the custom op,
    whose eager implementation checks nothing."""
    check_mode(check_inputs)  # True, False or "sync"; anything else is a TypeError
    return check_inputs is not False and not torch.compiler.is_compiling()


# ------------------------------------------------------------------- registration


def kernel_op(name: str, *, mutates_args, fake):
    """Register the decorated function as the custom op ``kda_engram::name``: its
    annotations are the schema, its body the eager implementation. ``fake`` gives
    the outputs from the arguments alone; it takes one namespace of the op's
    arguments by name (``a.q``, ``a.state_cache``), so the argument list is written
    once, on the op."""

    def register(fn):
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", fn, mutates_args=mutates_args)
        sig = inspect.signature(fn)

        def fake_impl(*args, **kwargs):
            return fake(types.SimpleNamespace(**sig.bind(*args, **kwargs).arguments))

        op.register_fake(fake_impl)
        return op

    return register


#: Schema types of the annotations an entry point may use on an argument that crosses.
_SCHEMA_TYPES = {
    "torch.Tensor": "Tensor",
    "float": "float",
    "int": "int",
    "bool": "bool",
    "str": "str",
    "torch.dtype": "ScalarType",
}


def _schema_type(annotation, name: str, alias: str | None) -> str:
    if not isinstance(annotation, str):
        annotation = inspect.formatannotation(annotation)
    parts = [p.strip() for p in annotation.split("|")]
    optional = "None" in parts
    parts = [p for p in parts if p != "None"]
    if len(parts) != 1 or parts[0] not in _SCHEMA_TYPES:
        raise TypeError(f"{name}: annotation {annotation!r} has no custom-op schema type")
    base = _SCHEMA_TYPES[parts[0]]
    if alias is not None:
        base = f"{base}({alias}!)"
    return base + ("?" if optional else "")


class EntryOp:
    """A custom op made from a kernel entry point's own signature, so that the
    argument list exists once: on the entry point.

    * the schema is the entry point's parameters minus ``host_only`` (arguments
      that do not cross the op), typed from their annotations; ``mutates_args``
      are the caches it writes in place;
    * ``impl(a)`` (the eager implementation: it calls the entry point with
      ``check_inputs=False``) and ``fake(a)`` take one namespace of the arguments
      by name (``a.q``, ``a.state_cache``);
    * :attr:`signature` is the entry point's signature without ``host_only``: the
      public Python wrapper's, with the same names, order and defaults
      (:meth:`bind` fills the defaults and refuses an unknown name)."""

    def __init__(self, name: str, entry, *, host_only: tuple[str, ...], mutates_args: tuple[str, ...],
                 returns: str, impl, fake):
        sig = inspect.signature(entry)
        unknown = set(host_only) - set(sig.parameters)
        if unknown:
            raise ValueError(f"host_only: {sorted(unknown)} are not parameters of {entry.__name__}")
        params = [p for n, p in sig.parameters.items() if n not in host_only]
        self.signature = sig.replace(parameters=params)
        self.names = tuple(p.name for p in params)
        self.defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        self.positional = tuple(p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)
        aliases = iter("abcdefgh")
        fields = [f"{_schema_type(p.annotation, p.name, next(aliases) if p.name in mutates_args else None)} {p.name}"
                  for p in params]
        self.schema = f"({', '.join(fields)}) -> {returns}"
        names = self.names

        def eager_impl(*args):
            return impl(types.SimpleNamespace(**dict(zip(names, args))))

        def fake_impl(*args):
            return fake(types.SimpleNamespace(**dict(zip(names, args))))

        self.op = torch.library.custom_op(f"{NAMESPACE}::{name}", eager_impl, mutates_args=mutates_args,
                                          schema=self.schema)
        self.op.register_fake(fake_impl)

    def bind(self, args: tuple, kwargs: dict) -> dict:
        """The call's arguments by name, in the op's order, defaults filled in
        (plain dict work: ``torch.compile`` traces it)."""
        if len(args) > len(self.positional):
            raise TypeError(f"expected at most {len(self.positional)} positional arguments, got {len(args)}")
        call = dict(zip(self.positional, args))
        for name, value in kwargs.items():
            if name not in self.names:
                raise TypeError(f"unexpected keyword argument {name!r}")
            if name in call:
                raise TypeError(f"got multiple values for argument {name!r}")
            call[name] = value
        missing = [n for n in self.names if n not in call and n not in self.defaults]
        if missing:
            raise TypeError(f"missing required arguments: {', '.join(missing)}")
        return {n: call[n] if n in call else self.defaults[n] for n in self.names}

    def __call__(self, call: dict):
        """Run the op on a :meth:`bind` result."""
        return self.op(*(call[n] for n in self.names))

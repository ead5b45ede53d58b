"""What every op module shares: the namespace, the object handles, and the one way an
op is registered: :class:`EntryOp`, from its entry point's definition."""

from __future__ import annotations

import inspect
import itertools
import types
import weakref

import torch

from ..validation.entry import check_mode, settle_pending

Tensor = torch.Tensor
NAMESPACE = "kda_engram"

__all__ = ["NAMESPACE", "EntryOp", "entry_checks", "handle", "opt_float", "resolve"]

# --------------------------------------------------------------------- object handles

_counter = itertools.count(1)
_handle_of: "weakref.WeakKeyDictionary[object, int]" = weakref.WeakKeyDictionary()
_object_of: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
#: The classes some op takes as a handle (:class:`EntryOp`'s ``handles``), in the
#: order the op modules define them.
_handle_kinds: list[type] = []


def handle(obj) -> int:
    """A stable integer handle for ``obj`` (an object of a class some op takes as a
    handle: the Engram ops' ``EngramLayout`` and ``EngramTable``), valid while ``obj``
    lives; the registry holds it weakly. An ``int`` is returned as it is (already a
    handle). Layers take their handles at construction: the registry lookup is plain
    Python that ``torch.compile`` need not trace."""
    if isinstance(obj, int):
        return obj
    if not isinstance(obj, tuple(_handle_kinds)):
        kinds = " or ".join(k.__name__ for k in _handle_kinds)
        raise TypeError(f"obj: expected an {kinds}, got {type(obj).__name__}")
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
    """One custom op and its public Python wrapper, made from a kernel entry point's
    own signature, so that the argument list exists once: on the entry point.

    * the schema is the entry point's parameters minus ``check_inputs`` and
      ``host_only`` (arguments that do not cross the op; a dict gives, for those the
      entry point requires, the value from the call's arguments, ``{"out": alloc}``,
      and ``None`` for those left at the entry point's default), typed from their
      annotations; ``handles`` names the arguments that cross as an integer
      :func:`handle` (``{"layout": EngramLayout}``); ``mutates_args`` are the caches
      the op writes in place;
    * ``rules(a)`` are the entry point's host rules (shapes, dtypes, devices,
      combinations: no device read), the same validation functions the entry point
      runs, on the call's arguments by name (a dict it may normalise, e.g. a scalar
      to ``float``); ``prepare(a)`` puts the arguments in the form the op takes,
      on every crossing (``.unchecked`` included: e.g. a checkpoint buffer that is
      the state cache crosses as ``None``, since an op cannot take one buffer as two
      mutated arguments); ``run(a)`` is the eager implementation, the entry point's launch
      without any rule (the wrapper has run them, once); ``fake(a)`` gives the
      outputs from the arguments alone; ``run`` and ``fake`` take one namespace of
      the arguments by name (``a.q``, ``a.state_cache``, handles resolved for
      ``run``); ``result(a, value)`` turns the op's value into the entry point's
      (default: as it is). Eagerly the wrapper calls ``run`` itself (the op's body,
      without the dispatcher); while ``torch.compile`` traces it calls the op.

    :attr:`function` is the public wrapper, with the entry point's signature (less
    ``host_only``) and the keyword ``check_inputs``:

    * ``check_inputs=True`` or ``"sync"`` (and not while ``torch.compile`` traces):
      the entry point itself, with every rule, guarded launches and the deferred
      verdict (:func:`entry_checks`);
    * ``False`` (a CUDA-graph-captured or compiled engine), or while ``torch.compile``
      traces: ``rules`` then the op;
    * ``function.unchecked(...)``: the op alone, for a caller that has run the same
      rules itself (the layers check a whole step once);
    * the op's body raises an earlier call's pending broken verdict first
      (:func:`~kda_engram.validation.entry.settle_pending`), as every entry point
      does, also where a compiled graph runs it;
    * ``function.op`` is the custom op, ``function.bind(args, kwargs)`` the call's
      arguments by name in the op's order."""

    def __init__(self, name: str, entry, *, run, rules, fake, returns: str, mutates_args: tuple[str, ...] = (),
                 host_only: tuple[str, ...] | dict = (), handles: dict | None = None, result=None,
                 prepare=None, doc: str | None = None):
        sig = inspect.signature(entry)
        self.host_values = dict(host_only) if isinstance(host_only, dict) else {}
        host_only = (*host_only, "check_inputs")
        unknown = set(host_only) - set(sig.parameters)
        if unknown:
            raise ValueError(f"host_only: {sorted(unknown)} are not parameters of {entry.__name__}")
        self.handles = dict(handles or {})
        _handle_kinds.extend(k for k in dict.fromkeys(self.handles.values()) if k not in _handle_kinds)
        params = [p for n, p in sig.parameters.items() if n not in host_only]
        self.signature = sig.replace(parameters=params)
        self.names = tuple(p.name for p in params)
        self._handle_positions = tuple((i, n) for i, n in enumerate(self.names) if n in self.handles)
        self.defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        self.positional = tuple(p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)
        aliases = iter("abcdefgh")
        fields = []
        for p in params:
            alias = next(aliases) if p.name in mutates_args else None
            kind = "int" if p.name in self.handles else p.annotation
            fields.append(f"{_schema_type(kind, p.name, alias)} {p.name}")
        self.schema = f"({', '.join(fields)}) -> {returns}"
        self.entry, self.rules = entry, rules
        self.result, self.prepare, self.run = result, prepare, run
        names, kinds = self.names, self.handles

        def eager_impl(*args):
            settle_pending()  # an earlier call's broken verdict first, as every entry point does
            a = dict(zip(names, args))
            for n, cls in kinds.items():
                a[n] = resolve(a[n], cls)
            return run(types.SimpleNamespace(**a))

        def fake_impl(*args):
            return fake(types.SimpleNamespace(**dict(zip(names, args))))

        self.op = torch.library.custom_op(f"{NAMESPACE}::{name}", eager_impl, mutates_args=mutates_args,
                                          schema=self.schema)
        self.op.register_fake(fake_impl)
        self.function = self._wrapper(name, doc or "")

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
        bound, missing, defaults = {}, [], self.defaults
        for n in self.names:  # loops, not comprehensions: no call per step on the serving path
            if n in call:
                bound[n] = call[n]
            elif n in defaults:
                bound[n] = defaults[n]
            else:
                missing.append(n)
        if missing:
            raise TypeError(f"missing required arguments: {', '.join(missing)}")
        return bound

    def cross(self, a: dict):
        """Run the op on a :meth:`bind` result (objects become their handles) and
        give the entry point's kind of value."""
        if self.prepare is not None:
            self.prepare(a)
        if torch.compiler.is_compiling():
            args = []
            for n in self.names:
                args.append(a[n])
            for i, n in self._handle_positions:
                args[i] = handle(args[i])
            value = self.op(*args)
        else:
            # Eager: the op's body without the dispatcher (the same body as the op's
            # eager kernel; a few microseconds and two Python frames less a launch).
            settle_pending()
            for n, cls in self.handles.items():
                v = a[n]
                if not isinstance(v, cls):  # a handle (an int), or handle()'s TypeError
                    a[n] = resolve(v if isinstance(v, int) else handle(v), cls)
            value = self.run(types.SimpleNamespace(**a))
        return value if self.result is None else self.result(a, value)

    def _wrapper(self, name: str, doc: str):
        entry, rules, kinds, host_values = self.entry, self.rules, self.handles, self.host_values

        def function(*args, check_inputs=True, **kwargs):
            a = self.bind(args, kwargs)
            if entry_checks(check_inputs):
                for n, cls in kinds.items():
                    a[n] = _as_object(n, a[n], cls)
                given = {n: value(a) for n, value in host_values.items() if value is not None}
                return entry(**a, **given, check_inputs=check_inputs)
            rules(a)
            return self.cross(a)

        def unchecked(*args, **kwargs):
            return self.cross(self.bind(args, kwargs))

        extra = inspect.Parameter("check_inputs", inspect.Parameter.KEYWORD_ONLY, default=True)
        function.__signature__ = self.signature.replace(parameters=[*self.signature.parameters.values(), extra])
        function.__name__ = function.__qualname__ = name
        function.__doc__ = doc
        function.__wrapped_entry__ = entry
        function.op, function.bind, function.unchecked = self.op, self.bind, unchecked
        unchecked.__signature__ = self.signature
        unchecked.__name__ = unchecked.__qualname__ = f"{name}.unchecked"
        return function


def _as_object(name: str, value, cls):
    """A handle argument as its object (the entry points take the object)."""
    obj = resolve(value, cls) if isinstance(value, int) else value
    if not isinstance(obj, cls):
        raise TypeError(f"{name}: expected an {cls.__name__} or its handle, got {type(value).__name__}")
    return obj

"""The user-facing tools on top of the package: the ``kda-engram`` command line
(:mod:`.cli`) and what it runs -- :mod:`.demo`, :mod:`.check`, :mod:`.bench` and
the benchmark scripts in :mod:`.benchmarks` -- with :mod:`.reporting`, their
shared device pick and check printing.

Nothing below this room imports from it: the kernels, ops and layers work without
the tools.
"""

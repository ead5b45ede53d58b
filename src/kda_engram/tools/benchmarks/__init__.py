"""The benchmark scripts, shipped with the package so an installed copy can time itself.

Each ``bench_*`` / ``sweep_*`` module is a script with its own flags: ``python -m
kda_engram.tools.benchmarks.bench_kda_prefill --quick --json rows.json``. The
single-GPU ``bench_*`` modules also expose ``run(cases=None, peers=True,
quick=False)``, which ``kda-engram bench`` runs and prints as one table. Peers
(fla-core, FlashKDA, cuDNN frontend) are optional imports: a missing one is
reported and skipped.
"""

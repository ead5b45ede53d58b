"""Adapters that put the KDA kernels under the calls other projects already make.

* :mod:`kda_engram.integrations.fla`: importing it registers kda-engram as a backend
  of fla-core's registry for ``chunk_kda`` and ``fused_recurrent_kda`` (needs the
  ``fla`` extra: ``pip install kda-engram[fla]``).
* :mod:`kda_engram.integrations.vllm`: plain functions with the call shapes of
  vLLM's KDA ops (``chunk_kda_with_fused_gate``, ``fused_recurrent_kda``,
  ``fused_kda_gate``); no vLLM import.

Importing this package imports neither.
"""

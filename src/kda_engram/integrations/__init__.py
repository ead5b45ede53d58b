"""Adapters that put the KDA kernels under the calls other projects already make.

* :mod:`kda_engram.integrations.fla`: importing it registers kda-engram as a backend
  of fla-core's registry for ``chunk_kda`` and ``fused_recurrent_kda`` (needs the
  ``fla`` extra: ``pip install kda-engram[fla]``).
* :mod:`kda_engram.integrations.vllm`: plain functions with the call shapes of
  vLLM's KDA ops (``chunk_kda_with_fused_gate``, ``fused_recurrent_kda``,
  ``fused_kda_gate``); no vLLM import.
* :mod:`kda_engram.integrations.vllm_kimi_k3`: vLLM 0.33's Kimi-K3 kernel calls
  (``chunk_kda_prefill``, ``fused_recurrent_kda_packed_decode``) with vLLM's exact
  contracts; no vLLM import.
* :mod:`kda_engram.integrations.vllm_deepseek_v41`: the launches of vLLM 0.33's
  DeepSeek-V4.1 Engram gate and hash kernels, on the fused gate and the n-gram hash;
  no vLLM import. Its hash builds each token's rows with
  :mod:`kda_engram.integrations.vllm_engram_history` (one launch).
* :mod:`kda_engram.integrations.vllm_plugin`: the ``vllm.general_plugins`` entry
  point that puts those under vLLM 0.33's names when ``KDA_ENGRAM_VLLM=1``.

Importing this package imports none of them.
"""

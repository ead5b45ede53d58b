"""Old module path of the Engram memory references, kept only for demo.py until
the tools move into kda_engram/tools: the references are
:mod:`kda_engram.engram.reference` (``naive_*``). Remove this module then."""

from .reference import naive_next_history as next_history_ref  # noqa: F401
from .reference import naive_ngram_hash as ngram_hash_ref  # noqa: F401

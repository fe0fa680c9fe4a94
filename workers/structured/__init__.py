"""Structured outputs: grammars that constrain generation, exact under speculative decoding.

``spec.py`` (``GrammarSpec``: what a request asks for; plain data, imported by the HTTP ingress),
``errors.py`` (``GrammarError``), ``compiler.py`` (``GrammarCompiler``: spec -> compiled grammar, an
LRU cache), ``matcher.py`` (``RequestGrammar``: one request's grammar state; the allowed tokens at
every node of a draft tree), ``mask.py`` (bitmask -> bool mask, and masking logits).

This package imports neither torch nor the grammar library here, so ``spec`` stays cheap to import.
"""

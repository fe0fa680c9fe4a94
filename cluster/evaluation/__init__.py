"""Measure speculative decoding on your model and traffic: ``rdserve eval`` and ``rdserve bench``.

Steps (each a module, each runnable alone): ``compatibility``, ``baseline``, ``acceptance``,
``quality``, ``staged_load``; ``loadgen`` sends the traffic, ``metrics`` defines the figures,
``report`` writes Markdown, JSON and PNG plots.
"""

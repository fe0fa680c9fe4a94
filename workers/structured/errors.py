"""``GrammarError``: a grammar that cannot be built, or a token it rejects."""


class GrammarError(ValueError):
    """A structured-output grammar is invalid (bad JSON schema, regex or grammar text), or a token
    was committed that the grammar rejects. Subclasses ``ValueError`` so request validation maps it
    to HTTP 400."""

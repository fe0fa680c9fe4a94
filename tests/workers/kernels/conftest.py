"""The kernel tests use ``isa`` (tests/conftest.py): every kernel build this CPU runs."""

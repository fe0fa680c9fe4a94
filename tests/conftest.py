"""Shared test setup: make helpers in tests/ (e.g. ``tiny_tokenizer``) importable from any test."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

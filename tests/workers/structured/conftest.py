"""Fixtures: the default model's tokenizer (SmolLM2-135M-Instruct) and a grammar compiler for it."""

import pytest

from workers.models.pull import default_model_dir, is_complete


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's tokenizer; skips when the model is not pulled (`rdserve model pull`)."""
    if not is_complete(default_model_dir()):
        pytest.skip("needs the default model pulled (`rdserve model pull`; `make test` pulls it first)")
    from workers.models.tokenizer import load_tokenizer

    return load_tokenizer(default_model_dir())


@pytest.fixture(scope="session")
def compiler(tokenizer):
    """``GrammarCompiler`` for the default model: logits width = its vocabulary (49152), stop = EOS."""
    from workers.structured.compiler import GrammarCompiler

    return GrammarCompiler(tokenizer, len(tokenizer))

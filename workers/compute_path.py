"""The name of the compute path an engine runs on, which its step costs (and so its speculation
schedule) belong to.

Step costs differ by an order of magnitude between paths: a draft-tree row costs about a quarter of
a decode row with int8 activations on AVX512-VNNI, about as much as one on the float32 AVX2 kernel,
and more on torch's GEMM. A schedule measured on one path (``rdserve calibrate``) is only right
for that path, so configs key tables and calibrations by these names (``speculation.by_compute_path``).

Names: ``cuda``, or ``WEIGHTS-ISA[-int8]`` with WEIGHTS ``gguf`` (the GGUF's quantized blocks),
``float32``, ``bfloat16`` or ``float16`` (the model's dtype), ISA ``avx512``, ``avx2`` (rdserve's C kernels, :mod:`workers.kernels.build`) or
``torch`` (torch's GEMM), and ``-int8`` for int8 activations on GGUF blocks; ``gguf-amx-int8`` is
the AVX-512 build whose int8 kernel puts row blocks of 8-10 rows or more on AMX tiles (draft trees
and batches cost less per row there). Examples: ``gguf-amx-int8`` (the default model on a Xeon with
AMX, Sapphire Rapids and later), ``gguf-avx512-int8`` (an AVX512-VNNI server without AMX, or with
``RDSERVE_AMX=0``), ``gguf-avx2-int8`` (most laptops; ``gguf-avx2`` with float32 activations),
``float32-torch``.
"""

from __future__ import annotations

import re

WEIGHTS = ("gguf", "float32", "bfloat16", "float16")
COMPUTE_PATH = re.compile(r"^(cuda|gguf-amx-int8|(gguf|float32|bfloat16|float16)-(avx512|avx2|torch)(-int8)?)$")


def compute_path_name(device: str, weights: str, isa: str | None, int8_activations: bool) -> str:
    """The path's name.

    device: the engine's torch device (``"cpu"``, ``"cuda"``, ``"cuda:1"``...).
    weights: ``"gguf"`` (the linears compute on GGUF blocks), ``"float32"``, ``"bfloat16"`` or ``"float16"``. isa: the C kernels' variant in use
    (``"avx512"``/``"avx2"``; ``"amx"`` for the AVX-512 build with the AMX int8 kernel), None for torch's GEMM. int8_activations: decode rows are quantized
    to int8 (only on GGUF blocks).

    Raises:
        ValueError: int8 activations without GGUF blocks, ``"amx"`` without them, or an unknown
            weights kind or ISA.
    """
    if device.startswith("cuda"):
        return "cuda"
    if weights not in WEIGHTS:
        raise ValueError(f"unknown weights {weights!r}: expected one of {', '.join(WEIGHTS)}")
    if int8_activations and weights != "gguf":
        raise ValueError("int8 activations run on GGUF blocks only")
    if isa not in (None, "avx512", "avx2", "amx"):
        raise ValueError(f"unknown kernel ISA {isa!r}")
    if isa == "amx" and not int8_activations:
        raise ValueError("the amx path is the int8-activation kernel's (AMX tiles); pass int8_activations=True")
    name = f"{weights}-{isa or 'torch'}"
    return name + ("-int8" if int8_activations else "")


def check_compute_path_name(name: str) -> str:
    """``name`` if it is a valid compute-path name.

    Raises:
        ValueError: naming the expected form.
    """
    if not COMPUTE_PATH.match(name):
        raise ValueError(f"{name!r} is not a compute path: expected cuda or WEIGHTS-ISA[-int8] with WEIGHTS "
                         "gguf|float32|bfloat16|float16 and ISA avx512|avx2|torch, or gguf-amx-int8, e.g. gguf-avx512-int8, gguf-avx2, "
                         "float32-torch")
    return name

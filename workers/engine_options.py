"""Engine settings: defined here once; the serving config's ``engine:`` section embeds them.

The defaults here are a library's: exact float32 activations, a fixed thread count. The serving
config changes a few defaults for what a server wants (``cluster.config``: int8 decode activations
on GGUF blocks, adaptive threads); every field, its bounds and its description live here only.
Speculation settings (draft tree, policy, prompt lookup) are :mod:`workers.speculation.options`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class EngineOptions(BaseModel):
    """The engine's model, memory and scheduling settings (TensorRT-LLM option names where they exist)."""

    model_config = ConfigDict(extra="forbid")

    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$", description="cpu | cuda | cuda:N")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    weights: Literal["auto", "gguf", "float32"] = Field(
        "auto", description="'gguf': serve the model's GGUF Q4_1/Q8_0 blocks as shipped (CPU, float32 activations); "
        "'float32': the dequantized weights; 'auto': gguf where the model came from a GGUF file (the default model) "
        "and the engine runs float32 on CPU with tp_size 1, else float32. With gguf the drafter's float32 weights "
        "are served as Q8_0 blocks (workers.models.gguf_weights)")
    prefill_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="prompt (prefill) rows of the GGUF-block linears: 'bfloat16' on oneDNN's AMX GEMM "
        "(weights and activations rounded to bfloat16; decode steps and draft trees stay float32, so spec output "
        "still equals plain), 'float32' the float32 kernels; 'auto': bfloat16 where weights are gguf and the CPU "
        "has AMX bfloat16 tiles (workers.kernels.prefill_bf16)")
    decode_activations: Literal["auto", "float32", "int8"] = Field(
        "float32", description="activations of decode steps and draft-tree rows in the GGUF-block linears: 'int8' "
        "(per 32 values, llama.cpp's Q8_1 activations with integer dot products on AVX512-VNNI or AVX2, the same "
        "results on both; output close to, not equal to, float32's; spec output still equals plain), 'float32' "
        "(bit-identical to the dequantized model); 'auto': int8 where weights are gguf")
    tp_size: int = Field(1, ge=1, description="tensor-parallel ranks per engine (workers.tp, MPI)")
    max_seq_len: int = Field(2048, ge=16, description="context length: prompt + completion tokens; at most the "
                             "model's max_position_embeddings (left unset, 2048 is cut to it)")
    num_threads: int | None = Field(None, ge=1, description="torch intra-op threads (null: torch's default; the "
                                    "serving config shares the cores among replicas)")
    adaptive_threads: bool = Field(False, description="each step runs on the thread count, up to num_threads, that "
                                   "its measured step times favour (workers.thread_policy): when another process "
                                   "takes a core, steps move to fewer threads instead of stalling on the preempted "
                                   "one; outputs are unchanged. CPU engines on rdserve's C kernels, tp_size 1")
    max_batch_size: int = Field(16, ge=1, description="requests decoded together (in-flight batching)")
    max_num_tokens: int = Field(2048, ge=16, description="tokens per iteration: context chunks + draft trees")
    max_prefill_chunk: int | None = Field(512, ge=1, description="context tokens of one request per iteration "
                                          "(chunked prefill); null = the whole prompt")
    tokens_per_block: int = Field(16, ge=1, description="paged KV cache block size (tokens)")
    enable_prefix_caching: bool = Field(True, description="automatic prefix caching (vLLM's name): full KV blocks "
                                        "of prompts stay cached after their request and a new request with the same "
                                        "prefix prefills only the rest (workers.block_manager); a request's "
                                        "cache_salt limits sharing to requests with the same salt")
    num_kv_blocks: int | None = Field(None, ge=1, description="KV cache blocks; null = sized by kv_cache_fraction")
    kv_cache_dtype: Literal["auto", "float32", "float16", "int8"] = Field(
        "auto", description="what the KV cache stores (vLLM's and TensorRT-LLM's kv_cache_dtype): 'auto' the model's "
        "dtype; 'float16' under a float32 model halves the bytes a decoding step reads from the cache (decode "
        "attention reads every request's keys and values once per layer) and doubles the tokens it holds; keys "
        "and values round to the nearest float16 when written, plain and speculative decoding alike. 'int8' "
        "stores each token's key/value head as int8 values and one float32 scale (absmax per row, as llama.cpp's "
        "q8_0 KV cache): 68 bytes a row of 64 values against float16's 128, so 1.88x the tokens fit in the same "
        "memory (where memory, not max_batch_size x max_seq_len, sizes the cache); values are rounded to 1/254 of "
        "their row's largest magnitude (answer perplexity +0.33%, float16 +0.05%), so outputs may differ slightly "
        "from a float cache's (plain and speculative decoding still agree with each other); on the EPYC AVX2 it "
        "decodes no faster than float16 (BENCHMARKS.md 20)")
    kv_cache_fraction: float = Field(0.2, gt=0, le=1, description="share of the memory free after loading the "
                                     "weights that the KV cache takes (capped at what max_batch_size full-length "
                                     "sequences need)")

    @model_validator(mode="after")
    def _gguf_only_settings(self):
        for field, value in (("prefill_dtype", "bfloat16"), ("decode_activations", "int8")):
            if getattr(self, field) == value and (self.weights == "float32" or self.tp_size > 1):
                raise ValueError(f"engine.{field}: {value!r} is for GGUF-block weights (engine.weights gguf/auto, "
                                 "tp_size 1)")
        return self

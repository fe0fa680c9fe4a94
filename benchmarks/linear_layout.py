"""Time ``F.linear`` for the row counts of decoding with row-major vs input-major weights.

Usage: python benchmarks/linear_layout.py  (prints a table, writes benchmarks/results/linear_layout.json)
"""

import argparse
import json
import time
from pathlib import Path

import torch


def median_us(fn, repeats: int = 31) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[repeats // 2] * 1e6


def main() -> None:
    argparse.ArgumentParser(description=__doc__).parse_args()
    shapes = {"qkv 576->960": (960, 576), "gate_up 576->3072": (3072, 576), "lm_head 576->49152": (49152, 576)}
    rows = []
    with torch.inference_mode():
        for name, (out_f, in_f) in shapes.items():
            w = torch.randn(out_f, in_f)
            w_in_major = w.t().contiguous().t()
            for n in (1, 2, 4, 8, 16, 32):
                x = torch.randn(1, n, in_f)
                a = median_us(lambda: torch.nn.functional.linear(x, w))
                b = median_us(lambda: torch.nn.functional.linear(x, w_in_major))
                rows.append({"layer": name, "rows": n, "row_major_us": a, "input_major_us": b})
                print(f"{name:20s} rows={n:3d} row-major {a:9.0f} us  input-major {b:9.0f} us  x{a / b:4.2f}")
    out = Path(__file__).parent / "results" / "linear_layout.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

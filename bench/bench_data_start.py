"""Start-up time and memory of a prompt dataset by size (issue 40: data at any size).

For each size and format it writes a dataset file (``{"prompt", "label", "data_source"}`` rows, a word problem
per row), then in a fresh process per measurement times what a training start does with it on rank 0 --
``build_prompt_stream`` (open the files) and the first step's prompts (``next_prompts(0, 16)``: read, chat
template, tokenise) -- and reads the process's resident memory before and at its peak during that
window (``VmRSS``; ``VmHWM`` after resetting it through ``/proc/self/clear_refs``). "cold" is the first start in a fresh ``train.output_dir`` (a parquet file is copied into a
memory-mapped Arrow file there), "warm" a second start in the same directory. pyarrow is imported
before the "before" reading, so the difference is what the dataset costs. The tokenizer is the test
suite's byte-level BPE with a chat template (``tests/own_data/tiny_hf.py``). Everything else a start does
(model build, servers) does not depend on the dataset.

Usage: python bench/bench_data_start.py [--sizes 1000 100000 1000000] [--formats parquet jsonl]
       [--code DIR]  (another checkout's moe_rl, e.g. the code before lazy loading, for comparison)
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from moe_rl.config import load_config
from moe_rl.data import build_prompt_stream
from tests.own_data.tiny_hf import build_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def write_dataset(path: Path, n: int) -> None:
    prompts = [
        f"Shop {i} sells {i % 97} apples and {i % 89} pears. How many fruits does shop {i} sell?" for i in range(n)
    ]
    labels = [str(i % 97 + i % 89) for i in range(n)]
    if path.suffix == ".parquet":
        pq.write_table(pa.table({"prompt": prompts, "label": labels, "data_source": ["bench"] * n}), path)
        return
    with path.open("w") as fh:
        for p, a in zip(prompts, labels):
            fh.write(json.dumps({"prompt": p, "label": a, "data_source": "bench"}) + "\n")


def _status(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(file: str, out_dir: str) -> None:
    """One start: print ``{"seconds", "rss_before_mb", "rss_peak_mb", "prompts"}``."""

    tokenizer = build_tokenizer()
    cfg = load_config(
        None,
        [
            f"data.train_files=[{file}]",
            "reward.type=math",
            f"train.output_dir={out_dir}",
            "model.seq_length=4096",
            "rollout.max_new_tokens=64",
        ],
    )
    tokenizer.apply_chat_template([{"role": "user", "content": "warm up"}], add_generation_prompt=True, tokenize=True)
    for library in ("pyarrow.ipc", "pyarrow.parquet"):  # their own memory is not the dataset's
        importlib.import_module(library)

    Path("/proc/self/clear_refs").write_text("5")  # VmHWM restarts from here: the peak of this start alone
    before = _status("VmRSS")
    t0 = time.perf_counter()
    stream = build_prompt_stream(cfg, tokenizer, log=None)
    prompts = stream.next_prompts(0, 16)
    seconds = time.perf_counter() - t0
    print(
        json.dumps(
            {"seconds": seconds, "rss_before_mb": before, "rss_peak_mb": _status("VmHWM"), "prompts": len(prompts)}
        )
    )


def measure(file: Path, out_dir: Path, code: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(code), str(ROOT)])}
    proc = subprocess.run(
        [sys.executable, __file__, "--child", str(file), str(out_dir)],
        env=env,
        text=True,
        capture_output=True,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000, 100_000, 1_000_000])
    ap.add_argument("--formats", nargs="+", default=["parquet", "jsonl"], choices=["parquet", "jsonl"])
    ap.add_argument("--code", type=Path, default=ROOT, help="the checkout whose moe_rl is measured")
    ap.add_argument("--child", nargs=2, metavar=("FILE", "OUT_DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    print(f"code: {args.code}; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print("| rows | format | file MB | start | seconds | RSS before MB | RSS peak MB | peak - before MB |")
    print("| ---: | --- | ---: | --- | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        for fmt in args.formats:
            for n in args.sizes:
                file = Path(tmp) / f"rows_{n}.{fmt}"
                write_dataset(file, n)
                out_dir = Path(tmp) / f"run_{n}_{fmt}"
                for start in ("cold", "warm"):
                    r = measure(file, out_dir, args.code)
                    print(
                        f"| {n:,} | {fmt} | {file.stat().st_size / 2**20:.1f} | {start} | {r['seconds']:.2f} | "
                        f"{r['rss_before_mb']:.0f} | {r['rss_peak_mb']:.0f} | "
                        f"{r['rss_peak_mb'] - r['rss_before_mb']:.0f} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()

"""Where recording time goes: py-spy over the SGLang server (and this client) in one mode at a time.

Starts one server exactly as `bench/bench_rollout.py` does (same model, prompts and sampling), warms
both modes up, then for each mode records `--seconds` of py-spy samples of this process and all its
children (the server's tokenizer/HTTP, scheduler and detokenizer processes) while sending batches of
that mode back to back. Writes the raw folded stacks per mode and prints a summary: samples per
process, and the frames with the largest inclusive share in each mode and their difference.

  python bench/profile_rollout.py [--seconds 40] [--out docs/benchmarks/profile] [--dtype float32]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rollout import make_clients

from moe_rl.rollout.launcher import SGLangServer
from moe_rl.rollout.server_spec import ServerSpec

_PROCESS = re.compile(r"^process \d+:\"?([^;]*)")


def record(seconds: float, out: Path, send_batch) -> None:
    """py-spy this process tree for `seconds` while `send_batch()` runs in a loop."""
    pyspy = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy")
    if pyspy is None:
        raise SystemExit("py-spy not found next to this python or on PATH (it ships with the SGLang install)")
    cmd = [
        pyspy,
        "record",
        "--pid",
        str(os.getpid()),
        "--subprocesses",
        "--nonblocking",
        "--rate",
        "100",
        "--duration",
        str(int(seconds)),
        "--format",
        "raw",
        "--output",
        str(out),
    ]
    spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)
    batches = 0
    while spy.poll() is None:
        send_batch()
        batches += 1
    if spy.returncode != 0:
        raise SystemExit(f"py-spy failed: {spy.stderr.read().decode()[-2000:]}")
    print(f"  recorded {seconds:.0f} s over {batches} batches -> {out}")


def role(process_label: str) -> str:
    label = process_label.lower()
    for key, name in (
        ("scheduler", "scheduler"),
        ("detokenizer", "detokenizer"),
        ("launch_server", "http+tokenizer"),
        ("profile_rollout", "client (bench)"),
    ):
        if key in label:
            return name
    return process_label[:40]


def load_folded(path: Path) -> tuple[collections.Counter, collections.Counter, int]:
    """(samples per process role, inclusive samples per (role, frame), total) of a raw py-spy file.

    py-spy only records threads that are running (not idle in select/epoll), so every sample is work.
    """
    per_role, inclusive, total = collections.Counter(), collections.Counter(), 0
    leaf = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = stack.split(";")
        procs = [i for i, f in enumerate(frames) if f.startswith("process ")]
        last = procs[-1] if procs else -1
        m = _PROCESS.match(frames[last]) if procs else None
        who = role(m.group(1)) if m else "?"
        total += n
        per_role[who] += n
        if len(frames) > last + 1:
            leaf[(who, "self: " + re.sub(r":\d+\)$", ")", frames[-1]))] += n
        seen = set()
        for frame in frames[last + 1 :]:
            name = re.sub(r":\d+\)$", ")", frame)  # per function, not per line
            if name not in seen:
                seen.add(name)
                inclusive[(who, name)] += n
    inclusive.update(leaf)
    # drop entry frames (event loops, thread bootstraps): they span nearly all of their process
    roots = {k for k, v in inclusive.items() if not k[1].startswith("self: ") and v >= 0.9 * per_role[k[0]]}
    return per_role, collections.Counter({k: v for k, v in inclusive.items() if k not in roots}), total


def summarize(paths: dict[str, Path], top: int) -> str:
    lines = []
    data = {mode: load_folded(p) for mode, p in paths.items()}
    for mode, (per_role, _, total) in data.items():
        lines.append(f"## {mode}: {total} busy samples (100 Hz, every running thread of every process)")
        for who, n in sorted(per_role.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {who:18s} {n:7d}  {100 * n / total:5.1f}%")
    modes = list(data)
    if len(modes) == 2:
        (a, (_, inc_a, tot_a)), (b, (_, inc_b, tot_b)) = (modes[0], data[modes[0]]), (modes[1], data[modes[1]])
        keys = set(inc_a) | set(inc_b)
        diff = sorted(keys, key=lambda k: -(inc_b[k] / tot_b - inc_a[k] / tot_a))
        lines.append(
            f"## frames whose share grows most from '{a}' to '{b}' (percent of all busy samples; "
            "'self:' = time in that frame itself, else inclusive; entry frames omitted)"
        )
        for who, frame in diff[:top]:
            lines.append(
                f"  {100 * inc_a[(who, frame)] / tot_a:5.1f}% -> {100 * inc_b[(who, frame)] / tot_b:5.1f}%  "
                f"[{who}] {frame}"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=40)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks/profile"))
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, prompts, clients = make_clients(Path(tmp), args.concurrency, args.new_tokens)
        spec = ServerSpec(
            str(model_dir), dtype=args.dtype, deterministic=True, mem_fraction_static=0.3, startup_timeout_s=900
        )
        with SGLangServer(spec, Path(tmp) / "server.log") as server:
            clients = clients(server.url)
            for client in clients.values():
                client.generate(prompts, n=1, step=10_000)
            paths = {}
            for mode, client in clients.items():
                paths[mode] = args.out / f"pyspy_{mode.split()[0].replace('+', '_')}.txt"
                print(f"profiling {mode} ...")
                record(args.seconds, paths[mode], lambda c=client: c.generate(prompts, n=1, step=1))
    summary = summarize(paths, args.top)
    (args.out / "summary.txt").write_text(summary + "\n")
    print(summary)


if __name__ == "__main__":
    main()

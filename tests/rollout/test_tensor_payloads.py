"""The tensor transport's shared-memory bucket: every receiver reads it, and no /dev/shm file is left behind.

The receivers are real processes unpickling with torch's ``ForkingPickler`` (the reducers SGLang's
``MultiprocessingSerializer`` uses) -- stand-ins for servers, which the end-to-end tests run for real
(``test_sglang_sync_and_wire.py``). Each holds what it read until told to let go, as a server does while it loads.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import torch

from moe_rl.sync.senders import SharedBucket

RECEIVER = """
import base64, gc, sys
from multiprocessing.reduction import ForkingPickler
try:
    views = ForkingPickler.loads(base64.b64decode(sys.stdin.readline()))
    print(repr(sum(float(v.double().sum()) for _, v in views)), flush=True)
except Exception as err:
    print(f"error: {err}", flush=True)
    raise SystemExit(0)
sys.stdin.readline()
print(repr(sum(float(v.double().sum()) for _, v in views)), flush=True)
del views
gc.collect()
"""


def _files() -> list[Path]:
    return sorted(Path("/dev/shm").glob(f"torch_{os.getpid()}_*"))


def _bucket() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [(f"w{i}", torch.randn(37 + i, generator=gen)) for i in range(3)]


def _want(bucket) -> str:
    return repr(sum(float(t.double().sum()) for _, t in bucket))


def _receivers(n: int) -> list[subprocess.Popen]:
    return [
        subprocess.Popen([sys.executable, "-c", RECEIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(n)
    ]


def _read(proc: subprocess.Popen, payload: str) -> str:
    proc.stdin.write(payload + "\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


def _let_go(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate("done\n", timeout=60)
    assert proc.returncode == 0
    return out.strip()


def test_three_receivers_each_read_the_bucket_and_nothing_is_left_once_it_is_closed():
    bucket = _bucket()
    procs = _receivers(3)
    shared = SharedBucket(bucket)
    try:
        # One payload read by all three drops torch's count to zero under the second: the third finds no file.
        got = [_read(proc, shared.payload()) for proc in procs]
    finally:
        shared.close()  # the requests are done; the servers still hold what they read
        held = [_let_go(proc) for proc in procs]
    assert got == [_want(bucket)] * 3
    assert held == got, "a receiver's mapping outlives the name"
    gc.collect()
    assert _files() == []


def test_a_payload_nobody_read_leaves_no_file_once_the_bucket_is_closed():
    shared = SharedBucket(_bucket())
    shared.payload()  # the request carrying it failed before the server read it
    assert len(_files()) == 1
    shared.close()
    assert _files() == []


def receivers_let_go_before_the_close() -> None:
    """The sender side of the last test, run in a child process: a second unlink would abort it."""
    bucket = _bucket()
    first, second = _receivers(2)
    shared = SharedBucket(bucket)
    try:
        assert _read(first, shared.payload()) == _want(bucket)
        _let_go(first)  # the first server loaded the bucket and let go of it before the second read it
        assert len(_files()) == 1, "the name must outlive a receiver that let go"
        assert _read(second, shared.payload()) == _want(bucket)
    finally:
        _let_go(second)
        shared.close()  # every reference is back: torch's count reaching zero would unlink a second time
    gc.collect()
    assert _files() == []


def test_receivers_that_let_go_before_the_close_unlink_nothing_early_and_nothing_twice():
    """torch unlinks when a count drop reaches zero; the bucket's pin keeps every drop above it."""
    code = "from tests.rollout.test_tensor_payloads import receivers_let_go_before_the_close as f; f()"
    child = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]

"""An idle SGLang server must not spin: the learner shares the host's cores between rollouts.

Without ``--sleep-on-idle`` SGLang's scheduler busy-polls its sockets: on the 2-core CI machine it
took 65-95% of a core while the co-located learner trained, doubling the learner's step time.
"""

from __future__ import annotations

import time

import httpx
import psutil
import pytest

pytestmark = pytest.mark.sglang


def _tree_cpu_seconds(pid: int) -> float:
    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def test_idle_server_uses_well_under_a_core(sglang_server, device):
    assert "--sleep-on-idle" in psutil.Process(sglang_server.process.pid).cmdline()
    httpx.get(f"{sglang_server.url}/health", timeout=30)  # the server has just answered something
    time.sleep(1.5)  # let any in-flight work finish
    before, t0 = _tree_cpu_seconds(sglang_server.process.pid), time.perf_counter()
    time.sleep(3.0)
    used = (_tree_cpu_seconds(sglang_server.process.pid) - before) / (time.perf_counter() - t0)
    assert used < 0.3, f"the idle server used {used:.2f} cores (a spinning scheduler uses ~1)"

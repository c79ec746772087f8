"""Restarts asked for by two steps' batches in flight at once (the rollout process, ``BatchRestarts``), against
rank 0's real ``ServerPool.restart_since``; the servers are stand-ins (an ``alive`` flag; no process to start)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from moe_rl.rollout.server_pool import ServerPool
from moe_rl.source.rollout_worker import BatchRestarts


def _server(url):
    s = SimpleNamespace(url=url, up=True, process=None, log_path="/dev/null")
    s.alive = lambda: s.up
    s.restart = lambda: setattr(s, "up", True)
    return s


def test_a_batch_whose_server_another_batch_restarted_gets_it_back_and_resyncs():
    """Both steps' requests failed when server A died; step 1's batch asks first and restarts it. Step 2's batch
    must then hear of that restart (it re-syncs and retries) instead of "nothing restarted" (its generation would
    fail the run): each batch counts from the restarts it knew at its start. Seen failing with one count for the
    whole process (the earlier answer moved it past A's restart for both batches)."""
    pool = ServerPool(servers=[_server("http://a"), _server("http://b")], max_restarts=2)
    restarts = BatchRestarts(lambda urls, seen: pool.restart_since(seen, urls))
    both_started, first_done, got = threading.Barrier(2), threading.Event(), {}

    def batch(name, first):
        restarts.start_batch()
        both_started.wait(10)
        if first:
            pool.servers[0].up = False  # server A dies under both batches
            got[name] = restarts()
            first_done.set()
        else:
            assert first_done.wait(10)
            got[name] = restarts()

    threads = [
        threading.Thread(target=batch, args=("step1", True)),
        threading.Thread(target=batch, args=("step2", False)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert got == {"step1": ["http://a"], "step2": ["http://a"]} and pool.restarts == 1, (got, pool.restarted)
    restarts.start_batch()  # a later batch, started after the restart: nothing to hear of, nothing dead
    assert restarts() == [] and pool.restarts == 1

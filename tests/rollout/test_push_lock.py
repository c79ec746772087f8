"""One push at a time, labelled with the version it is (issue 36: pushes could overlap).

With ``rollout.partial: true`` the step's push pauses generation on the servers (here the session's real
SGLang server) and updates; a server restart noticed meanwhile on the producer thread re-syncs. The re-sync
must wait for the push and carry the version the servers then hold. The transfers themselves are a recording
stand-in for ``WeightSync`` (what is tested is their order; the weight paths have their own tests).
"""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

import pytest

from moe_rl.source.producer import AsyncProducer
from moe_rl.train.weight_push import WeightPusher

pytestmark = pytest.mark.sglang


class RecordingSync:
    """``WeightSync``'s surface as ``WeightPusher`` uses it; a push holds its section until ``release``."""

    def __init__(self):
        self.version = "step-1-n"
        self.events: list[tuple] = []
        self.inside, self.release = threading.Event(), threading.Event()

    def sync(self, module, addresses, version, flush_cache=True):
        self.events.append(("push", version))
        if not self.inside.is_set():  # the step's push: held until released
            self.inside.set()
            assert self.release.wait(10)
        self.version = version
        self.events.append(("pushed", version))
        return 0.0

    def close(self):
        self.events.append(("close",))


def test_a_resync_during_a_paused_push_waits_for_it_and_carries_the_pushed_version(sglang_server, tmp_path):
    """The re-sync, asked for on the producer thread, is run by the main thread (where the collectives live) at its
    next wait, after the push, labelled with the version the push left."""
    cfg = SimpleNamespace(rollout=SimpleNamespace(partial=True, pause_mode="retract"))
    producer = AsyncProducer(lambda step, served, drawn: None, 0, 0, 1, served_version=1)  # no batch in flight
    pusher = WeightPusher(cfg, SimpleNamespace(module=None), tmp_path, nonce="n", is_main=True, source=lambda: producer)
    pusher.sync = sync = RecordingSync()
    push = threading.Thread(target=pusher.push, args=([sglang_server.url], 2))
    push.start()
    assert sync.inside.wait(30)  # generation paused on the server, the update under way
    resync = threading.Thread(target=pusher.resync, args=([sglang_server.url], 1))  # the batch's own version: 1
    resync.start()
    resync.join(timeout=0.5)
    assert resync.is_alive(), "the re-sync ran inside the push"
    sync.release.set()
    push.join(timeout=30)
    assert pusher.calls.pending, "the re-sync waits for the main thread"
    pusher.calls.serve()  # what the main thread does at its next wait (Rank0Calls.wait)
    resync.join(timeout=30)
    assert sync.events == [
        ("push", "step-2-n"),
        ("pushed", "step-2-n"),
        ("close",),
        ("push", "step-2-n"),
        ("pushed", "step-2-n"),
    ]


def test_a_server_dead_since_its_last_batch_is_restarted_before_the_pause_and_synced_through_a_new_group(
    tmp_path, monkeypatch
):
    """A partial-rollout push pauses every server first: a dead one must be restarted before (the pause would fail on
    it), then the push opens a new weight-update group (the restarted server lost its own) and loads it too. The pause
    is a recording stand-in here (the real one is exercised above and in the trainer's e2e runs)."""

    events: list[tuple] = []

    @contextlib.contextmanager
    def paused(addresses, mode, keys):
        events.append(("pause",))
        yield SimpleNamespace(flush_cache=True)
        events.append(("continue",))

    monkeypatch.setattr("moe_rl.source.producer.paused_generation", paused)  # where the producer binds it
    cfg = SimpleNamespace(rollout=SimpleNamespace(partial=True, pause_mode="retract"))
    dead = ["http://dead"]

    def revive():
        if dead:
            events.append(("revive",))
        return list(dead)

    producer = AsyncProducer(lambda step, served, drawn: None, 0, 0, 1, served_version=1)
    learner = SimpleNamespace(module=None)
    pusher = WeightPusher(cfg, learner, tmp_path, nonce="n", is_main=True, revive=revive, source=lambda: producer)
    pusher.sync = sync = RecordingSync()
    sync.events, _ = events, sync.inside.set()  # no held push here
    pusher.push(["http://dead"], 2)
    assert events == [("revive",), ("close",), ("pause",), ("push", "step-2-n"), ("pushed", "step-2-n"), ("continue",)]
    events.clear()
    dead.clear()  # nothing dead: no new group
    pusher.push(["http://dead"], 3)
    assert events == [("pause",), ("push", "step-3-n"), ("pushed", "step-3-n"), ("continue",)]

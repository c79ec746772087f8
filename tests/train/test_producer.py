"""The async producer's rules, driven by real threads and a real list-backed prompt stream (no server):
admission by staleness, k = 0 as sync, exclusive sections, failures surfaced, and a kill + resume that
trains every step once and loses no prompt."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from moe_rl.config import load_config
from moe_rl.data.prompt import PromptItem
from moe_rl.reward import Rewarder, Scores
from moe_rl.source.producer import AsyncProducer, InlineBatches, pending_records
from moe_rl.source.step_samples import StepSamples
from moe_rl.train.weight_push import WeightPusher


class ListStream:
    """Prompts 0, 1, 2, …; step ``s`` takes ``1 + s % 3`` of them (as dynamic sampling takes a varying number)."""

    def __init__(self, index: int = 0):
        self.index = index

    def take(self, step: int) -> list[int]:
        n = 1 + step % 3
        out = list(range(self.index, self.index + n))
        self.index += n
        return out

    def state(self) -> dict:
        return {"index": self.index}


class Maker:
    """``make(step, served)``: takes the step's prompts and writes them to ``dir/step_<s>`` (the records)."""

    def __init__(self, directory: Path, stream: ListStream, gate: threading.Event | None = None, gated_step: int = 0):
        self.dir, self.stream, self.gate, self.gated_step = directory, stream, gate, gated_step
        self.calls: list[tuple[int, int]] = []

    def __call__(self, step: int, served: int, drawn=lambda: None) -> Path:
        self.calls.append((step, served))
        prompts = self.stream.take(step)
        if self.gate is not None and step == self.gated_step:  # in flight until the test opens the gate
            assert self.gate.wait(30)
        path = self.dir / f"step_{step:06d}.safetensors"
        path.write_text(",".join(map(str, prompts)))
        return path


def train(producer, steps) -> list[int]:
    """The loop's order: take step s's batch, 'train', push version s + 1. Returns the prompts trained."""
    trained = []
    for s in steps:
        trained += [int(p) for p in producer.batch(s).read_text().split(",")]
        with producer.exclusive():
            producer.weights_pushed(s + 1)
    return trained


@pytest.mark.parametrize("k", [0, 1, 2])
def test_no_batch_is_made_by_weights_more_than_k_versions_old(tmp_path, k):
    maker = Maker(tmp_path, ListStream())
    producer = AsyncProducer(maker, 0, 6, k, served_version=0)
    producer.start()
    try:
        train(producer, range(6))
    finally:
        producer.close()
    assert [s for s, _ in maker.calls] == list(range(6))
    assert all(0 <= step - served <= k for step, served in maker.calls), maker.calls
    if k == 0:  # exactly the sync loop's calls
        sync = Maker(tmp_path / "sync", ListStream())
        (tmp_path / "sync").mkdir()
        inline = InlineBatches(sync, 0)
        train(inline, range(6))
        assert maker.calls == sync.calls == [(s, s) for s in range(6)]


def test_a_push_waits_for_the_batch_in_flight_and_holds_the_next_one_back(tmp_path):
    gate = threading.Event()
    maker = Maker(tmp_path, ListStream(), gate)
    producer = AsyncProducer(maker, 0, 3, 1, served_version=0)
    producer.start()
    try:
        _assert_push_waits_for(producer, gate, "the push went in while step 0's batch was being generated")
    finally:
        producer.close()


def _assert_push_waits_for(producer, gate, what):
    """A push (``exclusive()``, ``rollout.partial: false``) stays out until ``gate`` lets the batch in flight end."""
    entered = threading.Event()

    def push():
        with producer.exclusive():
            entered.set()

    pusher = threading.Thread(target=push)
    pusher.start()
    assert not entered.wait(0.5), what
    gate.set()
    assert entered.wait(30)
    pusher.join()


def test_a_failing_batch_is_raised_in_the_learner_naming_the_step(tmp_path):
    def make(step, served, drawn=None):
        raise ConnectionError("server gone")

    producer = AsyncProducer(make, 0, 2, 1, served_version=0)
    producer.start()
    try:
        with pytest.raises(RuntimeError, match="making step 1's batch: ConnectionError: server gone"):
            producer.batch(0)
    finally:
        producer.close()


def test_a_killed_run_resumed_from_its_checkpoint_trains_every_prompt_once(tmp_path):
    """Checkpoint before step 2 with step 2 finished and step 3 in flight, then a kill: the resumed producer
    trains the finished batch as it was and takes step 3's prompts again from the saved position."""
    run, ckpt = tmp_path / "rollouts", tmp_path / "ckpt_files"
    run.mkdir(), ckpt.mkdir()
    gate = threading.Event()
    stream = ListStream()
    maker = Maker(run, stream, gate, gated_step=3)
    producer = AsyncProducer(maker, 0, 8, 1, served_version=0, stream_state=stream.state)
    producer.start()
    trained = train(producer, range(2))  # pushing version 2 waited for step 2's batch; step 3 is admitted now
    while 3 not in {s for s, _ in maker.calls}:  # step 2 done, step 3 in flight
        threading.Event().wait(0.01)
    extra, files = producer.checkpoint_state(2)
    assert extra["async"]["ready_steps"] == [2] and extra["async"]["unfinished_from"] == 3
    for name, source in files.items():  # what save_checkpoint(files=...) copies
        (ckpt / name).write_bytes(source.read_bytes())
    gate.set()
    producer.close()  # "killed": what it made after the checkpoint is lost with the process
    for f in run.iterdir():
        f.unlink()

    resumed_stream = ListStream(extra["data"]["index"])
    maker2 = Maker(run, resumed_stream)
    meta = {"extra": extra, "files_dir": str(ckpt)}
    producer2 = AsyncProducer(
        maker2, 2, 8, 1, served_version=2, stream_state=resumed_stream.state, pending=pending_records(meta, run)
    )
    producer2.start()
    try:
        trained += train(producer2, range(2, 8))
    finally:
        producer2.close()
    assert [s for s, _ in maker2.calls] == list(range(3, 8)), "step 2 is trained from the checkpoint, not remade"
    assert trained == list(range(len(trained))), "a prompt was lost or trained twice"
    assert len(trained) == sum(1 + s % 3 for s in range(8))


def test_a_checkpoint_listing_records_it_does_not_hold_is_refused(tmp_path):
    meta = {"extra": {"async": {"ready_steps": [4]}}, "files_dir": str(tmp_path / "files")}
    with pytest.raises(FileNotFoundError, match="step 5's finished records"):
        pending_records(meta, tmp_path / "rollouts")


@pytest.mark.parametrize("k", [2, 3])
def test_a_push_publishes_its_version_before_the_producer_may_admit_a_batch(tmp_path, k):
    """Issue 36's version slip, through the trainer's own push (WeightPusher.push): the servers (a stand-in
    holding a version number, no GPU or server needed for the ordering) take the new weights inside the push
    section, and the sync then lingers 2 ms after the section, where the old code published the version. Every
    batch must be made with the version the servers actually serve (it was mislabelled from step 2 on)."""

    servers = {"version": 0}
    made: list[tuple[int, int, int]] = []  # (step, served as the producer saw it, served by the servers)
    maker = Maker(tmp_path, ListStream())

    def make(step, served, drawn=None):
        made.append((step, served, servers["version"]))
        return maker(step, served)

    class ServersSync:  # the WeightSync stand-in: a push sets the servers' version (inside the push section)
        def sync(self, module, addresses, version, flush_cache=True):
            servers["version"] = int(version.split("-")[1])
            time.sleep(0.002)  # the gap where the old code left the section before publishing the version
            return 0.0

    cfg = SimpleNamespace(rollout=SimpleNamespace(partial=False))
    producer = AsyncProducer(make, 0, 8, k, served_version=0)
    pusher = WeightPusher(cfg, SimpleNamespace(module=None), tmp_path, nonce="n", is_main=True, source=lambda: producer)
    pusher.sync = ServersSync()
    producer.start()
    for s in range(8):
        producer.batch(s)
        pusher.push(["http://server"], s + 1)
    producer.close()
    assert [m[0] for m in made] == list(range(8))
    assert [m for m in made if m[1] != m[2]] == []


class StreamingMaker(Maker):
    """A maker that says when its step has its prompts (``drawn``), as the batch maker does, then generates:
    ``slow_step`` waits for ``gate`` after drawing (a slow reply); ``rounds(step)`` draws (dynamic sampling)."""

    def __init__(self, directory, stream, gate=None, slow_step=-1, rounds=lambda step: 1, draws=None):
        super().__init__(directory, stream)
        self.gate, self.slow_step, self.rounds, self.draws = gate, slow_step, rounds, draws
        self.finished: list[int] = []

    def __call__(self, step, served, drawn=lambda: None):
        self.calls.append((step, served))
        prompts = []
        for r in range(self.rounds(step)):
            if r:
                time.sleep(0.05)  # the round's generation and rewards: another step could draw meanwhile
            prompts += self.stream.take(step)
            if self.draws is not None:
                self.draws.append(step)
        drawn()
        if step == self.slow_step:
            assert self.gate.wait(30)
        path = self.dir / f"step_{step:06d}.safetensors"
        path.write_text(",".join(map(str, prompts)))
        self.finished.append(step)
        return path


def _partial_push(producer, version):
    """A ``rollout.partial`` push: the batches in flight are paused on the servers, not waited for."""
    with producer.exclusive(wait_for_batch=False):
        producer.weights_pushed(version)


def _wait_until(cond, what):
    deadline = time.monotonic() + 30
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_slow_reply_delays_only_its_own_step_and_a_kill_then_loses_no_prompt(tmp_path):
    """Step 1's batch has a slow reply; once version 1 is pushed (partial mode) step 2 is made meanwhile. A
    checkpoint then (step 1 unfinished, step 2 finished) keeps neither: the resumed run takes both steps' prompts
    again from before step 1 and trains every prompt once. Seen failing on the one-batch-at-a-time producer
    (step 2 waited for step 1's slow reply)."""
    run, ckpt = tmp_path / "rollouts", tmp_path / "ckpt_files"
    run.mkdir(), ckpt.mkdir()
    gate, stream = threading.Event(), ListStream()
    maker = StreamingMaker(run, stream, gate, slow_step=1)
    producer = AsyncProducer(maker, 0, 6, 1, served_version=0, stream_state=stream.state)
    producer.start()
    trained = [int(p) for p in producer.batch(0).read_text().split(",")]
    _partial_push(producer, 1)  # step 1 is in flight with its slow reply; step 2 is admitted now
    _wait_until(lambda: 2 in maker.finished, "step 2 waited for step 1's slow reply")
    assert 1 not in maker.finished and producer.take_times()["time/rollout_idle_s"] >= 0
    extra, files = producer.checkpoint_state(1)
    assert extra["async"]["ready_steps"] == [] and extra["async"]["unfinished_from"] == 1 and files == {}
    assert extra["data"] == {"index": 1}, "the position before step 1's prompts"
    gate.set()
    producer.close()
    for f in run.iterdir():
        f.unlink()

    resumed = ListStream(extra["data"]["index"])
    maker2 = StreamingMaker(run, resumed)
    producer2 = AsyncProducer(maker2, 1, 6, 1, served_version=1, stream_state=resumed.state)
    producer2.start()
    try:
        for s in range(1, 6):
            trained += [int(p) for p in producer2.batch(s).read_text().split(",")]
            _partial_push(producer2, s + 1)
    finally:
        producer2.close()
    assert [s for s, _ in maker2.calls] == list(range(1, 6))
    assert trained == list(range(len(trained))) and len(trained) == sum(1 + s % 3 for s in range(6))


def test_overlapping_steps_draw_their_prompts_in_step_order(tmp_path):
    """Even steps draw twice (dynamic sampling's second round, after generating the first); with k = 3 and
    partial pushes several steps are in flight, yet every draw of step s comes before any draw of step s + 1, so
    a run's prompts do not depend on timing. Break tried: saying ``drawn`` after the first round fails it."""
    stream, draws = ListStream(), []
    maker = StreamingMaker(tmp_path, stream, rounds=lambda step: 2 if step % 2 == 0 else 1, draws=draws)
    producer = AsyncProducer(maker, 0, 8, 3, served_version=0, stream_state=stream.state)
    producer.start()
    try:
        for s in range(8):
            producer.batch(s)
            _partial_push(producer, s + 1)
    finally:
        producer.close()
    assert draws == sorted(draws) and len(draws) == 12, draws
    assert len({s - v for s, v in maker.calls}) > 1, "no step was made ahead"


def test_a_push_that_waits_for_batches_waits_for_every_step_in_flight(tmp_path):
    """k = 2: steps 0 and 1 start together; a push (``rollout.partial: false``) waits for both, step 1's slow
    reply included, before it goes in."""
    gate, stream = threading.Event(), ListStream()
    maker = StreamingMaker(tmp_path, stream, gate, slow_step=1)
    producer = AsyncProducer(maker, 0, 3, 2, served_version=0, stream_state=stream.state)
    producer.start()
    try:
        producer.batch(0)
        _wait_until(lambda: 1 in {s for s, _ in maker.calls}, "step 1 did not start beside step 0")
        _assert_push_waits_for(producer, gate, "the push went in while step 1's batch was in flight")
    finally:
        producer.close()


def test_a_later_steps_failure_lets_the_step_in_flight_before_it_finish_and_train(tmp_path):
    """Step 1 fails while step 0 (a slow reply) is still in flight: step 0's batch is still handed over (and
    trained), and step 1's failure is raised naming it as the log counts steps, 1-based: step 2."""
    gate, stream = threading.Event(), ListStream()
    maker = StreamingMaker(tmp_path, stream, gate, slow_step=0)

    def make(step, served, drawn=lambda: None):
        if step == 1:
            raise ConnectionError("server gone")
        return maker(step, served, drawn)

    producer = AsyncProducer(make, 0, 3, 1, served_version=0, stream_state=stream.state)
    producer.start()
    try:
        _wait_until(lambda: producer._error is not None, "step 1 never ran beside step 0")
        threading.Timer(0.2, gate.set).start()
        assert producer.batch(0).read_text() == "0"
        with pytest.raises(RuntimeError, match="making step 2's batch: ConnectionError: server gone"):
            producer.batch(1)
    finally:
        gate.set()
        producer.close()


def test_steps_in_flight_score_one_at_a_time(tmp_path):
    """Two steps' batches made at once (two threads, as the producer runs them) never call the reward at the same
    time: the reward pool has one queue of calls and replies. Break tried: without StepSamples' lock it fails."""

    inside, overlaps = [0], []

    class Slow(Rewarder):
        def score(self, prompts, responses):
            inside[0] += 1
            overlaps.append(inside[0])
            time.sleep(0.05)
            inside[0] -= 1
            return Scores([1.0] * len(responses))

    class Rows:
        def next_prompts(self, step, n, round=0):
            return [PromptItem(ids=[1], label="1") for _ in range(n)]

    cfg = load_config(None, ["train.prompts_per_step=2", "rollout.samples_per_prompt=2"])
    samples = StepSamples(cfg, Rows(), Slow())
    generate = lambda prompts, r: [
        SimpleNamespace(response_ids=[5], turn_ids=None, agent_reward=None) for p in prompts for _ in range(2)
    ]
    threads = [threading.Thread(target=samples.make, args=(s, generate)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert overlaps == [1, 1, 1, 1], overlaps

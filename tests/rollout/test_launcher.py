"""Launcher: the server command and environment, and that no server process outlives its owner.

The lifecycle tests start real `sglang.launch_server` processes and stop them during start-up
(SGLang imports take ~20 s here), which exercises teardown without paying for a healthy server.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
import torch.distributed

from moe_rl.config import RolloutConfig, load_config
from moe_rl.learner.hf_init import write_random_hf_checkpoint
from moe_rl.rollout import launcher
from moe_rl.rollout.auth import ServerKeys
from moe_rl.rollout.launcher import ServerStartError, SGLangServer
from moe_rl.rollout.ports import free_port, lost_a_bind
from moe_rl.rollout.server_pool import ServerPool
from moe_rl.rollout.server_spec import STUBS_DIR, ServerSpec, server_command, server_env
from moe_rl.rollout.sglang_entry import _keep_start_method
from moe_rl.rollout.shm import group_shm_files

REPO = Path(__file__).resolve().parents[2]


def _pids_mentioning(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _real_model(path: Path) -> str:
    """A tiny real HF model: a server started on it loads it and serves, so it never ends by itself."""

    write_random_hf_checkpoint(load_config(REPO / "configs" / "tiny_cpu.yaml").model, path, seed=0, dtype="float32")
    return str(path)


def _wait_gone(marker: str, timeout_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := _pids_mentioning(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def test_command_enables_routes_determinism_and_mask_cap_from_config():
    rollout = RolloutConfig(
        deterministic=True, dtype="bfloat16", sampling_mask_max_tokens=77, extra_server_args=["--x"]
    )
    cmd = server_command(ServerSpec.from_rollout_config(rollout, "/m"), port=1234)
    joined = " ".join(cmd)
    for piece in (
        "--enable-return-routed-experts",
        "--enable-deterministic-inference",
        "--sampling-mask-max-tokens 77",
        "--dtype bfloat16",
        "--port 1234",
        "--model-path /m",
        "--device cpu",
    ):
        assert piece in joined, f"{piece!r} missing from {joined}"
    assert cmd[-1] == "--x"
    nondeterministic = server_command(ServerSpec.from_rollout_config(RolloutConfig(deterministic=False), "/m"), 1)
    assert "--enable-deterministic-inference" not in nondeterministic
    assert "--sleep-on-idle" in cmd  # the default: an idle scheduler must not spin a core the learner needs
    spinning = server_command(ServerSpec.from_rollout_config(RolloutConfig(sleep_on_idle=False), "/m"), 1)
    assert "--sleep-on-idle" not in spinning


def test_stand_ins_go_on_the_cpu_server_path_only():
    cpu = server_env(ServerSpec("/m", device="cpu"), base={"PYTHONPATH": "/elsewhere"})
    assert cpu["PYTHONPATH"].split(os.pathsep) == [str(STUBS_DIR), "/elsewhere"]
    assert cpu["SGLANG_USE_CPU_ENGINE"] == "1"
    gpu = server_env(ServerSpec("/m", device="cuda"), base={})
    assert "PYTHONPATH" not in gpu and "SGLANG_USE_CPU_ENGINE" not in gpu
    assert str(STUBS_DIR) not in os.environ.get("PYTHONPATH", "")


def test_cpu_servers_fork_their_children_and_defer_other_model_modules():
    cpu = server_env(ServerSpec("/m", device="cpu"), base={})
    assert cpu["MOE_RL_SGLANG_START_METHOD"] == "fork"
    assert cpu["SGLANG_EXTERNAL_MODEL_PACKAGE"] == "moe_rl.rollout.sglang_models"
    assert (
        server_env(ServerSpec("/m", device="cpu"), base={"MOE_RL_SGLANG_START_METHOD": "spawn"})[
            "MOE_RL_SGLANG_START_METHOD"
        ]
        == "spawn"
    )  # an operator's choice stands
    gpu = server_env(ServerSpec("/m", device="cuda"), base={})  # CUDA cannot be used in a forked child
    assert "MOE_RL_SGLANG_START_METHOD" not in gpu and "SGLANG_EXTERNAL_MODEL_PACKAGE" not in gpu


def test_the_entry_point_makes_sglangs_spawn_request_the_chosen_method():
    real, before = multiprocessing.set_start_method, multiprocessing.get_start_method(allow_none=True)
    try:
        _keep_start_method("fork")
        multiprocessing.set_start_method("spawn", force=True)  # what SGLang's engine calls
        assert multiprocessing.get_start_method() == "fork"
    finally:
        multiprocessing.set_start_method = real
        real(before, force=True)


def test_startup_timeout_raises_with_log_and_leaves_no_process(tmp_path):
    marker = str(tmp_path / "timeout-model")
    server = SGLangServer(ServerSpec(marker, startup_timeout_s=3.0), tmp_path / "server.log")
    with pytest.raises(ServerStartError, match="not healthy within startup_timeout_s=3.0"):
        server.start()
    assert _wait_gone(marker) == [], "server processes outlived a failed start"


def test_sigterm_to_the_launching_process_stops_its_servers(tmp_path):
    marker = str(tmp_path / "sigterm-model")
    script = textwrap.dedent(f"""
        from moe_rl.config import RolloutConfig
        from moe_rl.rollout.server_pool import rollout_servers
        with rollout_servers(RolloutConfig(startup_timeout_s=300), {marker!r}, {str(tmp_path)!r}):
            pass
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=REPO)
    deadline = time.monotonic() + 30
    while not any(p != parent.pid for p in _pids_mentioning(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert any(p != parent.pid for p in _pids_mentioning(marker)), "the server process never appeared"
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=60) == 128 + signal.SIGTERM
    assert _wait_gone(marker) == [], "server processes outlived the SIGTERM'd launcher"


def test_sigkill_of_the_launching_process_still_stops_its_server(tmp_path):
    """No handler runs on SIGKILL. A server started on the main thread gets the kernel's parent-death signal;
    the model is real, so the server would otherwise live on: it must be gone within 10 s."""
    marker = _real_model(tmp_path / "sigkill-model")
    script = textwrap.dedent(f"""
        from pathlib import Path
        from moe_rl.rollout.launcher import SGLangServer
        from moe_rl.rollout.server_spec import ServerSpec
        SGLangServer(ServerSpec({marker!r}, startup_timeout_s=300), Path({str(tmp_path)!r}) / "s.log").start()
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=REPO)
    deadline = time.monotonic() + 30
    while not any(p != parent.pid for p in _pids_mentioning(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    parent.kill()
    parent.wait(timeout=30)
    assert _wait_gone(marker, timeout_s=10) == [], "server processes outlived a SIGKILL'd launcher"


def test_a_server_started_by_a_finished_thread_goes_down_with_a_sigkilled_launcher(tmp_path):
    """Issue 36: a server (re)started by another thread (the async producer) had no parent-death signal, so a
    kill -9 of the trainer left it running, and its /dev/shm files behind. The server's own guard
    (moe_rl.rollout.orphan_guard) stops its group and removes the files it held within 10 s."""

    marker = _real_model(tmp_path / "thread-model")
    ready = tmp_path / "ready"
    script = textwrap.dedent(f"""
        import threading, time
        from pathlib import Path
        from moe_rl.rollout.launcher import SGLangServer
        from moe_rl.rollout.server_spec import ServerSpec
        box = []
        t = threading.Thread(target=lambda: box.append(
            SGLangServer(ServerSpec({marker!r}, startup_timeout_s=300), Path({str(tmp_path)!r}) / "s.log").start()))
        t.start(); t.join()  # healthy, and the thread that started it has ended
        Path({str(ready)!r}).write_text(str(box[0].process.pid))
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=REPO)
    try:
        deadline = time.monotonic() + 300
        while not ready.exists() and parent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ready.exists(), "the server never became healthy"
        files = group_shm_files(int(ready.read_text()))
        assert any(path.name.startswith("sglang_loads") for path in files), files
    finally:
        parent.kill()
        parent.wait(timeout=30)
    assert _wait_gone(marker, timeout_s=10) == [], "server processes outlived a SIGKILL'd launcher"
    assert [path for path in files if path.exists()] == []


def test_a_closing_pool_restarts_nothing(tmp_path):
    """Issue 36: the pool could restart a server it was tearing down (the producer thread noticing the servers
    go away at shutdown); once close() has begun, restart() starts nothing and returns []."""

    marker = str(tmp_path / "closing-model")
    server = SGLangServer(ServerSpec(marker, startup_timeout_s=3.0), tmp_path / "server.log")
    pool = ServerPool(servers=[server], max_restarts=5)
    pool.close()
    assert pool.restart() == [] and pool.restart([server.url]) == []
    assert server.process is None and pool.restarts == 0 and _pids_mentioning(marker) == []


def test_a_failed_gc_freeze_warns_and_names_the_server(tmp_path, caplog):
    """``/freeze_gc`` only saves each push's flush a heap walk: a server that refuses it is still usable, so the
    launcher warns (naming the server) instead of failing the start. Here nothing listens on the port (a real refused
    connection)."""

    server = SGLangServer(ServerSpec(model_path=str(tmp_path)), tmp_path / "server.log")
    server.url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    with caplog.at_level("WARNING", logger="moe_rl.rollout.launcher"):
        server.freeze_gc(ServerKeys())
    assert f"SGLang server at {server.url}: /freeze_gc failed (ConnectError" in caplog.text


def test_a_port_taken_before_the_server_binds_it_is_retried_on_a_fresh_port(tmp_path, monkeypatch, caplog):
    """Issue 57 (5): on a busy host another process can take the port the launcher chose before SGLang binds it
    (uvicorn: ``[Errno 98] ... address already in use``, exit code 3). Here the test takes it: the first port handed
    out is bound and listened on by the test itself. The launcher starts the server again on a fresh port, logs the
    retry, and the server comes up healthy there."""
    chosen: list[int] = []
    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)

    def take_the_first(host="127.0.0.1", rng=None):
        port = free_port(host, rng)
        if not chosen:
            squatter.bind((host, port))
            squatter.listen()
        chosen.append(port)
        return port

    monkeypatch.setattr(launcher, "free_port", take_the_first)
    spec = ServerSpec(_real_model(tmp_path / "model"), startup_timeout_s=300)
    try:
        with (
            caplog.at_level("WARNING", logger="moe_rl.rollout.launcher"),
            SGLangServer(spec, tmp_path / "s.log") as server,
        ):
            assert len(chosen) == 2 and chosen[0] != chosen[1], chosen
            assert server.url == f"http://127.0.0.1:{chosen[1]}"
            assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    finally:
        squatter.close()
    assert f"SGLang server on port {chosen[0]} lost a port to another process" in caplog.text
    assert f"start 2/{launcher.BIND_TRIES} on port {chosen[1]}" in caplog.text


def test_a_lost_bind_reads_as_one_in_the_logs_of_every_binder(tmp_path):
    """The marks ``lost_a_bind`` looks for, checked on the real messages: uvicorn's (the HTTP port) and torch's
    TCPStore's (SGLang's auxiliary port for the scheduler's process group)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(Exception) as store_error:
            torch.distributed.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=5))
        script = f"import uvicorn; uvicorn.run(lambda *a: None, host='127.0.0.1', port={port}, log_level='error')"
        server = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert server.returncode == 3, server.stderr
    assert lost_a_bind(server.stderr), server.stderr
    assert lost_a_bind(str(store_error.value)), store_error.value
    assert not lost_a_bind("SGLang server exited: CUDA out of memory")


def test_free_ports_come_from_below_the_ephemeral_range():
    """bind(0) draws from the kernel's ephemeral range, the pool every outgoing connection takes from: the busy-host
    race. The launcher's ports come from below it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port("127.0.0.1") for _ in range(20)}
    assert all(p < low for p in ports), sorted(ports)
    assert len(ports) > 1, "the same port every time: not random"

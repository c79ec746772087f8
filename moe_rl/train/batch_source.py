"""How rank 0's batch source is built from the run's parts: the async rollout process, or sync mode's client and the
batch maker its inline batches call.

Owns only the wiring (which of the trainer's objects each piece gets); when the source is made, opened, asked for a
batch and closed is the trainer's (``moe_rl.train.loop``), what it does is ``moe_rl.source``'s.
"""

from __future__ import annotations

import os
from pathlib import Path

from moe_rl.config import ExperimentConfig
from moe_rl.rollout.auth import ServerKeys
from moe_rl.rollout.client import RolloutClient
from moe_rl.rollout.server_pool import ServerPool
from moe_rl.source.batch_maker import BatchMaker
from moe_rl.source.rollout_process import RolloutProcess, process_cpus
from moe_rl.source.rollout_worker import PromptSide, WorkerSpec
from moe_rl.source.step_records import StepRecords
from moe_rl.train.weight_push import WeightPusher

__all__ = ["inline_batch_maker", "spawn_rollout_process", "sync_client"]


def spawn_rollout_process(
    cfg: ExperimentConfig, run_id: str, nonce: str, records_dir: Path, data_state: dict | None
) -> RolloutProcess:
    """Async mode: rank 0's rollout process (``moe_rl.source.rollout_process``), started with its prompts (from the
    checkpoint's prompt-stream position ``data_state``, None for a fresh run); restarted when it dies, at most
    ``rollout.max_process_restarts`` times; an error that kills it leaves its traceback in ``logs/rollout_process.log``."""
    log_path = str(Path(cfg.train.output_dir) / "logs" / "rollout_process.log")
    spec = WorkerSpec(
        cfg, run_id, nonce, str(records_dir), data_state, process_cpus(cfg.rollout), os.getpid(), log_path
    )
    return RolloutProcess.spawn(spec, cfg.rollout.max_process_restarts)


def sync_client(cfg: ExperimentConfig, addresses: list[str], keys: ServerKeys, prompt_side: PromptSide):
    """Sync mode: rank 0's client of the servers, for the inline batches and eval: the run's API key (a generated
    one by default); dataset prompts stop at EOS."""
    return RolloutClient.from_config(
        cfg, addresses, headers=keys.headers(), admin_headers=keys.headers(admin=True), **prompt_side.stop_tokens(cfg)
    )


def inline_batch_maker(
    cfg: ExperimentConfig,
    prompt_side: PromptSide,
    records: StepRecords,
    records_dir: Path,
    client,
    weights: WeightPusher,
    server_pool: ServerPool | None,
) -> BatchMaker:
    """Sync mode: the batch maker rank 0's inline batches call, on ``client``'s servers at ``weights``' versions (a
    re-sync through the pusher; a dead server restarted by ``server_pool``, when there is one)."""
    return BatchMaker(
        cfg,
        prompt_side.samples,
        records,
        records_dir,
        client,
        weights.version,
        resync=lambda v: weights.resync(client.addresses, v),
        weight_sync=lambda: weights.sync,
        restart=server_pool.restart if server_pool else None,
    )

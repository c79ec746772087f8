"""Issue 28 through real processes: ``moe-rl train`` refuses records made for another model in one line,
and with 2 ranks every rank trains on the bytes rank 0 read, or all ranks fail in one line (from issue 25)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import repo_env
from tests.distributed.torchrun import run_worker
from tests.train.records_fixture import CONFIG, RECORDS, ROOT

WORKER = Path(__file__).with_name("step_records_worker.py")


def test_the_issue_command_fails_in_one_line_naming_the_key(tmp_path):
    """8-expert records on a 16-expert learner: before this issue it trained to the end with exit 0."""
    cmd = [
        sys.executable,
        "-m",
        "moe_rl.cli",
        "train",
        str(CONFIG),
        f"train.rollouts_from={RECORDS}",
        "train.prompts_per_step=4",
        "rollout.samples_per_prompt=4",
        "rollout.max_new_tokens=16",
        "model.num_moe_experts=16",
        "train.steps=2",
        f"train.output_dir={tmp_path}",
        "logging.progress=false",
        "logging.tensorboard=false",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=repo_env(ROOT), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        (
            f"error: train.rollouts_from={RECORDS}: {RECORDS}/step_000000.safetensors: records were made for 8 experts; "
            "model.num_moe_experts=16"
        )
    ]
    assert not list(tmp_path.glob("checkpoints/*/")), "a checkpoint was written"


def test_every_rank_verifies_rank_0s_digest(tmp_path):
    run_worker(WORKER, "--work", str(tmp_path), timeout=180)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    fresh = {r["fresh"] for r in ranks}
    assert len(fresh) == 1 and fresh.pop().startswith("ok "), ranks  # one digest, both loaded
    for r in ranks:  # the stale copy on node 1 fails both ranks with rank 1's line
        assert r["stale"].startswith("train.rollouts_from=DIR: ") and "\n" not in r["stale"], r
        assert "node1/step_000000.safetensors: content has sha256" in r["stale"]
        assert "rank 1 does not see the file rank 0 read (a stale copy" in r["stale"]
        # rank 0's refusal reaches rank 1 too (no rank is left waiting in a collective)
        assert r["refused"].endswith(
            "node0/step_000000.safetensors: records were made for 8 experts; model.num_moe_experts=16"
        ), r
    # each rank reads its own sample's chunk: less than the whole file, one identity
    assert ranks[0]["share"] == ranks[1]["share"] == ranks[0]["fresh"]
    assert all(r["share_bytes"][0] < r["fresh_bytes"][0] for r in ranks), ranks
    # the chunk only rank 1 reads was changed on its node: rank 1's refusal, naming file and chunk, on both
    for r in ranks:
        assert "node1/step_000000.safetensors: chunk 'sample 1' has sha256" in r["tampered"], r
        assert r["tampered"].endswith("(rank 1's share of the samples)") and "\n" not in r["tampered"], r

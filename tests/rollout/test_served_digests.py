"""Issue 57 item 1: the whole-model served digests (SGLang patch 0014) against the tiny_cpu session server.

A trainer-like push (``WeightSync`` over the tensor transport) is followed by someone holding the (here: absent,
so any) admin key replacing only the expert weights under the run's label with ``/update_weights_from_disk``, the
issue's probe: norms and routers stay the pushed ones, so the old norm/router fingerprint saw nothing. The first
batch after it (``generate_checked`` with a real client) is refused as foreign weights, re-synced and regenerated.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file, save_file

from moe_rl.config import load_config
from moe_rl.learner.hf_init import write_random_hf_checkpoint
from moe_rl.rollout.client import RolloutClient
from moe_rl.sync.integrity import generate_checked
from moe_rl.sync.served_weights import hf_dir_digests, served_digests
from moe_rl.sync.weight_sync import WeightSync

pytestmark = pytest.mark.sglang
ROOT = Path(__file__).parents[2]
LABEL = "step-1-d1e57a00"


def _state(hf_dir: Path) -> dict:
    return {k: v for f in sorted(hf_dir.glob("*.safetensors")) for k, v in load_file(f).items()}


def _experts_only(src: Path, out: Path) -> Path:
    """An HF dir holding only ``src``'s expert weights (and its config): the issue's expert-only foreign push."""
    out.mkdir(parents=True)
    experts = {k: v for k, v in _state(src).items() if ".mlp.experts." in k}
    save_file(experts, str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(src / "config.json", out / "config.json")
    return out


def test_an_expert_only_foreign_push_is_caught_at_the_first_batch_after_it(tiny_cpu_server, tmp_path, caplog, device):
    url = tiny_cpu_server
    cfg = load_config(ROOT / "configs/tiny_cpu.yaml")
    mine = _state(write_random_hf_checkpoint(cfg.model, tmp_path / "mine", seed=5))
    ws = WeightSync("tensor", cfg.model, max_foreign_syncs=1)
    ws.push(mine, [url], LABEL)
    assert len(ws.pushed.by_label[LABEL]) == len(mine)  # every tensor, not a sample
    ws.pushed.check([url], LABEL)

    foreign = _experts_only(write_random_hf_checkpoint(cfg.model, tmp_path / "other", seed=77), tmp_path / "experts")
    assert set(hf_dir_digests(foreign)) < set(mine)
    body = {"model_path": str(foreign), "weight_version": LABEL, "flush_cache": True}
    resp = httpx.post(f"{url}/update_weights_from_disk", json=body, timeout=120)
    assert resp.status_code == 200 and resp.json()["success"], resp.text
    served = served_digests(url, None)[0]
    assert {n for n in mine if served[n] != ws.pushed.by_label[LABEL][n]} == set(hf_dir_digests(foreign))

    client = RolloutClient.from_config(cfg, [url])
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    with caplog.at_level(logging.WARNING):
        samples = generate_checked(
            lambda: client.generate(prompts, 2),
            LABEL,
            resync=lambda: ws.push(mine, [url], LABEL),
            check_served=lambda: ws.pushed.check([url], LABEL),
            max_foreign_syncs=1,
        )
    warned = [r.getMessage() for r in caplog.records if "foreign weights" in r.getMessage()]
    assert len(warned) == 1, warned  # caught at the first batch, re-synced once, regenerated clean
    assert "serves digest" in warned[0] and "mlp.experts." in warned[0] and "(1/1)" in warned[0], warned[0]
    assert len(samples) == 4 and all(s.weight_version == LABEL for s in samples)
    ws.pushed.check([url], LABEL)  # the re-sync restored every tensor
    print("\n" + json.dumps({"foreign_warning": warned[0][:300]}))

"""Worker of ``bench/bench_weight_sync.py --learner-ranks``: one learner rank's syncs, timed, with its memory sampled.

``torchrun --nproc_per_node=N bench/weight_sync_ranks.py URL V1 V2 OUT MODES REPEATS BUCKET_MB MODEL``. Every rank
loads the model from V2 (ep = N), then for each mode (``streamed-<transport>``: ``WeightSync.sync``, the
trainer's path; ``gathered-<transport>``: the previous release's path, every tensor gathered into rank 0's memory
by ``export_hf_state_dict`` and pushed from there) runs REPEATS syncs to the server at URL. A thread samples this
process's resident set (``/proc/self/statm``) every millisecond; each sync reports its seconds and the peak
increase over the resident set just before it. Rank 0 writes every rank's figures to OUT (JSON).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_weight_sync import MODELS

from moe_rl.config import ExperimentConfig
from moe_rl.learner.dist import destroy_distributed, init_distributed
from moe_rl.learner.hf_convert import export_hf_state_dict
from moe_rl.learner.train_step import Learner
from moe_rl.sync.checks import reference_from_hf_dir
from moe_rl.sync.weight_sync import WeightSync

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * PAGE


class Peak:
    """The resident set's peak above its value at entry, sampled every millisecond on a thread."""

    def __enter__(self):
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # what earlier syncs freed goes back first
        self.base, self.peak, self.stop = rss(), 0, threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, rss())
        self.increase = self.peak - self.base


def main() -> None:
    url, v1, v2, out = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
    modes, repeats, bucket_mb, name = sys.argv[5].split(","), int(sys.argv[6]), int(sys.argv[7]), sys.argv[8]
    sys.path.insert(0, str(Path(__file__).parent))

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = ExperimentConfig(
        model=MODELS[name].model_dump(), parallel={"ep": world}, checkpoint={"init_from_hf": v2}, train={"steps": 1}
    )
    init_distributed(cfg.parallel)
    learner = Learner(cfg)
    rank0 = dist.get_rank() == 0
    reference = reference_from_hf_dir(v1) if rank0 else None
    rows = []
    for mode in modes:
        how, transport = mode.split("-")
        ws = WeightSync(
            transport,
            cfg.model,
            export_dir=out.parent / f"export-{world}-{mode}",
            template_dir=v2,
            bucket_bytes=bucket_mb << 20,
            reference=reference,
            timeout_s=600,
            group_options={"backend": "gloo"},
        )
        for r in range(repeats + 1):  # the first: warm-up (imports, the group's rendezvous)
            dist.barrier()
            with Peak() as peak:
                t0 = time.perf_counter()
                if how == "streamed":
                    ws.sync(learner.module, [url] if rank0 else [], f"{mode}-{r}")
                else:  # the previous release: the whole model gathered into rank 0's memory, then pushed
                    state = export_hf_state_dict(learner.module, cfg.model)
                    if state is not None:
                        ws.push(state, [url], f"{mode}-{r}")
                    del state
                dist.barrier()
                seconds = time.perf_counter() - t0
            if r:
                rows.append({"mode": mode, "rank": dist.get_rank(), "seconds": seconds, "rss_increase": peak.increase})
        ws.close()
    every = [None] * world if rank0 else None
    dist.gather_object(rows, every, dst=0)
    if rank0:
        out.write_text(json.dumps([row for part in every for row in part]))
    destroy_distributed()


if __name__ == "__main__":
    main()

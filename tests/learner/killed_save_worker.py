"""Subprocess for ``test_a_save_killed_mid_write_leaves_the_previous_checkpoint_loadable``: one rank saves
checkpoint 1, trains a step, and starts checkpoint 2; half way through writing its optimizer file the
process SIGKILLs itself (no handler, no finaliser runs). Usage: ``killed_save_worker.py CKPT_DIR``."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
torch.set_num_threads(1)

from moe_rl.learner import sharded_state
from moe_rl.learner.checkpoint import save_checkpoint
from moe_rl.learner.dist import init_distributed
from moe_rl.learner.train_step import Learner
from tests.learner.conftest import make_cfg
from tests.learner.test_train_step import fixed_batch


def nll(logp, entropy, mb):
    return -logp.mean(), {}


def main() -> None:
    ckpt = Path(sys.argv[1])
    cfg = make_cfg()
    init_distributed(cfg.parallel, environ={})
    learner = Learner(cfg, total_steps=4)
    learner.train_step([fixed_batch(256)], nll)
    save_checkpoint(learner, ckpt)
    learner.train_step([fixed_batch(256, seed=2)], nll)
    write = sharded_state.write_safetensors

    def write_then_die(path, tensors, metadata):
        if Path(path).name.startswith("optimizer-"):
            write(path, tensors[: len(tensors) // 2], metadata)  # a torn file on disk, then kill -9
            os.kill(os.getpid(), signal.SIGKILL)
        return write(path, tensors, metadata)

    sharded_state.write_safetensors = write_then_die
    save_checkpoint(learner, ckpt)


if __name__ == "__main__":
    main()

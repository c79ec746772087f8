"""Subprocess probe for the CPU shim tests: apply all CPU shims but one, then exercise its code path.

``python shim_probe.py <left_out|none> [...]`` prints ``<name> PROBE-OK`` or ``<name> PROBE-FAIL <Type>: <message>``
for each name. The imports are done once; each probe then runs in its own forked child (shims are process-wide
patches), two at a time (the CI machine's 2 cores).
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import megatron.core.models.gpt
import megatron.core.pipeline_parallel.p2p_communication
import megatron.core.transformer.moe.token_dispatcher  # noqa: F401
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.transformer.moe import token_dispatcher

import moe_rl.learner.dist as d
import moe_rl.learner.mcore_compat as mc
import moe_rl.learner.model  # noqa: F401
import moe_rl.learner.model as m
import tests.learner.conftest  # noqa: F401
from moe_rl.learner import cpu_shims
from moe_rl.learner.dist import init_distributed
from moe_rl.learner.model import build_model, forward_logits
from tests.learner.conftest import make_cfg

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
torch.set_num_threads(1)


def exercise() -> None:
    """Build a tiny MoE model (alltoall dispatcher, full recompute) and run forward + backward."""

    cfg = make_cfg(train={"recompute": "full"}, moe_token_dispatcher_type="alltoall")
    init_distributed(cfg.parallel, environ={})
    # The expert-parallel all-to-all with the split sizes the dispatcher computes (ep=1 skips it).
    splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([2]), as_numpy=True)
    dist.all_to_all_single(torch.empty(2), torch.ones(2), output_split_sizes=splits, input_split_sizes=splits)
    model = build_model(cfg)
    ids = torch.randint(0, cfg.model.vocab_size, (2, 8))
    forward_logits(model, ids).sum().backward()
    # Pipeline parallelism's shape exchange for ragged microbatches (variable_seq_lengths): with no peer
    # to talk to it still ends in torch.cuda.synchronize().

    P2PCommunicator(pp_group=ps.get_pipeline_model_parallel_group(), config=model.config)._communicate_shapes(
        None, None, False, False
    )


def probe(left_out: str) -> None:
    names = tuple(n for n in cpu_shims.CPU_SHIMS if n != left_out)
    original_apply = cpu_shims.apply_cpu_shims
    original_apply(only=names)
    cpu_shims.apply_cpu_shims = lambda only=None: original_apply(only=names)  # later calls too

    d.apply_cpu_shims = m.apply_cpu_shims = cpu_shims.apply_cpu_shims
    if left_out == "te_general_gemm":  # the same fix also runs on every device; leave it out there too
        mc.apply_megatron_fixes = d.apply_megatron_fixes = m.apply_megatron_fixes = list  # each binds it
    try:
        exercise()
    except Exception as exc:  # noqa: BLE001 - report whatever broke
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "megatron" in f.filename]
        where = f"{Path(frames[-1].filename).stem}.{frames[-1].name}" if frames else "?"
        print(f"{left_out} PROBE-FAIL at {where} {type(exc).__name__}: {exc}".splitlines()[0], flush=True)
        return
    print(f"{left_out} PROBE-OK applied=" + ",".join(cpu_shims.applied_shims()), flush=True)


def main(names: list[str], parallel: int = 2) -> None:
    """Import what every probe imports, then fork one child per name, `parallel` at a time."""

    running: set[int] = set()
    for name in names:
        if len(running) >= parallel:
            running.discard(os.wait()[0])
        pid = os.fork()
        if pid == 0:  # the child: one probe, then leave without the parent's exit handlers
            try:
                probe(name)
            finally:
                os._exit(0)
        running.add(pid)
    while running:
        running.discard(os.wait()[0])


if __name__ == "__main__":
    main(sys.argv[1:])

"""Process-group and Megatron parallel-state setup for the learner.

Owns: reading the launcher's environment (torchrun or SLURM), creating the
default process group (gloo on CPU, nccl on GPU) and Megatron's tp/pp/ep/cp/etp
groups, and ``RankComm`` (rank 0 broadcasts and gathers small objects for the streamed weight sync and
HF export). It must not build models or touch optimizer state.
"""

from __future__ import annotations

import os
import pickle
import re
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from moe_rl.learner.cpu_shims import apply_cpu_shims
from moe_rl.learner.mcore_compat import apply_megatron_fixes

__all__ = ["LaunchEnv", "destroy_distributed", "deterministic_kernels", "free_port", "init_distributed", "launch_env"]


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as told by the launcher."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" | "slurm" | "single"


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _first_slurm_host(nodelist: str) -> str:
    """First hostname of a SLURM nodelist such as ``gpu[03-05,07],cpu1``."""
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if m is None:
        raise ValueError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}; set MASTER_ADDR instead")
    prefix, _, ranges = m.groups()
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def launch_env(environ: dict[str, str] | None = None) -> LaunchEnv:
    """Read rank/world/master from torchrun (``RANK``...) or SLURM (``SLURM_PROCID``...).

    torchrun variables win when both are present (``srun torchrun`` sets both).
    Without a launcher this is a single process on 127.0.0.1 with a free port.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
            launcher="torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        addr = env.get("MASTER_ADDR") or _first_slurm_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
        # A job-id-derived port lets every task agree without talking first.
        port = int(env.get("MASTER_PORT", 20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
        return LaunchEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            master_addr=addr,
            master_port=port,
            launcher="slurm",
        )
    return LaunchEnv(0, 1, 0, "127.0.0.1", free_port(), "single")


def _local_gpu(env: LaunchEnv) -> int:
    """The GPU of this rank (one per rank): ``local_rank``, which must name a visible device."""
    count = torch.cuda.device_count()
    if env.local_rank >= count:
        raise ValueError(
            f"rank {env.rank} has local_rank={env.local_rank} ({env.launcher}) but this node shows {count} CUDA "
            f"GPU(s); expected one GPU per rank: start at most {count} processes per node "
            "(torchrun --nproc-per-node) or check CUDA_VISIBLE_DEVICES"
        )
    return env.local_rank


def init_distributed(parallel_cfg, environ: dict[str, str] | None = None) -> LaunchEnv:
    """Create the default process group and Megatron's model-parallel groups.

    ``parallel_cfg`` has ``tp, pp, ep, cp, etp`` (etp None -> tp) and ``backend``
    ("auto": gloo on CPU, nccl on GPU). Re-entrant: an existing default group is reused (the sizes must
    then match the config).
    """

    apply_cpu_shims()  # first: on CPU the shim set lists te_general_gemm itself
    apply_megatron_fixes()
    env = launch_env(environ)
    tp, pp, ep, cp = (int(getattr(parallel_cfg, k)) for k in ("tp", "pp", "ep", "cp"))
    etp = getattr(parallel_cfg, "etp", None)
    etp = tp if etp is None else int(etp)
    need = tp * pp * cp
    if env.world_size % need or env.world_size % (etp * ep * pp):
        raise ValueError(
            f"parallel sizes tp={tp} pp={pp} cp={cp} ep={ep} etp={etp} do not divide "
            f"world_size={env.world_size}; expected world_size % (tp*pp*cp) == 0 and "
            f"world_size % (etp*ep*pp) == 0"
        )
    if not dist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(_local_gpu(env))
        backend = getattr(parallel_cfg, "backend", "auto")
        dist.init_process_group(
            backend=("nccl" if cuda else "gloo") if backend == "auto" else backend,
            init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    return env


def deterministic_kernels(enabled: bool) -> None:
    """``precision.deterministic`` on CUDA, before the first cuBLAS call (``Learner`` calls it before it builds the
    model): PyTorch's deterministic algorithms (ops without one warn), the cuBLAS workspace they need, and Transformer
    Engine's deterministic attention, which Megatron's ``deterministic_mode`` (``model.transformer_config_kwargs``)
    requires (``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``); variables already set are kept. On an H100 a resumed run then
    equals a straight one; without it ``loss/kl_ref`` differed at 1e-15 (docs/gpu.md). Nothing to do on CPU."""
    if not enabled or not torch.cuda.is_available():
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    torch.use_deterministic_algorithms(True, warn_only=True)


def destroy_distributed() -> None:
    """Tear down Megatron's groups and the default process group."""

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _comm_device() -> torch.device:
    """Where the default group's tensors live: the current GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def decided_by_rank0(decide):
    """``decide()`` evaluated on rank 0 only and broadcast: every rank returns rank 0's answer.

    For what several ranks (or nodes, each with its own view of a filesystem) must agree on: what
    exists, which file to load. ``decide`` must return a picklable value; without a process group it
    is simply called.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return decide()
    box = [decide() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)  # size: decide()'s answer (a path, a flag: a few hundred bytes)
    return box[0]


class RankComm:
    """The learner ranks' side of a sync: rank 0 broadcasts, gathers (``collective=False``: this process alone)."""

    def __init__(self, collective: bool):
        self.dist = dist
        self.on = collective and dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.on else 0
        self.rank0 = self.rank == 0

    def bcast(self, obj):
        if not self.on:
            return obj
        box = [obj]
        self.dist.broadcast_object_list(box, src=0)  # size: the caller's (bounded) header / verdict; see callers
        return box[0]

    def gather(self, obj) -> list | None:
        """Every rank's ``obj`` in rank order on rank 0, None elsewhere, with no padding: one 8-byte length per
        rank (a fixed-size tensor gather), then rank 0 receives each rank's pickled bytes in turn at its own size
        (``gather_object`` would allocate the largest payload x world on rank 0's device). Rank 0 holds the sum of
        the payloads, which it keeps anyway; no other rank holds more than its own."""
        if not self.on:
            return [obj]
        world, device = self.dist.get_world_size(), _comm_device()
        data = pickle.dumps(obj) if not self.rank0 else b""
        sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
        self.dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64, device=device))
        if not self.rank0:
            if data:
                self.dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device), dst=0)
            return None
        out = [obj]
        for rank in range(1, world):
            n = int(sizes[rank].item())
            buf = torch.empty(n, dtype=torch.uint8, device=device)
            if n:
                self.dist.recv(buf, src=rank)
            out.append(pickle.loads(buf.cpu().numpy().tobytes()) if n else None)
        return out

    def barrier_if(self, needed: bool) -> None:
        if self.on and needed:
            self.dist.barrier()

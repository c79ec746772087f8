"""The run's identity: one id per run, kept across resumes, decided on rank 0 and broadcast.

A fresh run (no checkpoint to resume) gets a new random id; a resumed run keeps the id stored in
``<train.output_dir>/run_id`` (a run from before ids existed gets a new one on its first resume).
``checkpoint.dir`` records its owner in ``run.json`` (the id and the output directory), so a resume
can tell its own checkpoints from another run's. Everything that must tell runs apart uses it: the checkpoint directory's identity and the reference
policy's completion marker, the weight-version label's nonce, the records' producing run, wandb's id.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import tempfile
from pathlib import Path

from moe_rl.learner.dist import decided_by_rank0

__all__ = [
    "CKPT_IDENTITY_FILE",
    "RUN_ID_FILE",
    "new_run_id",
    "read_checkpoint_identity",
    "read_run_id",
    "resolve_run_id",
    "version_nonce",
    "write_checkpoint_identity",
    "write_run_id",
]

RUN_ID_FILE = "run_id"
CKPT_IDENTITY_FILE = "run.json"  # in checkpoint.dir: which run (id, output dir) writes its checkpoints


def new_run_id() -> str:
    """12 hex characters (48 random bits)."""
    return secrets.token_hex(6)


def read_run_id(directory: str | Path) -> str | None:
    path = Path(directory) / RUN_ID_FILE
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    return text or None


def write_run_id(directory: str | Path, run_id: str) -> Path:
    """Atomically write ``<directory>/run_id``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{RUN_ID_FILE}.", suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        fh.write(run_id + "\n")
    os.replace(tmp, directory / RUN_ID_FILE)
    return directory / RUN_ID_FILE


def read_checkpoint_identity(ckpt_dir: str | Path) -> dict | None:
    """``{"run_id", "output_dir"}`` of the run that owns ``ckpt_dir`` (None: not recorded)."""
    try:
        ident = json.loads((Path(ckpt_dir) / CKPT_IDENTITY_FILE).read_text())
    except (OSError, ValueError):
        return None
    return ident if isinstance(ident, dict) and ident.get("run_id") else None


def write_checkpoint_identity(ckpt_dir: str | Path, run_id: str, output_dir: str | Path) -> Path:
    """Atomically write ``<ckpt_dir>/run.json`` naming the owning run and its ``train.output_dir``."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=ckpt_dir, prefix=f".{CKPT_IDENTITY_FILE}.", suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        json.dump({"run_id": run_id, "output_dir": str(Path(output_dir).resolve())}, fh)
    os.replace(tmp, ckpt_dir / CKPT_IDENTITY_FILE)
    return ckpt_dir / CKPT_IDENTITY_FILE


def resolve_run_id(run_dir: str | Path, resumed: bool) -> str:
    """This run's id on every rank: rank 0 reads it (resume) or draws a new one, then broadcasts it."""

    return decided_by_rank0(lambda: (read_run_id(run_dir) if resumed else None) or new_run_id())


def version_nonce(run_id: str) -> str:
    """The weight-version label's nonce (``step-<s>-<nonce>``): 8 hex characters derived from the run id,
    so a resumed run keeps labelling its weights alike and another run never does."""
    return hashlib.sha256(f"weight-version:{run_id}".encode()).hexdigest()[:8]

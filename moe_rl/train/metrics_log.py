"""Per-step metrics sinks: JSONL (always readable), TensorBoard, wandb (offline-capable), progress bar.

Owns where metrics go, not what they are: every key arrives flat and slash-namespaced
(``reward/mean``, ``offpolicy/kl_k3``, ``replay/rollout_vs_natural/response/flip_rate``) and is
written unchanged. On resume, lines for steps after the checkpoint are dropped so the
file reads as one uninterrupted run, and wandb continues the same wandb run (its id is the run id).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

METRICS_FILE = "metrics.jsonl"
PROGRESS_KEYS = {
    "reward": "reward/mean",
    "kl": "offpolicy/kl_k3",
    "flip": "replay/rollout_vs_natural/response/flip_rate",
}


def _finite(v):
    return v if isinstance(v, (int, str)) or (isinstance(v, float) and math.isfinite(v)) else None


def step_of(line: str) -> int | None:
    """The step of one JSONL line; None for a blank or torn line (a run killed mid-write)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def truncate_metrics(path: Path, last_step: int) -> None:
    """Keep only whole lines with ``step <= last_step`` (atomic rewrite)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if step_of(line) is not None and step_of(line) <= last_step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def wandb_init_kwargs(logging_cfg, run_dir: str | Path, run_name: str, run_id: str | None) -> dict:
    """``wandb.init`` arguments: the run id as wandb's id with ``resume="allow"``, so a resumed run logs into
    the wandb run it started (a new id would start a new wandb run on every resume)."""
    kwargs = {
        "project": logging_cfg.wandb_project,
        "name": run_name,
        "dir": str(run_dir),
        "mode": logging_cfg.wandb_mode,
        "resume": "allow",
    }
    return kwargs | ({"id": run_id} if run_id else {})


def read_metrics(path: str | Path) -> list[dict]:
    """All step records of a metrics.jsonl file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class MetricsLogger:
    """Writes one record per step to every enabled sink; a no-op on non-zero ranks."""

    def __init__(
        self,
        run_dir: str | Path,
        logging_cfg,
        total_steps: int,
        start_step: int = 0,
        enabled: bool = True,
        run_name: str = "moe_rl",
        run_id: str | None = None,
    ):
        self.enabled = enabled
        self.path = Path(run_dir) / METRICS_FILE
        self._tb = self._wandb = self._bar = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        truncate_metrics(self.path, start_step)
        self._jsonl = open(self.path, "a") if logging_cfg.jsonl else None  # noqa: SIM115 - closed in close()
        if logging_cfg.tensorboard:
            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=start_step + 1)
        if logging_cfg.wandb and logging_cfg.wandb_mode != "disabled":
            import wandb  # optional extra: pip install moe_rl[wandb]  # noqa: PLC0415 -- wandb is optional

            self._wandb = wandb.init(**wandb_init_kwargs(logging_cfg, run_dir, run_name, run_id))
        if logging_cfg.progress:
            self._bar = tqdm(total=total_steps, initial=start_step, desc="moe-rl", unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: dict, progress: bool = True) -> None:
        """One record for ``step``; ``progress=False`` for a line that is not a step (the eval before step 1)."""
        if not self.enabled:
            return
        record = {"step": step, **{k: _finite(v) for k, v in sorted(metrics.items())}}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if self._bar is not None and progress:
            shown = {name: f"{metrics[key]:.3g}" for name, key in PROGRESS_KEYS.items() if key in metrics}
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(1)

    def close(self) -> None:
        if not self.enabled:
            return
        for sink in (self._jsonl, self._tb, self._bar):
            if sink is not None:
                sink.close()
        if self._wandb is not None:
            self._wandb.finish()

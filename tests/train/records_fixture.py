"""The saved rollout records the step-equality tests train on, and the weights they start from.

``tests/data/records_tiny_cpu/step_00000{0,1}.safetensors`` were generated once by the real SGLang
CPU server (bf16, deterministic) from ``initial_hf_dir`` with ``regenerate_records`` (run this
module: ``python -m tests.train.records_fixture``). Responses are EOS-terminated digit strings
of different lengths (up to 16 tokens). Every equality run initialises its learner from the
same ``initial_hf_dir`` (written deterministically here), so all runs see identical records
and weights; no server is needed to test.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from moe_rl.config import load_config
from moe_rl.learner.hf_init import write_random_hf_checkpoint

ROOT = Path(__file__).parents[2]
RECORDS = ROOT / "tests/data/records_tiny_cpu"
CONFIG = ROOT / "configs/tiny_cpu.yaml"
# 4 prompts x 4 samples = 16 samples per step; 2 minibatches of 8; ragged responses up to 16 tokens
SHAPE = [
    "train.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "train.minibatches_per_step=2",
    "rollout.max_new_tokens=16",
    "logging.tensorboard=false",
    "logging.progress=false",
]


def initial_hf_dir(out_dir: Path) -> Path:
    """The tiny_cpu model's random-init HF checkpoint (seed 0), the start of every equality run."""

    return write_random_hf_checkpoint(load_config(CONFIG).model, out_dir, seed=0)


def regenerate_records(work: Path) -> None:
    hf = initial_hf_dir(work / "hf")
    cmd = [
        sys.executable,
        "-m",
        "moe_rl.cli",
        "train",
        str(CONFIG),
        *SHAPE,
        "train.steps=2",
        f"checkpoint.init_from_hf={hf}",
        f"train.output_dir={work / 'run'}",
    ]
    subprocess.run(cmd, check=True)
    RECORDS.mkdir(parents=True, exist_ok=True)
    for f in sorted((work / "run/rollouts").glob("step_*.safetensors")):
        f.replace(RECORDS / f.name)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        regenerate_records(Path(tmp))

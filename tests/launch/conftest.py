"""Fixtures for launch tests: a SLURM environment builder."""

from __future__ import annotations

import pytest


@pytest.fixture
def slurm_env():
    def make(nodelist: str, job_id: str = "4242", **extra: str) -> dict[str, str]:
        return {"SLURM_JOB_NODELIST": nodelist, "SLURM_JOB_ID": job_id, **extra}

    return make

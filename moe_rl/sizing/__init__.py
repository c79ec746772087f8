"""Sizing a job: the plan of GPU, host, disk and network per rank and per node, from the config alone.

``plan`` builds it (``moe-rl plan``, ``launch --dry-run``, ``config validate``), ``terms`` holds each byte count
and constant with its derivation, ``fits`` is the preflight rule that refuses a layout over
``launch.gpu_memory_gb`` or ``launch.host_memory_gb``. The package imports ``moe_rl.config`` only.
"""

from moe_rl.sizing.fits import job_fits
from moe_rl.sizing.plan import JobPlan, job_plan

__all__ = ["JobPlan", "job_fits", "job_plan"]

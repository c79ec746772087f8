"""Sizing a job: the plan of GPU, host, disk and network per rank and per node, from the config alone.

``plan`` builds it (``moe-rl plan``, ``launch --dry-run``, ``config validate``), ``terms`` holds each byte count
and constant with its derivation, ``fits`` is the preflight rule that refuses a layout over
``launch.gpu_memory_gb`` or ``launch.host_memory_gb`` (or a ``launch.signal_lead_s`` under the plan's), and
``defaults`` derives the values the config leaves unset (server start and request timeouts, the
client's concurrency, the signal lead). The package imports ``moe_rl.config`` only.
"""

from moe_rl.sizing.defaults import client_concurrency, derived_lines, request_timeout, signal_lead, startup_timeout
from moe_rl.sizing.fits import job_fits
from moe_rl.sizing.plan import JobPlan, job_plan

__all__ = [
    "JobPlan",
    "client_concurrency",
    "derived_lines",
    "job_fits",
    "job_plan",
    "request_timeout",
    "signal_lead",
    "startup_timeout",
]

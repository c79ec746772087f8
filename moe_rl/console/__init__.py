"""What the terminal shows of a ``moe-rl`` command: its log lines (around the progress bar, once per job) and how a
stop signal ends it (``terminal``)."""

from moe_rl.console.terminal import EVERY_RANK, RankFilter, Terminated, TqdmHandler, install, raise_terminated

__all__ = ["EVERY_RANK", "RankFilter", "Terminated", "TqdmHandler", "install", "raise_terminated"]

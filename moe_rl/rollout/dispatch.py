"""Which server each ``/generate`` request of the rollout client goes to: a group's samples to one server.

Owns ``rollout.load_balance`` and the per-server load it reads. A prompt's samples share their whole prompt, and
SGLang's radix cache keeps a prefix on the server that prefilled it: so a group (a prompt's ``n`` samples in one
``agenerate`` call) is *placed* on one server -- its home -- when its first sample takes a request slot, and
every sample of the group (and every continuation of one) is sent there first. Placement balances groups, not
samples: ``least_outstanding`` picks the server with the fewest outstanding tokens (each placed, unfinished
sample's prompt + token budget), then the fewest requests in flight, ties in round-robin order; ``round_robin``
places groups in turn. A group is placed lazily, when a slot frees for it, so the load it sees is the load of the
moment (a slow server, still holding its groups' tokens, gets fewer new groups). A retry after a failed attempt
moves to the next server in the order ``order(home)`` gives (home first, the rest by load). With one server every
request goes to it. An agent trajectory's turns (one call each) are pinned to the server of its first turn
(``Group.prefer``), so each turn's prefill reuses the trajectory's cached prefix. The counters are shared by
every batch in flight (async mode: several threads), under a lock.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

__all__ = ["LOAD_BALANCE", "Dispatch", "Group"]

LOAD_BALANCE = ("least_outstanding", "round_robin")


@dataclass
class Group:
    """One prompt's samples in one call: ``tokens`` each sample may hold (prompt + budget), ``pending`` samples not
    finished yet, ``home`` once placed; ``prefer``: the server to place it on regardless of load (an agent
    trajectory's later turns go where its first turn went: the server that holds its prefix)."""

    tokens: int
    pending: int
    home: int | None = None
    prefer: int | None = None


class Dispatch:
    """Server choice for ``servers`` servers under ``load_balance`` (one of ``LOAD_BALANCE``)."""

    def __init__(self, servers: int, load_balance: str = "least_outstanding"):
        if servers < 1:
            raise ValueError(f"servers={servers}; expected at least one")
        if load_balance not in LOAD_BALANCE:
            raise ValueError(f"load_balance={load_balance!r}; expected one of {LOAD_BALANCE}")
        self.load_balance = load_balance
        self._turns = {"place": itertools.count(), "order": itertools.count()}  # a rotation each: groups, retries
        self._lock = threading.Lock()
        self.tokens = [0] * servers  # outstanding tokens of the groups placed on each server (unfinished samples)
        self.in_flight = [0] * servers  # requests on the wire to each server (this client's, all threads)

    @property
    def servers(self) -> int:
        return len(self.tokens)

    def _rotation(self, what: str) -> list[int]:
        start, n = next(self._turns[what]), self.servers
        return [(start + i) % n for i in range(n)]

    def _by_load(self, order: list[int]) -> list[int]:
        if self.load_balance == "least_outstanding":
            order.sort(key=lambda i: (self.tokens[i], self.in_flight[i]))  # stable: ties keep the rotation
        return order

    def place(self, group: Group) -> int:
        """The group's home (placing it on first call: its samples' tokens count on that server until done)."""
        with self._lock:
            if group.home is None:
                pinned = group.prefer is not None and 0 <= group.prefer < self.servers
                group.home = group.prefer if pinned else self._by_load(self._rotation("place"))[0]
                self.tokens[group.home] += group.tokens * group.pending
            return group.home

    def sample_done(self, group: Group) -> None:
        """One of the group's samples finished (or failed, or was cancelled): its tokens leave its home's load."""
        with self._lock:
            group.pending -= 1
            if group.home is not None:
                self.tokens[group.home] -= group.tokens

    def order(self, home: int | None = None) -> list[int]:
        """Servers to try for one request: ``home`` first, then the rest by load (round robin among equals)."""
        with self._lock:
            rest = self._by_load(self._rotation("order"))
        return rest if home is None else [home, *(i for i in rest if i != home)]

    def sending(self, index: int) -> None:
        with self._lock:
            self.in_flight[index] += 1

    def replied(self, index: int) -> None:
        with self._lock:
            self.in_flight[index] -= 1

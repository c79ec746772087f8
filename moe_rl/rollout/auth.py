"""Rollout server API keys: read from the environment variables the config names, sent as bearer headers.

Owns where keys come from (``rollout.api_key_env`` / ``rollout.admin_api_key_env`` name variables; the
config never holds a key), the ``Authorization`` header of each kind of call (SGLang wants the admin key
on weight updates when it has one, the API key everywhere else), and never printing a key (``repr``
redacts). The server side is ``sglang_entry`` (keys from the environment, redacted from its log).

Secure by default: servers this run launches itself (no ``rollout.addresses``) with no admin key variable
configured get a fresh random admin key (``ServerKeys.for_run``), also beside a configured API key. It lives in the trainer's memory and
reaches the server only through the server's environment (``RUN_ADMIN_KEY_ENV``); it is never written to
a config, a log or the run directory. Servers given by ``rollout.addresses`` keep the configured keys.
"""

from __future__ import annotations

import functools
import os
import secrets
import ssl
from collections.abc import Mapping
from dataclasses import dataclass

# The variable that hands a run's generated admin key to the servers it launches (and, under SLURM, to
# the learner): it holds the key only in those processes' environments, never in a file.
RUN_ADMIN_KEY_ENV = "MOE_RL_RUN_ADMIN_KEY"


@functools.cache
def tls() -> ssl.SSLContext:
    """The TLS context of the one-off calls to the servers (``httpx.post(..., verify=tls())``): httpx builds a fresh
    one per call otherwise, loading the CA store each time (~40 ms a call, measured: half a second of a sync)."""
    return ssl.create_default_context()


class ServerKeyError(RuntimeError):
    """A configured key variable is unset or empty; the message names the config key and the variable."""


@dataclass(frozen=True, repr=False)
class ServerKeys:
    """The API key and admin key of the rollout servers (either may be None: no auth of that kind)."""

    api_key: str | None = None
    admin_api_key: str | None = None
    generated: bool = False  # a fresh admin key for this run's own servers (``for_run``)

    def __repr__(self) -> str:
        hidden = {
            k: "<redacted>" if v else None
            for k, v in (("api_key", self.api_key), ("admin_api_key", self.admin_api_key))
        }
        return f"ServerKeys({hidden})"

    @classmethod
    def from_env_names(
        cls, api_key_env: str | None, admin_api_key_env: str | None, environ: Mapping[str, str] | None = None
    ) -> ServerKeys:
        environ = os.environ if environ is None else environ
        values = []
        for field, name in (("rollout.api_key_env", api_key_env), ("rollout.admin_api_key_env", admin_api_key_env)):
            value = environ.get(name) if name else None
            if name and not value:
                raise ServerKeyError(
                    f"{field}={name!r} names an environment variable that is not set or empty; export {name}=<key> "
                    "on every rollout and learner node (the key itself never goes in the config)"
                )
            values.append(value)
        return cls(*values)

    @classmethod
    def from_rollout_config(cls, rollout, environ: Mapping[str, str] | None = None) -> ServerKeys:
        return cls.from_env_names(rollout.api_key_env, rollout.admin_api_key_env, environ)

    @classmethod
    def fresh(cls) -> ServerKeys:
        """A new random admin key (256 bits) for servers this run launches."""
        return cls(admin_api_key=secrets.token_urlsafe(32), generated=True)

    @classmethod
    def for_run(cls, rollout, environ: Mapping[str, str] | None = None) -> ServerKeys:
        """The keys of a run's servers: the configured variables (an unset one raises ServerKeyError). Servers the
        run launches itself (no ``rollout.addresses``) always get an admin key apart from the API key: a fresh one
        when ``rollout.admin_api_key_env`` is not set, so a client that may generate (the API key) may not push
        weights. Servers given by ``rollout.addresses`` keep what they were started with."""
        configured = cls.from_rollout_config(rollout, environ)
        if rollout.addresses or rollout.admin_api_key_env:
            return configured
        return cls(api_key=configured.api_key, admin_api_key=cls.fresh().admin_api_key, generated=True)

    def server_env(self) -> dict[str, str]:
        """What a launched server's environment must add: the generated key under ``RUN_ADMIN_KEY_ENV``."""
        return {RUN_ADMIN_KEY_ENV: self.admin_api_key} if self.generated and self.admin_api_key else {}

    @property
    def enabled(self) -> bool:
        return bool(self.api_key or self.admin_api_key)

    def headers(self, admin: bool = False) -> dict[str, str]:
        """Headers for a call; ``admin=True`` for weight updates (admin key when set, else the API key)."""
        key = self.admin_api_key if admin and self.admin_api_key else self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

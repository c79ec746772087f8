"""Rollout server API keys: read from the environment variables the config names, sent as bearer headers.

Owns where keys come from (``rollout.api_key_env`` / ``rollout.admin_api_key_env`` name variables; the
config never holds a key), the ``Authorization`` header of each kind of call (SGLang wants the admin key
on weight updates when it has one, the API key everywhere else), and never printing a key (``repr``
redacts). The server side is ``sglang_entry`` (keys from the environment, redacted from its log).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


class ServerKeyError(RuntimeError):
    """A configured key variable is unset or empty; the message names the config key and the variable."""


@dataclass(frozen=True, repr=False)
class ServerKeys:
    """The API key and admin key of the rollout servers (either may be None: no auth of that kind)."""

    api_key: str | None = None
    admin_api_key: str | None = None

    def __repr__(self) -> str:
        hidden = {k: "<redacted>" if v else None for k, v in (("api_key", self.api_key), ("admin_api_key", self.admin_api_key))}
        return f"ServerKeys({hidden})"

    @classmethod
    def from_env_names(cls, api_key_env: str | None, admin_api_key_env: str | None,
                       environ: Mapping[str, str] | None = None) -> ServerKeys:  # fmt: skip
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

    @property
    def enabled(self) -> bool:
        return bool(self.api_key or self.admin_api_key)

    def headers(self, admin: bool = False) -> dict[str, str]:
        """Headers for a call; ``admin=True`` for weight updates (admin key when set, else the API key)."""
        key = self.admin_api_key if admin and self.admin_api_key else self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

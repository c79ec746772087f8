"""The served-weights fingerprint: do the servers hold the weights the trainer pushed, whatever their label?

Owns the fingerprint's definition on the trainer side, its query and its comparison. Labels alone cannot
catch foreign weights (anyone who can push can copy a label), so every generation batch is also checked
against a fingerprint of the weights the servers really hold:

* **What is fingerprinted** (``FINGERPRINT_SUFFIXES``, the same rule as SGLang patch 0010): every RMSNorm
  weight and every MoE router weight (``*norm.weight``, ``*mlp.gate.weight``). Every server rank holds these
  whole, under their Hugging Face names, at any tp/ep, and every RL update changes the routers. Each is
  hashed in full, in the dtype the server holds it: ``"<dtype>:<sha256 of its bytes, 16 hex>"``.
* **Expected** (``fingerprint_tensors`` / ``expected_entries``): from the tensors that were pushed, taken by
  whoever pushes them (today rank 0 holds the whole export; a push that streams from the owning ranks takes
  each rank's fingerprinted tensors on that rank). ``PushedWeights`` remembers the last few pushes by label.
* **Served** (``served_entries``): ``POST /weights_checker {"action": "fingerprint"}`` with the admin key,
  one entry dict per server rank, read from the live tensors when asked (disk, tensor and distributed pushes
  alike, and any other change).
* **Checked** (``PushedWeights.check``): every server rank's entries must equal those of the label the batch
  was made for (with ``newer_ok``: or of a later push of the same run); else ``ForeignWeightsError`` naming
  the server, the label and both fingerprints (``moe_rl.sync.integrity.generate_checked`` re-syncs).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx
import torch
from safetensors import safe_open

from moe_rl.records.versions import parse_version_label
from moe_rl.rollout.auth import ServerKeys, tls
from moe_rl.sync.integrity import ForeignWeightsError, ForeignWeightsStop

__all__ = [
    "FINGERPRINT_SUFFIXES",
    "PushedWeights",
    "digest",
    "expected_entries",
    "fingerprint_entry",
    "fingerprint_tensors",
    "served_entries",
]

FINGERPRINT_SUFFIXES = ("norm.weight", "mlp.gate.weight")
KEEP_PUSHES = 4  # labels remembered by default: the current one and a few before it (async: max_staleness + 2)


def fingerprint_tensors(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fingerprinted tensors of an HF-named state dict (copied: the caller may reuse its buffers)."""
    return {n: t.detach().to("cpu", copy=True) for n, t in named.items() if n.endswith(FINGERPRINT_SUFFIXES)}


def fingerprint_entry(tensor: torch.Tensor, dtype: str | None = None) -> str:
    """``"<dtype>:<16 hex>"`` of ``tensor`` cast to ``dtype`` (the served dtype; default its own), as patch 0010."""
    t = tensor.detach().to("cpu")
    if dtype is not None:
        t = t.to(getattr(torch, dtype))
    data = t.contiguous().reshape(-1).view(torch.uint8)
    return f"{str(t.dtype).removeprefix('torch.')}:{hashlib.sha256(memoryview(data.numpy())).hexdigest()[:16]}"


def expected_entries(tensors: Mapping[str, torch.Tensor], served: Mapping[str, str]) -> dict[str, str]:
    """The entries the pushed ``tensors`` give in the dtypes ``served`` reports (own dtype for names it lacks)."""
    return {n: fingerprint_entry(t, served[n].split(":", 1)[0] if n in served else None) for n, t in tensors.items()}


def digest(entries: Mapping[str, str]) -> str:
    """One short hex fingerprint of a set of entries (for logs and messages)."""
    h = hashlib.sha256()
    for name in sorted(entries):
        h.update(f"{name}={entries[name]};".encode())
    return h.hexdigest()[:16]


def served_entries(address: str, keys: ServerKeys | None, timeout_s: float = 60.0) -> list[dict[str, str]]:
    """Every server rank's fingerprint entries; ForeignWeightsStop when the server cannot say (one line)."""
    why = None
    try:
        resp = httpx.post(
            f"{address}/weights_checker",
            json={"action": "fingerprint"},
            timeout=timeout_s,
            headers=keys.headers(admin=True) if keys else {},
            verify=tls(),
        )
        ranks = resp.json().get("ranks") if resp.status_code == 200 else None
        if not ranks or not all(isinstance(r.get("checksums"), dict) for r in ranks):
            why = f"HTTP {resp.status_code}: {resp.text[:200]}"
    except (httpx.HTTPError, ValueError, AttributeError) as err:
        why = f"{type(err).__name__}: {err}"
    if why is not None:
        raise ForeignWeightsStop(
            f"cannot check the weights {address} serves: /weights_checker fingerprint failed ({why}); it needs the "
            "admin key and an SGLang with moe_rl's patch 0010 (python patches/apply.py)"
        )
    return [dict(r["checksums"]) for r in ranks]


class PushedWeights:
    """The fingerprinted tensors of the last ``keep`` pushes, by label; ``check`` compares the servers."""

    def __init__(self, keys: ServerKeys | None = None, timeout_s: float = 60.0, keep: int = KEEP_PUSHES):
        self.keys, self.timeout_s, self.keep = keys, timeout_s, keep
        self.by_label: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()

    def remember(self, label: str, named: Mapping[str, torch.Tensor]) -> None:
        """``named``: the HF-named tensors just pushed as ``label`` (only the fingerprinted ones are kept)."""
        self.by_label.pop(str(label), None)
        self.by_label[str(label)] = fingerprint_tensors(named)
        while len(self.by_label) > self.keep:
            self.by_label.popitem(last=False)

    def remember_hf_dir(self, label: str, hf_dir: str | Path) -> None:
        """The same for a push from an HF checkpoint directory (reads only the fingerprinted tensors)."""
        named = {}
        for path in sorted(Path(hf_dir).glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                named |= {n: f.get_tensor(n) for n in f.keys() if n.endswith(FINGERPRINT_SUFFIXES)}  # noqa: SIM118
        self.remember(label, named)

    @staticmethod
    def _acceptable(pushed: Mapping, label: str, newer_ok: bool) -> list[str]:
        if not newer_ok:
            return [label] if label in pushed else []
        want = parse_version_label(label)
        ok = []
        for other in pushed:
            got = parse_version_label(other)
            if other == label or (got.nonce == want.nonce and not got.partial and got.step >= want.step):
                ok.append(other)
        return ok

    def check(self, addresses: Sequence[str], label: str, newer_ok: bool = False) -> None:
        """ForeignWeightsError unless every server rank serves the weights pushed as ``label`` (see module doc)."""
        pushed = dict(self.by_label)  # a snapshot: the trainer may push (partial rollouts) while a producer checks
        labels = self._acceptable(pushed, label, newer_ok)
        if not labels:  # nothing pushed under this label by this trainer: nothing to compare with
            raise ForeignWeightsStop(f"no push of {label!r} is known to this trainer: cannot check the served weights")
        for address in addresses:
            for rank, served in enumerate(served_entries(address.rstrip("/"), self.keys, self.timeout_s)):
                expected = {lb: expected_entries(pushed[lb], served) for lb in labels}
                if not any(served == e for e in expected.values()):
                    mine = expected[labels[0]]
                    differ = sorted(n for n in set(mine) | set(served) if mine.get(n) != served.get(n))
                    raise ForeignWeightsError(
                        f"foreign weights on {address} (rank {rank}): label {label!r} serves fingerprint "
                        f"{digest(served)}, the trainer pushed {digest(mine)} ({len(differ)} of {len(mine)} "
                        f"fingerprinted tensors differ, e.g. {differ[:2]})"
                    )

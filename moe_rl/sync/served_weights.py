"""The served-weights digests: do the servers hold every tensor the trainer pushed, whatever their label?

Owns the digest's definition on the trainer side, its query and its comparison. Labels alone cannot catch
foreign weights (anyone who can push can copy a label), so every generation batch is also checked against the
digests of what the servers really received:

* **What is digested** (``tensor_digest``, the same function as SGLang patch 0014's ``received_digest``): every
  tensor of a push, under its Hugging Face name, as it travels: ``"<dtype>:<shape>:<sha256, 32 hex>"`` of its
  C-order bytes in the dtype it is sent in (the learner's export dtype; under ``rollout.weight_quantization`` the
  fake-quantised tensors as sent, i.e. before any fusion, sharding or quantisation the server does on load).
  The disk transport digests the tensors it writes (safetensors keeps their bytes); ``load_dir`` reads the files.
* **Expected** (``PushedWeights.remember``): the digests of every tensor each sending rank sent, gathered to rank 0
  (strings only), kept for the last few pushes by label.
* **Served** (``served_digests``): ``POST /weights_checker {"action": "received_digests"}`` with the admin key,
  one dict per server rank: the digest of the last tensor the rank received under each name through
  ``/update_weights_from_{disk,tensor,distributed}`` (recorded as each arrives; an IPC load or a
  ``reset_tensors`` empties it).
* **Checked** (``PushedWeights.check``): every server rank's dict must equal that of the label the batch was made
  for (with ``newer_ok``: or of a later push of the same run), name for name: a changed, missing or extra tensor
  is ``ForeignWeightsError`` naming the server, the label, both digests and the tensors that differ
  (``moe_rl.sync.integrity.generate_checked`` re-syncs). ``rollout.check_served_weights=false`` turns it off.
"""

from __future__ import annotations

import hashlib
import json
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
    "PushedWeights",
    "digest",
    "hf_dir_digests",
    "served_digests",
    "tensor_digest",
    "tensor_digests",
]

KEEP_PUSHES = 4  # labels remembered by default: the current one and a few before it (async: max_staleness + 2)


def tensor_digest(tensor: torch.Tensor) -> str:
    """``"<dtype>:<shape x-joined>:<sha256 of its C-order bytes, 32 hex>"``, as patch 0014 digests what arrives."""
    t = tensor.detach()
    data = t.to("cpu").contiguous().reshape(-1).view(torch.uint8)
    shape = "x".join(str(d) for d in t.shape)
    return f"{str(t.dtype).removeprefix('torch.')}:{shape}:{hashlib.sha256(memoryview(data.numpy())).hexdigest()[:32]}"


def tensor_digests(named: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """The digest of every tensor of an HF-named state dict (as it is sent)."""
    return {name: tensor_digest(t) for name, t in named.items()}


def hf_dir_digests(hf_dir: str | Path) -> dict[str, str]:
    """The digests of the tensors SGLang loads from an HF directory: the index's files, else every safetensors."""
    hf_dir = Path(hf_dir)
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({hf_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(hf_dir.glob("*.safetensors"))
    digests: dict[str, str] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            digests |= {n: tensor_digest(f.get_tensor(n)) for n in f.keys()}  # noqa: SIM118
    return digests


def digest(entries: Mapping[str, str]) -> str:
    """One short hex digest of a set of entries (for logs and messages)."""
    h = hashlib.sha256()
    for name in sorted(entries):
        h.update(f"{name}={entries[name]};".encode())
    return h.hexdigest()[:16]


def served_digests(address: str, keys: ServerKeys | None, timeout_s: float = 60.0) -> list[dict[str, str]]:
    """Every server rank's received digests; ForeignWeightsStop when the server cannot say (one line)."""
    why = None
    try:
        resp = httpx.post(
            f"{address}/weights_checker",
            json={"action": "received_digests"},
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
            f"cannot check the weights {address} serves: /weights_checker received_digests failed ({why}); it needs "
            "the admin key and an SGLang with moe_rl's patch 0014 (python patches/apply.py), or set "
            "rollout.check_served_weights=false"
        )
    return [dict(r["checksums"]) for r in ranks]


def _differ(mine: Mapping[str, str], served: Mapping[str, str]) -> list[str]:
    """The names whose digests differ, each marked: changed, ``(missing)`` on the server or ``(extra)`` there."""
    out = []
    for name in sorted(set(mine) | set(served)):
        if name not in served:
            out.append(f"{name} (missing)")
        elif name not in mine:
            out.append(f"{name} (extra)")
        elif mine[name] != served[name]:
            out.append(name)
    return out


class PushedWeights:
    """The digests of the last ``keep`` pushes, by label; ``check`` compares the servers' received digests."""

    def __init__(self, keys: ServerKeys | None = None, timeout_s: float = 60.0, keep: int = KEEP_PUSHES):
        self.keys, self.timeout_s, self.keep = keys, timeout_s, keep
        self.by_label: OrderedDict[str, dict[str, str]] = OrderedDict()

    def remember(self, label: str, digests: Mapping[str, str]) -> None:
        """``digests``: ``name -> tensor_digest`` of every tensor just pushed as ``label``."""
        self.by_label.pop(str(label), None)
        self.by_label[str(label)] = dict(digests)
        while len(self.by_label) > self.keep:
            self.by_label.popitem(last=False)

    def remember_hf_dir(self, label: str, hf_dir: str | Path) -> None:
        """The same for a push from an HF checkpoint directory (reads every tensor SGLang loads from it)."""
        self.remember(label, hf_dir_digests(hf_dir))

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
        """ForeignWeightsError unless every server rank received the tensors pushed as ``label`` (module doc)."""
        pushed = dict(self.by_label)  # a snapshot: the trainer may push (partial rollouts) while a producer checks
        labels = self._acceptable(pushed, label, newer_ok)
        if not labels:  # nothing pushed under this label by this trainer: nothing to compare with
            raise ForeignWeightsStop(f"no push of {label!r} is known to this trainer: cannot check the served weights")
        for address in addresses:
            for rank, served in enumerate(served_digests(address.rstrip("/"), self.keys, self.timeout_s)):
                if not any(served == pushed[lb] for lb in labels):
                    mine = pushed[labels[0]]
                    differ = _differ(mine, served)
                    raise ForeignWeightsError(
                        f"foreign weights on {address} (rank {rank}): label {label!r} serves digest "
                        f"{digest(served)}, the trainer pushed {digest(mine)} ({len(differ)} of {len(mine)} "
                        f"tensors differ, e.g. {differ[:2]})"
                    )

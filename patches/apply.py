"""Apply moe_rl's source patches to an installed (or extracted) SGLang, idempotently.

Owns: finding the sglang package, refusing a version no patch set was written for, and applying
`patches/sglang/<version>/*.patch` in name order with GNU patch (`-p1`, fuzz 0) relative to the
directory that holds the `sglang/` package. A patch whose reverse applies cleanly is already in
place and is skipped, so running this twice is a no-op. A patch that applies neither way means the
installed files differ from the pristine wheel: that is an error, never a partial application.

Usage: python patches/apply.py [--check] [--root DIR --version X.Y.Z]
  (no --root: the sglang installed in this interpreter's environment)
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PATCH_ROOT = Path(__file__).resolve().parent / "sglang"


class PatchError(RuntimeError):
    """A patch set is missing for this version, or a patch neither applies nor is applied."""


@dataclass(frozen=True)
class PatchStatus:
    name: str
    state: str  # "applied" (just now), "already-applied", "would-apply" (check mode)


def supported_versions() -> list[str]:
    return sorted(p.name for p in PATCH_ROOT.iterdir() if p.is_dir())


def patches_for(version: str) -> list[Path]:
    """The ordered patch files written for `version`; PatchError for any other version."""
    directory = PATCH_ROOT / version
    patches = sorted(directory.glob("*.patch")) if directory.is_dir() else []
    if not patches:
        raise PatchError(
            f"no moe_rl patches written for sglang {version!r}; patch sets exist for "
            f"{supported_versions()} (pin sglang to one of them or port the patches)"
        )
    return patches


def installed_sglang() -> tuple[str, Path]:
    """(version, directory holding the `sglang/` package) of this interpreter's sglang."""
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError as err:
        raise PatchError(f"sglang is not installed in {sys.prefix}") from err
    spec = importlib.util.find_spec("sglang")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise PatchError(f"sglang {version} has metadata but no importable package")
    return version, Path(list(spec.submodule_search_locations)[0]).parent


def _patch_runs(patch: Path, root: Path, *extra: str) -> bool:
    cmd = ["patch", "-p1", "--fuzz=0", "--force", "--silent", "-d", str(root), *extra]
    with patch.open("rb") as f:
        return subprocess.run(cmd, stdin=f, capture_output=True).returncode == 0


def apply_patches(root: Path, version: str, *, check: bool = False) -> list[PatchStatus]:
    """Apply every patch for `version` under `root` (the dir holding `sglang/`); see module doc."""
    statuses = []
    for patch in patches_for(version):
        if _patch_runs(patch, root, "--dry-run", "--reverse"):
            statuses.append(PatchStatus(patch.name, "already-applied"))
        elif _patch_runs(patch, root, "--dry-run", "--forward"):
            if not check:
                if not _patch_runs(patch, root, "--forward", "--no-backup-if-mismatch"):
                    raise PatchError(f"{patch.name} passed its dry run but failed on {root}")
            statuses.append(PatchStatus(patch.name, "would-apply" if check else "applied"))
        else:
            raise PatchError(
                f"{patch.name} neither applies to nor is applied in {root}/sglang: the files "
                f"differ from the pristine sglang {version} wheel (reinstall it with --force-reinstall)"
            )
    return statuses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report only; exit 1 if any is unapplied")
    parser.add_argument("--root", type=Path, help="directory holding an extracted `sglang/` package")
    parser.add_argument("--version", help="sglang version of --root")
    args = parser.parse_args(argv)
    if (args.root is None) != (args.version is None):
        parser.error("--root and --version go together")
    try:
        version, root = (args.version, args.root) if args.root else installed_sglang()
        statuses = apply_patches(root, version, check=args.check)
    except PatchError as err:
        print(f"patches/apply.py: error: {err}", file=sys.stderr)
        return 2
    for s in statuses:
        print(f"sglang {version}: {s.name}: {s.state}")
    return 1 if args.check and any(s.state == "would-apply" for s in statuses) else 0


if __name__ == "__main__":
    sys.exit(main())

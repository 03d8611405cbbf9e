"""Tampering helpers for checkpoint tests: what an attacker with write access can do."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from elastic_rt.checkpoint.checksum import checksum_of
from elastic_rt.checkpoint.manifest import MANIFEST_FILE, sealed_json


def read_manifest_json(folder: Path) -> dict[str, Any]:
    return json.loads((folder / MANIFEST_FILE).read_text())


def write_manifest_json(folder: Path, body: dict[str, Any], *, reseal: bool = True) -> None:
    """Write ``body`` as the manifest, with a matching checksum unless ``reseal`` is false."""
    data = sealed_json(body) if reseal else json.dumps(body).encode()
    (folder / MANIFEST_FILE).write_bytes(data)


def plant(folder: Path, filename: str, data: bytes) -> None:
    """Replace a file and fix up the manifest (sizes, checksums, its own checksum)."""
    (folder / filename).write_bytes(data)
    body = read_manifest_json(folder)
    for entry in body["files"]:
        if entry["path"] == filename:
            entry["size"], entry["checksum"] = len(data), checksum_of(data)
    write_manifest_json(folder, body)


def age(folder: Path, seconds: float) -> None:
    """Make ``folder`` and its files look last changed ``seconds`` ago (a crashed
    writer's leftovers, as retention sees them once the grace period is over)."""
    past = time.time() - seconds
    for path in [*folder.iterdir(), folder]:
        os.utime(path, (past, past))

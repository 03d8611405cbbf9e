"""The root cause of a job's failure: which rank failed, where, when, and with what.

torchrun prints a table like this once, when a job fails. Here it is a value that the
agent which saw the failure builds from its worker's error file (the file torch's
``@record`` writes at ``TORCHELASTIC_ERROR_FILE``, and that :func:`write_error_file`
writes the same way for ``elastic_rt.run``'s workers), stores under the run's
``root_cause`` key, and prints; ``elastic-rt status`` reads it back. Pure apart from
the two file functions.

Note: a worker killed by a signal writes no error file; its cause is the exit code only.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class RootCause:
    """One failed worker, as the failure's table shows it."""

    round: int
    rank: int
    """The global rank in ``round``."""
    node: str
    host: str
    time_ms: int
    exitcode: int
    error: str = ""
    """``Type: message`` from the error file; empty when there was none."""
    traceback: str = ""
    step: int | None = None
    """The job's last completed step when it failed, when the workers report steps."""

    @property
    def has_exception(self) -> bool:
        return bool(self.error)

    @property
    def signature(self) -> tuple[str, str, int | None]:
        """What makes two failures "the same": exception, where it was raised, step."""
        return self.error, _innermost_frame(self.traceback), self.step

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> RootCause | None:
        """The stored value; None for anything that is not one (never raises)."""
        try:
            fields = json.loads(data)
            return cls(**fields) if isinstance(fields, dict) else None
        except (ValueError, TypeError):
            return None

    def summary(self) -> str:
        """One line: ``rank 3 on host-b (node-b) at step 7: ValueError: bad``."""
        where = f"rank {self.rank} on {self.host} ({self.node})"
        step = f" at step {self.step}" if self.step is not None else ""
        what = self.error or f"exit code {self.exitcode} (no error file)"
        return f"{where}{step}: {what}"

    def table(self) -> str:
        """torchrun's root-cause block: time, host, rank, exit code, error, traceback."""
        when = time.strftime("%Y-%m-%d_%H:%M:%S", time.localtime(self.time_ms / 1000))
        rule = "=" * 60
        lines = [rule, "Root Cause (first observed failure):", f"  time      : {when}",
                 f"  host      : {self.host} (node {self.node})",
                 f"  rank      : {self.rank} (round {self.round})",
                 f"  exitcode  : {self.exitcode}"]  # fmt: skip
        if self.step is not None:
            lines.append(f"  step      : {self.step}")
        lines.append(f"  error     : {self.error or '<no error file: see the worker log>'}")
        if self.traceback:
            lines += ["  traceback :", *(f"    {t}" for t in self.traceback.rstrip().splitlines())]
        return "\n".join([*lines, rule])


@dataclass(frozen=True, slots=True)
class ErrorRecord:
    """What a worker's error file says."""

    error: str
    traceback: str = ""
    time_s: int | None = None
    step: int | None = None
    """Our addition to torch's format: the step that raised (``elastic_rt.run``)."""


def read_error_file(path: str) -> ErrorRecord | None:
    """torch's error-file JSON; None if absent or not that format."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            message: Any = json.load(f)["message"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if isinstance(message, str):
        return ErrorRecord(message)
    if not isinstance(message, dict):
        return None
    extra = message.get("extraInfo") or {}
    stamp, step = str(extra.get("timestamp", "")), extra.get("step")
    return ErrorRecord(str(message.get("message", "")), str(extra.get("py_callstack", "")),
                       int(stamp) if stamp.isdigit() else None,
                       step if isinstance(step, int) else None)  # fmt: skip


def write_error_file(path: str, exc: BaseException, *, step: int | None = None) -> bool:
    """Write ``exc`` where torch's ``@record`` would, in its format, unless already there.

    Returns whether the file now holds ``exc`` (False without a path, or when it existed).
    """
    if not path or os.path.exists(path):
        return False
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    extra: dict[str, Any] = {"py_callstack": tb, "timestamp": str(int(time.time()))}
    if step is not None:
        extra["step"] = step
    data = {"message": {"message": f"{type(exc).__name__}: {exc}", "extraInfo": extra}}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)
    return True


def _innermost_frame(tb: str) -> str:
    """The last ``File "...", line N`` of a traceback: where the exception was raised."""
    frames = [line.strip() for line in tb.splitlines() if line.strip().startswith("File ")]
    return frames[-1] if frames else ""

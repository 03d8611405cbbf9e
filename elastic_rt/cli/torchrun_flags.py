"""torchrun's launch flags that need more than a plain ``add_argument``.

``elastic-rt launch`` takes torchrun's flags with torchrun's meaning where they
mean something here. The ones that cannot (torchrun's static rendezvous, its
Python-side plug-ins) are still recognised, so a torchrun user gets one line
naming the alternative instead of argparse's "unrecognized arguments". The same
table is the "Coming from torchrun" page (docs/torchrun.md), which a test checks
against torchrun's own parser.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from datetime import timedelta
from typing import Any, Sequence

from elastic_rt.errors import ConfigError

REFUSED: dict[str, tuple[bool, str]] = {
    # flag: (takes a value, the one-line alternative)
    "--event-log-handler": (True, "Use --events-file PATH (JSON-lines events) instead."),
    "--logs-specs": (True, "Use --log-dir with -r/--redirects and -t/--tee instead."),
    "--duplicate-stdout-filters": (True, "Use -t/--tee with --log-dir, then grep the log files."),
    "--duplicate-stderr-filters": (True, "Use -t/--tee with --log-dir, then grep the log files."),
    "--numa-binding": (True, "Wrap the worker: --no-python numactl --cpunodebind=N python x.py."),
    "--signals-to-handle": (True, "The agent handles SIGTERM and SIGINT (a graceful leave)."),
    "--virtual-local-rank": (
        False, "Call torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) in the script.",
    ),
}  # fmt: skip
"""torchrun flags recognised only to be refused, with the alternative."""

RDZV_CONF_KEYS = {"join_timeout": "--join-timeout", "last_call_timeout": "--last-call",
                  "read_timeout": "--etcd-wait"}
"""torchrun ``--rdzv-conf`` keys that mean something here, and our flag for each."""


class Refuse(argparse.Action):
    """Records a refused torchrun flag; :func:`check_refused` turns it into one line."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, "refused", self.option_strings[0])


def add_refused(parser: argparse.ArgumentParser) -> None:
    """Recognise every flag in :data:`REFUSED`, hidden from ``--help``."""
    parser.set_defaults(refused=None)
    for flag, (takes_value, _) in REFUSED.items():
        spellings = [flag, "--" + flag[2:].replace("-", "_")]
        parser.add_argument(
            *spellings, action=Refuse, nargs=1 if takes_value else 0, help=argparse.SUPPRESS
        )


def check_refused(args: argparse.Namespace) -> None:
    """Raises:
    ConfigError: a refused torchrun flag was given.
    """
    if args.refused:
        raise ConfigError(
            f"{args.refused} is a torchrun flag elastic-rt does not support",
            REFUSED[args.refused][1],
        )


def port(text: str) -> int:
    """argparse type: a TCP port, 1-65535."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port; pass 1-65535")
    return value


def resolve_nproc(text: str) -> int:
    """torchrun's ``--nproc-per-node``: a number, ``cpu``, ``gpu``, ``xpu`` or ``auto``.

    Devices are counted in a child interpreter: the agent itself never imports torch
    (it stays under 100 MB and starts fast), and the child sees the same
    ``CUDA_VISIBLE_DEVICES`` the workers will.

    Raises:
        ConfigError: an unknown value, fewer than 1, or no device of the kind asked for.
    """
    if text.lstrip("-").isdigit():
        count = int(text)
    elif text == "cpu":
        count = len(os.sched_getaffinity(0))
    elif text in ("gpu", "xpu", "auto"):
        count = _count_devices(text)
    else:
        raise ConfigError(
            f"--nproc-per-node {text!r} is not a number of workers",
            "Pass a number, cpu, gpu, xpu or auto (torchrun's values).",
        )
    if count < 1:
        raise ConfigError(f"--nproc-per-node {text} gives {count} workers", "Pass 1 or more.")
    return count


_COUNT_DEVICES = """
import json, os, torch
kind = {kind!r}
if kind == "auto" and torch.accelerator.is_available():
    print(json.dumps(torch.accelerator.device_count()))
elif kind == "auto":
    print(json.dumps(len(os.sched_getaffinity(0))))
else:
    module = torch.cuda if kind == "gpu" else torch.xpu
    print(json.dumps(module.device_count() if module.is_available() else 0))
"""


def _count_devices(kind: str) -> int:
    result = subprocess.run(
        [sys.executable, "-c", _COUNT_DEVICES.format(kind=kind)],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    if result.returncode != 0:
        raise ConfigError(
            f"--nproc-per-node {kind} needs torch to count devices, and it failed to import",
            "Pass a number of workers instead.",
        )
    count = int(json.loads(result.stdout.strip().splitlines()[-1]))
    if count == 0:
        raise ConfigError(f"--nproc-per-node {kind}: no {kind.upper()} is visible here",
                          "Pass a number, or cpu.")  # fmt: skip
    return count


def parse_rdzv_conf(text: str) -> dict[str, timedelta]:
    """torchrun's ``--rdzv-conf k1=v1,k2=v2`` -> the timeouts it sets here.

    Raises:
        ConfigError: a malformed pair, an unknown key or a value that is not seconds.
    """
    found: dict[str, timedelta] = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in RDZV_CONF_KEYS:
            known = ", ".join(f"{k} (or {flag})" for k, flag in RDZV_CONF_KEYS.items())
            raise ConfigError(f"--rdzv-conf {item!r} is not a setting elastic-rt has",
                              f"Known keys: {known}.")  # fmt: skip
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if seconds <= 0:
            raise ConfigError(f"--rdzv-conf {key}={value} is not a number of seconds",
                              f"Pass {key}=SECONDS, above 0.")  # fmt: skip
        found[key] = timedelta(seconds=seconds)
    return found

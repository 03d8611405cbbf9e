"""The operator subcommands: ``etcd`` (a shared etcd in the foreground), ``status``,
``checkpoint ls|verify`` and ``timeline``.

Each reads flags and calls one function elsewhere (``elastic_rt.etcd_server``,
``elastic_rt.ops``, ``elastic_rt.checkpoint.inspect``); their imports are lazy, so
``elastic-rt --help`` loads neither matplotlib nor the storage drivers.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from elastic_rt import config as cfg
from elastic_rt.cli import flags, torchrun_flags
from elastic_rt.errors import ConfigError


# etcd -----------------------------------------------------------------------------
def add_etcd(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = commands.add_parser("etcd", help="run an etcd in the foreground for local agents")
    p.add_argument("--port", type=torchrun_flags.port, default=None,
                   help="client port (default: a free one)")
    p.add_argument("--data-dir", default=None, help="keep data here (default: a temporary dir)")
    p.set_defaults(func=_etcd)


def _etcd(args: argparse.Namespace) -> int:
    import signal
    import threading

    from elastic_rt.etcd_server import EtcdServer

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with EtcdServer(port=args.port, data_dir=args.data_dir) as server:
        print(f"etcd://{server.endpoint}", flush=True)
        try:
            stop.wait()
        except KeyboardInterrupt:
            pass
    return 0


# status, checkpoint, timeline -------------------------------------------------------
def add_status(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = commands.add_parser("status", help="show a run: nodes, round, step and rate, layout, "
                                           "checkpoint, budget, root cause")
    p.add_argument("--run-id", required=True)
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", required=True, help="etcd://host:port")
    p.add_argument("--events-file", default=None, help="also summarise this event log")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    flags.add_etcd_auth(p)
    p.set_defaults(func=_status)


def _status(args: argparse.Namespace) -> int:
    from elastic_rt.ops.status import show_status

    cfg.check_run_id(args.run_id)
    endpoint, tls = flags.parse_endpoint(args.rdzv_endpoint)
    print(show_status(endpoint, args.run_id, auth=flags.auth(args, tls),
                      events_file=args.events_file, as_json=args.json))
    return 0


def add_checkpoint(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = commands.add_parser("checkpoint", help="inspect checkpoints on a URL")
    sub = p.add_subparsers(dest="action", required=True)
    for name, text in (("ls", "list checkpoints"), ("verify", "check every file's checksum")):
        q = sub.add_parser(name, help=text)
        q.add_argument("url", help="path, file://, s3://bucket/prefix or memory://")
        q.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                       help="an fsspec storage option, e.g. endpoint_url=http://host:9000, "
                            "profile=NAME, anon=true (repeatable)")
        q.set_defaults(func=_checkpoint)


def parse_storage_options(items: Sequence[str]) -> dict[str, object]:
    """``KEY=VALUE`` pairs as fsspec options; ``true``/``false`` become booleans.

    Raises:
        ConfigError: an item is not ``KEY=VALUE``.
    """
    options: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ConfigError(f"--storage-option {item!r} is not KEY=VALUE",
                              "Pass for example --storage-option endpoint_url=http://host:9000.")
        options[key.strip()] = {"true": True, "false": False}.get(value.lower(), value)
    return options


def _checkpoint(args: argparse.Namespace) -> int:
    from elastic_rt.checkpoint import inspect
    from elastic_rt.checkpoint.storage import quiet_drivers
    from elastic_rt.errors import CheckpointError

    options = parse_storage_options(args.storage_option)
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        quiet_drivers()
    try:
        if args.action == "ls":
            for line in inspect.ls(args.url, options):
                print(line)
            return 0
        ok, lines = inspect.verify(args.url, options)
    except CheckpointError as exc:  # storage failed mid-way: one line, not a traceback
        print(f"elastic-rt: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    return 0 if ok else 1


def add_timeline(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = commands.add_parser("timeline", help="draw a run's events as a picture")
    p.add_argument("events", nargs="+", help="JSON-lines event files")
    p.add_argument("-o", "--output", default="run.png", help="image to write (.png or .svg)")
    p.set_defaults(func=_timeline)


def _timeline(args: argparse.Namespace) -> int:
    from elastic_rt.ops.timeline_draw import draw_timeline

    path = draw_timeline(args.events, args.output)
    print(path)
    return 0

"""``elastic-rt``: launch | etcd | status | checkpoint | timeline.

Parses flags and calls one function per subcommand. A :class:`UserError` becomes
one line, ``elastic-rt: error: <problem>. <fix>``, and exit code 2; anything else
is a bug and keeps its traceback. What a subcommand does lives outside this package
(the agent, the etcd server, the operator tools); here are only flags and their checks.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import NoReturn, Sequence

from elastic_rt import config as cfg
from elastic_rt.cli import launch, tools
from elastic_rt.errors import ConfigError, UserError

logger = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``elastic-rt`` command."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _configure_logging(os.environ.get(cfg.LOG_LEVEL_ENV, "INFO"))
        code = int(args.func(args) or 0)
    except UserError as exc:
        print(f"elastic-rt: error: {exc.one_line()}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    if args.command == "launch":
        # The agent has stopped its workers, left the rendezvous and closed etcd; all that
        # is left is interpreter teardown, where gRPC's channel finalizers have been seen to
        # hang on a lock a dead watch thread held. A launcher must exit with its code.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _configure_logging(level: str) -> None:
    """Log to stderr at ``level``; an unknown level name is a user error, not a traceback."""
    if not isinstance(logging.getLevelName(level.upper()), int):
        raise ConfigError(f"{cfg.LOG_LEVEL_ENV}={level!r} is not a log level",
                          "Use DEBUG, INFO, WARNING or ERROR.")
    logging.basicConfig(
        level=level.upper(),
        format="[%(asctime)s] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


class _OneLineParser(argparse.ArgumentParser):
    """Usage mistakes get one line naming the problem and where help is, like every
    other user error here (argparse alone prints the whole usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: every subcommand with its flags."""
    parser = _OneLineParser(prog="elastic-rt", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    launch.add_launch(commands)
    tools.add_etcd(commands)
    tools.add_status(commands)
    tools.add_checkpoint(commands)
    tools.add_timeline(commands)
    return parser

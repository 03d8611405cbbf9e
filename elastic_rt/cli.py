"""``elastic-rt``: launch | etcd | status | checkpoint | timeline.

Parses flags and calls one function per subcommand. A :class:`UserError` becomes
one line, ``elastic-rt: error: <problem>. <fix>``, and exit code 2; anything else
is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import sys
from datetime import timedelta
from typing import Callable, NoReturn, Sequence, TypeVar

from agents.output import OutputSpec, parse_ranks, parse_std
from elastic_rt import config as cfg
from elastic_rt import torchrun_flags as flags
from elastic_rt.errors import ConfigError, UnknownURLSchemeError, UserError

logger = logging.getLogger(__name__)
_T = TypeVar("_T")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``elastic-rt`` command."""
    parser = _parser()
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


def _seconds(text: str) -> timedelta:
    """An argparse type: a flag's value in seconds, kept as a duration from here on."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not seconds >= 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds")
    return timedelta(seconds=seconds)


class _OneLineParser(argparse.ArgumentParser):
    """Usage mistakes get one line naming the problem and where help is, like every
    other user error here (argparse alone prints the whole usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="elastic-rt", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    _add_launch(commands)
    _add_etcd(commands)
    _add_status(commands)
    _add_checkpoint(commands)
    _add_timeline(commands)
    return parser


# launch ---------------------------------------------------------------------------
def _add_launch(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """torchrun's flags and spellings (docs/torchrun.md maps each one), then ours."""
    p = commands.add_parser("launch", help="run a training script on this node, elastically")
    p.add_argument("--nnodes", default="1", help="N or MIN:MAX nodes (torchrun's meaning)")
    p.add_argument("--nproc-per-node", "--nproc_per_node", default="1",
                   help="workers on this node: a number, cpu, gpu, xpu or auto (torchrun's values)")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default="",
                   help="etcd://host:port of the rendezvous (a cluster: "
                        "etcd://h1:2379,h2:2379,...); none starts a private etcd on 127.0.0.1")
    p.add_argument("--rdzv-backend", "--rdzv_backend", default="etcd", help="only 'etcd' (v3 API)")
    p.add_argument("--rdzv-conf", "--rdzv_conf", default="",
                   help="torchrun's k=v,... settings: join_timeout, last_call_timeout (seconds)")
    p.add_argument("--standalone", action="store_true",
                   help="a private rendezvous on this host (the default when no --rdzv-endpoint)")
    p.add_argument("--run-id", "--rdzv-id", "--rdzv_id", dest="run_id", default="default",
                   help="names the job; two run ids on one etcd never meet")
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=cfg.DEFAULT_MAX_RESTARTS,
                   help="worker failures the whole job absorbs (membership changes are free)")
    p.add_argument("--monitor-interval", "--monitor_interval", type=_seconds,
                   default=cfg.DEFAULT_MONITOR_INTERVAL, help="seconds between worker checks")
    p.add_argument("--start-method", "--start_method", choices=("spawn", "fork", "forkserver"),
                   default="spawn", help="accepted for torchrun scripts; workers are always new "
                                         "processes (torchrun ignores it for scripts too)")
    p.add_argument("--shutdown-timeout", "--shutdown_timeout", type=_seconds,
                   default=timedelta(seconds=3),
                   help="seconds from SIGTERM to SIGKILL when stopping workers (default 3)")
    _add_output(p)
    _add_static(p)
    # None: the environment decides, read in _launch, inside main's error guard.
    p.add_argument("--lease-ttl", type=_seconds, default=None,
                   help=f"seconds a silent node stays a member (env {cfg.LEASE_TTL_ENV}, "
                        f"default {cfg.DEFAULT_LEASE_TTL.total_seconds():g})")
    # None: torchrun's --rdzv-conf key decides, else the default (see _rdzv_seconds).
    p.add_argument("--last-call", type=_seconds, default=None,
                   help="seconds to wait for more nodes once MIN have joined "
                        f"(default {cfg.DEFAULT_LAST_CALL.total_seconds():g})")
    p.add_argument("--join-timeout", type=_seconds, default=None,
                   help="seconds to wait for MIN nodes before giving up "
                        f"(default {cfg.DEFAULT_JOIN_TIMEOUT.total_seconds():g})")
    # None: the environment decides, else the default (precedence CLI > env > default).
    p.add_argument("--hang-factor", type=float, default=None,
                   help="report ranks with no step for this many median step times, with "
                        f"their stacks (env {cfg.HANG_FACTOR_ENV}, "
                        f"default {cfg.DEFAULT_HANG_FACTOR:g}; 0 turns it off)")
    p.add_argument("--node-id", default=None, help="this node's name (default host-pid)")
    p.add_argument("--local-addr", "--local_addr", default=None,
                   help="address peers reach this node at "
                        "(default 127.0.0.1 for a loopback endpoint)")
    p.add_argument("--etcd-port", type=flags.port, default=None,
                   help="client port of the private etcd")
    p.add_argument("--events-file", default=os.environ.get(cfg.EVENTS_FILE_ENV),
                   help="append JSON-lines events here")
    _add_etcd_auth(p)
    flags.add_refused(p)
    p.add_argument("-m", "--module", action="store_true", help="run the script as 'python -m'")
    p.add_argument("--no-python", "--no_python", action="store_true",
                   help="run the script as a program")
    p.add_argument("--run-path", "--run_path", action="store_true",
                   help="run the script with runpy.run_path (in a fresh interpreter per worker)")
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    p.set_defaults(func=_launch)


def _add_output(p: argparse.ArgumentParser) -> None:
    p.add_argument("--role", default="default",
                   help="ROLE_NAME of the workers and their log prefix")
    p.add_argument("--log-dir", "--log_dir", default=None,
                   help="base directory for the workers' log and error files (created if missing)")
    p.add_argument("-r", "--redirects", default="0",
                   help="streams into files in --log-dir: 1 stdout, 2 stderr, 3 both, "
                        "or 0:3,1:2 per local rank")
    p.add_argument("-t", "--tee", default="0",
                   help="as --redirects, and also to this console prefixed [<role><local_rank>]:")
    p.add_argument("--local-ranks-filter", "--local_ranks_filter", default="",
                   help="only these local ranks (e.g. 0,1) reach the console")


def _add_static(p: argparse.ArgumentParser) -> None:
    text = "torchrun's static rendezvous; on one node only (multi-node: --rdzv-endpoint)"
    p.add_argument("--node-rank", "--node_rank", type=int, default=None, help=text)
    p.add_argument("--master-addr", "--master_addr", default=None, help=text)
    p.add_argument("--master-port", "--master_port", type=flags.port, default=None, help=text)


def _add_etcd_auth(p: argparse.ArgumentParser) -> None:
    env = os.environ
    p.add_argument("--etcd-cacert", default=env.get(cfg.ETCD_CACERT_ENV),
                   help="CA of etcd's TLS certificate")
    p.add_argument("--etcd-cert", default=env.get(cfg.ETCD_CERT_ENV), help="client certificate")
    p.add_argument("--etcd-key", default=env.get(cfg.ETCD_KEY_ENV), help="client key")
    p.add_argument("--etcd-user", default=env.get(cfg.ETCD_USER_ENV),
                   help=f"etcd user; the password comes from {cfg.ETCD_PASSWORD_ENV}")


def _auth(args: argparse.Namespace, tls: bool = False) -> cfg.EtcdAuth:
    for flag in ("etcd_cacert", "etcd_cert", "etcd_key"):
        path = getattr(args, flag)
        if path and not os.path.isfile(path):
            raise ConfigError(f"--{flag.replace('_', '-')} {path} does not exist",
                              "Pass the path of a PEM file.")
    if bool(args.etcd_cert) != bool(args.etcd_key):
        raise ConfigError("--etcd-cert and --etcd-key go together", "Pass both or neither.")
    _check_pem(args.etcd_cacert, args.etcd_cert, args.etcd_key)
    password = os.environ.get(cfg.ETCD_PASSWORD_ENV)
    if args.etcd_user and not password:
        raise ConfigError(f"--etcd-user {args.etcd_user} has no password",
                          f"Set {cfg.ETCD_PASSWORD_ENV}.")
    return cfg.EtcdAuth(
        cacert=args.etcd_cacert, cert=args.etcd_cert, key=args.etcd_key,
        user=args.etcd_user, password=password if args.etcd_user else None, tls=tls,
    )  # fmt: skip


def _check_pem(cacert: str | None, cert: str | None, key: str | None) -> None:
    """Load the TLS files as the client will, so a wrong file is named before any
    connection (gRPC would report it later as a handshake failure, blaming the server)."""
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if cacert:
        try:
            context.load_verify_locations(cafile=cacert)
        except (ssl.SSLError, OSError):
            raise ConfigError(f"--etcd-cacert {cacert} cannot be read as a PEM certificate",
                              "Pass the CA certificate that signed etcd's server "
                              "certificate (a file with -----BEGIN CERTIFICATE-----).") from None
    if cert and key:
        try:
            context.load_cert_chain(cert, key, password="")
        except (ssl.SSLError, OSError):
            raise ConfigError(f"--etcd-cert {cert} and --etcd-key {key} cannot be read as a PEM "
                              "certificate and its unencrypted private key",
                              "Pass the client certificate and the key it was issued "
                              "for, both PEM.") from None


def parse_endpoint(text: str) -> tuple[str, bool]:
    """``etcd://host:port``, ``etcds://host:port`` (TLS) or ``host:port`` -> (host:port, tls).

    Several members of one etcd cluster are separated by commas
    (``etcd://h1:2379,h2:2379,h3:2379``) and come back the same way.
    """
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "etcd", text
    if scheme not in ("etcd", "etcds", "http", "https"):
        raise UnknownURLSchemeError(
            f"rendezvous endpoint {text!r} has the unknown scheme {scheme!r}",
            "Use etcd://host:port (or etcds://host:port for TLS).",
        )
    members = [member.strip().rstrip("/") for member in rest.rstrip("/").split(",")]
    for member in members:
        host, _, port = member.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ConfigError(f"rendezvous endpoint {text!r} is not host:port with a port 1-65535",
                              "Use etcd://host:port (a cluster: etcd://h1:2379,h2:2379,h3:2379).")
    return ",".join(members), scheme in ("etcds", "https")


_RUN_PATH = (
    "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)
"""torchrun's --run-path: the script runs through runpy, argv as it would see it."""


def _worker_command(args: argparse.Namespace) -> list[str]:
    if sum((args.no_python, args.module, args.run_path)) > 1:
        raise ConfigError("--no-python, -m and --run-path exclude one another", "Pass one of them.")
    if args.no_python:
        if not shutil.which(args.script):
            raise ConfigError(f"--no-python program {args.script} is not found or not executable",
                              "Check the name and PATH, or drop --no-python for a Python script.")
        return [args.script, *args.script_args]
    if args.module:
        return [sys.executable, "-u", "-m", args.script, *args.script_args]
    if not os.path.isfile(args.script):
        raise ConfigError(f"training script {args.script} does not exist", "Check the path.")
    if args.run_path:
        return [sys.executable, "-u", "-c", _RUN_PATH, args.script, *args.script_args]
    return [sys.executable, "-u", args.script, *args.script_args]


def _check_rendezvous_flags(args: argparse.Namespace, max_nodes: int) -> None:
    """torchrun's rendezvous flags that have no etcd meaning: refused, or harmless on one node."""
    flags.check_refused(args)
    if args.rdzv_backend not in ("etcd", "etcd-v3"):
        raise ConfigError(f"--rdzv-backend {args.rdzv_backend} is not supported",
                          "Use --rdzv-backend etcd (`elastic-rt etcd` runs one).")  # fmt: skip
    if args.standalone and args.rdzv_endpoint:
        raise ConfigError("--standalone starts a private rendezvous, --rdzv-endpoint names one",
                          "Pass one of them.")  # fmt: skip
    static = [(name, value) for name, value in (("--node-rank", args.node_rank),
              ("--master-addr", args.master_addr), ("--master-port", args.master_port))
              if value is not None]  # fmt: skip
    if static and (max_nodes > 1 or args.node_rank not in (None, 0)):
        raise ConfigError(
            f"{static[0][0]} {static[0][1]} belongs to torchrun's static rendezvous; "
            "elastic-rt ranks nodes through etcd",
            "Drop it, run `elastic-rt etcd` on one host and pass --rdzv-endpoint etcd://HOST:PORT.",
        )
    if static:
        names = ", ".join(name for name, _ in static)
        logger.warning("%s: not needed on one node; rank 0's store gets a free port each round "
                       "and MASTER_ADDR/MASTER_PORT tell the workers", names)


def _output(args: argparse.Namespace) -> OutputSpec:
    """torchrun's output flags -> where the workers' streams go (agents/output.py)."""
    streams = "0-3 (1 stdout, 2 stderr, 3 both) or LOCAL_RANK:N pairs like 0:3,1:1"
    redirects = _flag(f"Pass -r {streams}.", lambda: parse_std(args.redirects, "--redirects"))
    tee = _flag(f"Pass -t {streams}.", lambda: parse_std(args.tee, "--tee"))
    ranks = _flag("Pass local ranks separated by commas, like 0,1.",
                  lambda: parse_ranks(args.local_ranks_filter))  # fmt: skip
    if args.log_dir and os.path.exists(args.log_dir) and not os.path.isdir(args.log_dir):
        raise ConfigError(f"--log-dir {args.log_dir} is a file", "Pass a directory.")
    return OutputSpec(log_dir=args.log_dir, redirects=redirects, tee=tee, ranks_filter=ranks,
                      role=args.role)  # fmt: skip


def _flag(fix: str, parse: Callable[[], _T]) -> _T:
    """A parser's ValueError (it names the flag and value) plus ``fix`` -> a ConfigError."""
    try:
        return parse()
    except ValueError as exc:
        raise ConfigError(str(exc), fix) from None


def _rdzv_seconds(flag: timedelta | None, conf: timedelta | None, default: timedelta) -> timedelta:
    """Precedence: our flag, then torchrun's --rdzv-conf key, then the default."""
    return flag if flag is not None else conf if conf is not None else default


def _set_omp_threads(nproc: int) -> None:
    """torchrun's default: one OpenMP thread per worker, so N workers do not oversubscribe."""
    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        logger.warning(
            "\n*****************************************\n"
            "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, "
            "to avoid your system being overloaded, please further tune the variable for "
            "optimal performance in your application as needed. \n"
            "*****************************************"
        )
        os.environ["OMP_NUM_THREADS"] = "1"


def _launch(args: argparse.Namespace) -> int:
    from agents.agent import Agent
    from agents.config import AgentConfig
    from elastic_rt.etcd_server import EtcdServer, is_port_free

    min_nodes, max_nodes = cfg.parse_nnodes(args.nnodes)
    _check_rendezvous_flags(args, max_nodes)
    conf = flags.parse_rdzv_conf(args.rdzv_conf)
    nproc = flags.resolve_nproc(args.nproc_per_node)
    endpoint, tls = parse_endpoint(args.rdzv_endpoint) if args.rdzv_endpoint else ("", False)
    # Every value is checked before a private etcd starts: a mistake costs nothing to clean up.
    rendezvous = cfg.RendezvousConfig(
        run_id=args.run_id,
        endpoint=endpoint,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        lease_ttl=(args.lease_ttl or cfg.env_seconds(os.environ, cfg.LEASE_TTL_ENV)
                   or cfg.DEFAULT_LEASE_TTL),
        last_call=_rdzv_seconds(args.last_call, conf.get("last_call_timeout"),
                                cfg.DEFAULT_LAST_CALL),
        join_timeout=_rdzv_seconds(args.join_timeout, conf.get("join_timeout"),
                                   cfg.DEFAULT_JOIN_TIMEOUT),
        auth=_auth(args, tls),
    )  # fmt: skip
    command = _worker_command(args)
    output = _output(args)
    hang_factor = _hang_factor(args.hang_factor)
    heartbeat = cfg.HeartbeatConfig.from_env(os.environ)
    if not endpoint and args.etcd_port is not None and not is_port_free(args.etcd_port):
        # Checked here so the fix names launch's flag, not `elastic-rt etcd --port`.
        raise ConfigError(
            f"--etcd-port {args.etcd_port} is already in use on 127.0.0.1",
            "Pick another --etcd-port, or leave it out to get a free one.",
        )
    if output.log_dir:
        os.makedirs(output.log_dir, exist_ok=True)
    _set_omp_threads(nproc)
    server = None if endpoint else EtcdServer(port=args.etcd_port).start()
    try:
        if server is not None:
            rendezvous = dataclasses.replace(rendezvous, endpoint=server.endpoint)
            logger.info("private etcd at etcd://%s", server.endpoint)
        host = args.local_addr or (
            "127.0.0.1" if rendezvous.endpoint.split(":")[0] in ("127.0.0.1", "localhost")
            else _fqdn()
        )  # fmt: skip
        if host == "127.0.0.1":
            # Keep gloo on loopback too, whatever the host name resolves to.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        extra = {"node_id": args.node_id} if args.node_id else {}
        config = AgentConfig(
            rendezvous=rendezvous,
            command=command,
            nproc_per_node=nproc,
            max_restarts=args.max_restarts,
            monitor_interval=args.monitor_interval,
            hang_factor=hang_factor,
            heartbeat=heartbeat,
            grace_period=args.shutdown_timeout,
            host=host,
            events_file=args.events_file,
            output=output,
            **extra,
        )
        return Agent(config).run()
    finally:
        if server is not None:
            server.stop()


def _hang_factor(flag: float | None) -> float:
    """--hang-factor, else $ELASTIC_RT_HANG_FACTOR, else the default.

    Raises:
        ConfigError: a negative or infinite factor.
    """
    if flag is None:
        return cfg.env_factor(os.environ, cfg.HANG_FACTOR_ENV, cfg.DEFAULT_HANG_FACTOR)
    if not 0 <= flag < float("inf"):
        raise ConfigError(f"--hang-factor {flag} is not a non-negative number",
                          "Pass a number such as 10, or 0 to turn hang reports off.")
    return flag


def _fqdn() -> str:
    import socket

    return socket.getfqdn()


# etcd -----------------------------------------------------------------------------
def _add_etcd(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = commands.add_parser("etcd", help="run an etcd in the foreground for local agents")
    p.add_argument("--port", type=flags.port, default=None,
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
def _add_status(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = commands.add_parser("status", help="show a run: nodes, round, step and rate, layout, "
                                           "checkpoint, budget, root cause")
    p.add_argument("--run-id", required=True)
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", required=True, help="etcd://host:port")
    p.add_argument("--events-file", default=None, help="also summarise this event log")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_etcd_auth(p)
    p.set_defaults(func=_status)


def _status(args: argparse.Namespace) -> int:
    from elastic_rt.status import show_status

    cfg.check_run_id(args.run_id)
    endpoint, tls = parse_endpoint(args.rdzv_endpoint)
    print(show_status(endpoint, args.run_id, auth=_auth(args, tls), events_file=args.events_file,
                      as_json=args.json))
    return 0


def _add_checkpoint(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
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


def _add_timeline(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = commands.add_parser("timeline", help="draw a run's events as a picture")
    p.add_argument("events", nargs="+", help="JSON-lines event files")
    p.add_argument("-o", "--output", default="run.png", help="image to write (.png or .svg)")
    p.set_defaults(func=_timeline)


def _timeline(args: argparse.Namespace) -> int:
    from elastic_rt.timeline_draw import draw_timeline

    path = draw_timeline(args.events, args.output)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

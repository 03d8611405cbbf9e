"""``elastic-rt status``: one run's state in etcd, readable at a glance.

Reads every key of the run in one range request (the same read the agents poll
with), turns it into a :class:`RunStatus`, and prints it as a short table or as
JSON. With an event file it adds the recoveries and the last notable events.

The read is a snapshot: a round can form a moment after it. Nothing is written.

Keys read, under ``/elastic_rt/<run_id>/`` (see :mod:`elastic_rt.rendezvous.registry`):
``nodes/*``, ``round``, ``restarts``, ``max_restarts``, ``round-completing``, ``round-closed``,
``layout`` (JSON ``{"round", "layout": {"dp", "pp", "tp"}}``, written by rank 0),
``checkpoint`` (JSON ``{"name", "step", "url"}``, or a bare name), ``progress`` (JSON
``{"round", "step", "steps_per_s", "ms"}``, written by rank 0), ``root_cause`` (JSON, a
:class:`~elastic_rt.root_cause.RootCause`, written by the agent that saw the failure),
``leaving/*`` (JSON ``{"source", "detail", "since_ms", "deadline_ms", "at_boundary"}``: a
node that took a preemption notice or SIGTERM and leaves at its workers' next step boundary,
written on its lease by its agent).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from elastic_rt.config import EtcdAuth
from elastic_rt.errors import EndpointUnreachableError, StoreConnectionError, UnknownRunError
from elastic_rt.events import Event
from elastic_rt.rendezvous.kv import KeyValue, KVStore
from elastic_rt.rendezvous.registry import CLOSED, COMPLETING, LEAVING
from elastic_rt.rendezvous.rounds import NodeInfo, Round
from elastic_rt.root_cause import RootCause

logger = logging.getLogger(__name__)

ROOT = "/elastic_rt/"
NOTABLE = ("node.joined", "node.lost", "node.evicted", "node.preempting", "node.left",
           "round.formed", "worker.failed", "agent.fenced", "checkpoint.committed",
           "job.finished", "agent.exited")  # fmt: skip


@dataclass(frozen=True, slots=True)
class NodeStatus:
    node_id: str
    host: str
    nproc: int
    group_rank: int | None
    state: str
    """``in round``, ``waiting`` (registered, not a member), ``spare`` (waiting while the
    round has ``--nnodes`` MAX members: it replaces the next member lost), ``gone``
    (member, key expired), or ``leaving (...)`` (a member that took a notice: it leaves
    at its next step boundary)."""


@dataclass(frozen=True, slots=True)
class RunStatus:
    """Everything ``status`` shows; ``asdict`` of it is the JSON output."""

    run_id: str
    endpoint: str
    state: str
    round: dict[str, Any] | None
    nodes: list[NodeStatus]
    layout: dict[str, Any] | None
    checkpoint: dict[str, Any] | None
    restarts_used: int
    max_restarts: int | None
    progress: dict[str, Any] | None = None
    root_cause: dict[str, Any] | None = None
    shares: dict[str, Any] | None = None
    """The uneven split of the global batch rank 0 last published (stragglers), if any."""
    leaving: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per node that took a preemption notice: its agent's record, with ``leaves_in_s`` (the
    most it stays: it leaves at once then, if no step boundary came first)."""
    events: dict[str, Any] = field(default_factory=dict)

    @property
    def restarts_left(self) -> int | None:
        return None if self.max_restarts is None else max(self.max_restarts - self.restarts_used, 0)


def show_status(
    endpoint: str, run_id: str, *, auth: EtcdAuth, events_file: str | None, as_json: bool
) -> str:
    """The status of ``run_id`` on the etcd at ``endpoint``, as text or JSON.

    Raises:
        EndpointUnreachableError: etcd does not answer at ``endpoint``.
        UnknownRunError: etcd holds no keys for ``run_id``.
        CredentialsError: etcd refused the credentials in ``auth``.
        NoEventsError: ``events_file`` is missing or empty.
    """
    from elastic_rt.rendezvous.etcd_kv import EtcdKV

    try:
        kv = EtcdKV(endpoint, auth=auth, timeout=3.0)
        try:
            status = read_status(kv, run_id, endpoint=endpoint, now_ms=int(time.time() * 1000))
        finally:
            kv.close()
    except StoreConnectionError as exc:
        raise EndpointUnreachableError(
            f"cannot reach etcd at {endpoint}",
            "Check --rdzv-endpoint, and that etcd runs there (elastic-rt etcd).",
        ) from exc
    if events_file:
        status = _with_events(status, events_file)
    if as_json:
        return json.dumps({**asdict(status), "restarts_left": status.restarts_left}, indent=2)
    return render(status)


def read_status(kv: KVStore, run_id: str, *, endpoint: str, now_ms: int) -> RunStatus:
    """One range read of the run's keys, decoded.

    Raises:
        UnknownRunError: no key exists under the run's prefix.
        StoreConnectionError: etcd did not answer.
    """
    prefix = f"{ROOT}{run_id}/"
    items = {item.key[len(prefix):]: item for item in kv.get_prefix(prefix)}
    if not items:
        raise _unknown_run(kv, run_id, endpoint)
    return status_from_keys(run_id, items, endpoint=endpoint, now_ms=now_ms)


def _unknown_run(kv: KVStore, run_id: str, endpoint: str) -> UnknownRunError:
    runs = sorted({item.key[len(ROOT):].split("/", 1)[0] for item in kv.get_prefix(ROOT)})
    if runs:
        shown = ", ".join(runs[:8]) + (", ..." if len(runs) > 8 else "")
        fix = f"Runs on this etcd: {shown}."
    else:
        fix = "No run has used this etcd yet; start one with elastic-rt launch."
    return UnknownRunError(f"no run {run_id!r} on etcd at {endpoint}", fix)


def status_from_keys(
    run_id: str, items: dict[str, KeyValue], *, endpoint: str, now_ms: int
) -> RunStatus:
    """Decode the run's keys (names relative to its prefix). Pure."""
    registered = {}
    for name, item in items.items():
        if name.startswith("nodes/"):
            info = NodeInfo.from_json(item.value, joined_revision=item.create_revision)
            registered[info.node_id] = info
    round_kv = items.get("round")
    current = Round.from_json(round_kv.value, token=round_kv.mod_revision) if round_kv else None
    leaving = _leaving(items, now_ms)
    return RunStatus(
        run_id=run_id,
        endpoint=endpoint,
        state=_state(items, current, registered, leaving),
        round=_round_dict(current, now_ms),
        nodes=_nodes(current, registered, leaving, max_nodes=_int_key(items, "max_nodes")),
        layout=_json_key(items, "layout"),
        checkpoint=_json_key(items, "checkpoint", bare="name"),
        restarts_used=_int_key(items, "restarts") or 0,
        max_restarts=_int_key(items, "max_restarts"),
        progress=_json_key(items, "progress"),
        shares=_json_key(items, "shares"),
        root_cause=_root_cause(items),
        leaving=leaving,
    )


def _leaving(items: dict[str, KeyValue], now_ms: int) -> dict[str, dict[str, Any]]:
    found = {}
    for name, item in items.items():
        if not name.startswith(LEAVING):
            continue
        record = _json_key(items, name) or {}
        deadline = record.get("deadline_ms")
        if isinstance(deadline, int):
            record["leaves_in_s"] = round(max(0, deadline - now_ms) / 1000, 1)
        found[name[len(LEAVING):]] = record
    return found


def _root_cause(items: dict[str, KeyValue]) -> dict[str, Any] | None:
    item = items.get("root_cause")
    cause = RootCause.from_json(item.value) if item else None
    return asdict(cause) if cause else None


def _text(items: dict[str, KeyValue], name: str) -> str | None:
    item = items.get(name)
    return item.value.decode(errors="replace") if item else None


def _int_key(items: dict[str, KeyValue], name: str) -> int | None:
    text = _text(items, name)
    return int(text) if text and text.strip().isdigit() else None


def _json_key(items: dict[str, KeyValue], name: str, bare: str = "") -> dict[str, Any] | None:
    """A JSON-object key; a value that is not JSON is kept under ``bare`` (or ``value``)."""
    text = _text(items, name)
    if text is None:
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    return data if isinstance(data, dict) else {bare or "value": text}


def _state(items: dict[str, KeyValue], current: Round | None, nodes: dict[str, NodeInfo],
           leaving: dict[str, dict[str, Any]]) -> str:
    closed = _text(items, CLOSED)
    if closed is not None:
        return closed
    if COMPLETING in items:
        return "finishing"
    if current is None:
        return f"forming the first round ({len(nodes)} nodes registered)"
    gone = [m for m in current.members if m not in nodes]
    if gone:
        return f"re-forming (lost {', '.join(gone)})"
    if leaving:
        return f"running ({', '.join(sorted(leaving))} leaving at the next step boundary)"
    return "running"


def _round_dict(current: Round | None, now_ms: int) -> dict[str, Any] | None:
    if current is None:
        return None
    age = (now_ms - current.created_ms) / 1000 if current.created_ms else None
    return {
        "number": current.number,
        "reason": current.reason,
        "token": current.token,
        "created_ms": current.created_ms,
        "age_s": None if age is None else round(age, 1),
        "world_size": current.world_size,
        "members": list(current.members),
    }


def _nodes(current: Round | None, registered: dict[str, NodeInfo],
           leaving: dict[str, dict[str, Any]], *, max_nodes: int | None) -> list[NodeStatus]:
    members = list(current.members) if current else []
    waits_as = "spare" if max_nodes and len(members) >= max_nodes else "waiting"
    rows = []
    for rank, node in enumerate(members):
        info = registered.get(node)
        host = info.host if info else current.hosts[rank]  # type: ignore[union-attr]
        nproc = info.nproc if info else current.nprocs[rank]  # type: ignore[union-attr]
        state = "in round" if info else "gone"
        if info and node in leaving:
            state = _leaving_text(leaving[node])
        rows.append(NodeStatus(node, host, nproc, rank, state))
    waiting = sorted((i for n, i in registered.items() if n not in members),
                     key=lambda i: (i.joined_revision, i.node_id))  # fmt: skip
    rows += [NodeStatus(i.node_id, i.host, i.nproc, None, waits_as) for i in waiting]
    return rows


def _leaving_text(record: dict[str, Any]) -> str:
    """``leaving (SIGTERM; at the next step boundary, at once in 18.2 s)``."""
    when = "at the next step boundary" if record.get("at_boundary") else "now"
    within = record.get("leaves_in_s")
    later = f", at once in {within:g} s" if isinstance(within, (int, float)) and \
        record.get("at_boundary") else ""
    return f"leaving ({record.get('source', '?')}; {when}{later})"


# events ----------------------------------------------------------------------------
def _with_events(status: RunStatus, path: str) -> RunStatus:
    from dataclasses import replace

    from elastic_rt.ops.timeline import describe, find_recoveries, load_events

    events = [e for e in load_events([path]) if e.run_id in ("", status.run_id)]
    recoveries = find_recoveries(events)
    summary = {
        "file": path,
        "recoveries": [describe(r) for r in recoveries],
        "recovery_s": [round(r.duration_s, 2) for r in recoveries],
        "last": [_event_line(e) for e in events if e.name in NOTABLE][-8:],
    }
    return replace(status, events=summary)


def _event_line(event: Event) -> str:
    clock = time.strftime("%H:%M:%S", time.localtime(event.timestamp_ms / 1000))
    detail = _detail(event)
    where = f"round {event.round}" if event.round is not None else ""
    return "  ".join(p for p in (clock, event.node or "-", event.name, where, detail) if p)


def _detail(event: Event) -> str:
    m = event.metadata
    if event.name == "node.lost":
        return f"lost {m.get('lost')}"
    if event.name == "node.evicted":
        return f"{m.get('evicted')} {m.get('liveness')} for {m.get('silent_ms')} ms"
    if event.name == "round.formed":
        return f"world {m.get('world_size')}, {m.get('reason', '')}"
    if event.name == "worker.failed":
        return f"local rank {m.get('local_rank')} exit {m.get('exitcode')}"
    if event.name in ("agent.fenced", "agent.exited"):
        return str(m.get("reason", ""))
    if event.name == "checkpoint.committed":
        return f"step {event.step}"
    if event.name == "node.preempting":
        return f"{m.get('source')}{': ' + str(m['detail']) if m.get('detail') else ''}"
    if event.name == "node.left":
        how = f"after step {event.step}" if m.get("at_boundary") else "at once"
        why = f" ({m['why']})" if m.get("why") else ""
        return f"{m.get('source') or m.get('signal') or ''} {how}{why}".strip()
    return ""


# text ------------------------------------------------------------------------------
def render(status: RunStatus) -> str:
    """The status as a short aligned table, the way an operator reads it."""
    lines = [f"run         {status.run_id}  ({status.state})   etcd {status.endpoint}"]
    lines += _round_lines(status)
    lines.append(f"step        {_progress_text(status.progress)}")
    lines.append(f"layout      {_layout_text(status)}")
    lines.append(f"checkpoint  {_checkpoint_text(status.checkpoint)}")
    lines.append(f"restarts    {_restarts_text(status)}")
    if _is_current(status.shares, status.round):
        lines.append(f"stragglers  {_shares_text(status.shares)}")
    if status.root_cause:
        lines += _root_cause_lines(RootCause(**status.root_cause))
    lines += ["", *_table(status.nodes)]
    if status.events:
        lines += ["", f"events ({status.events['file']})"]
        lines += [f"  recovery  {r}" for r in status.events["recoveries"]] or ["  no recoveries"]
        lines += [f"  {line}" for line in status.events["last"]]
    return "\n".join(lines)


def _round_lines(status: RunStatus) -> list[str]:
    r = status.round
    if r is None:
        return ["round       none yet"]
    age = f", formed {r['age_s']:.0f} s ago" if r["age_s"] is not None else ""
    return [
        f"round       {r['number']}  ({r['reason'] or 'no reason given'})  token {r['token']}{age}",
        f"world size  {r['world_size']} workers on {len(r['members'])} nodes",
    ]


def _is_current(shares: dict[str, Any] | None, round_: dict[str, Any] | None) -> bool:
    """An uneven split published in the current round (a new round splits evenly again)."""
    return bool(shares and shares.get("weights") and round_
                and shares.get("round") == round_["number"])


def _shares_text(shares: Any) -> str:
    """Each node's part of the global batch, the smallest first (the stragglers)."""
    total = sum(shares["weights"])
    parts = sorted(zip(shares["weights"], shares["nodes"]))
    text = ", ".join(f"{node} {weight / total:.0%}" for weight, node in parts)
    return f"{text} of each global batch (since step {shares['step']})"


def _progress_text(data: dict[str, Any] | None) -> str:
    if not data or not isinstance(data.get("step"), int):
        return "none completed yet (rank 0 of an elastic_rt.run job reports it)"
    rate = data.get("steps_per_s")
    parts = [f"{rate:.2f} steps/s" if isinstance(rate, (int, float)) else "rate not known yet"]
    if isinstance(data.get("ms"), int):
        parts.append(time.strftime("as of %H:%M:%S", time.localtime(data["ms"] / 1000)))
    return f"{data['step']}  ({', '.join(parts)})"


def _root_cause_lines(cause: RootCause) -> list[str]:
    """The one-line summary, and where it was raised (the full traceback is in the JSON)."""
    lines = [f"root cause  {cause.summary()} (round {cause.round})"]
    frame = cause.signature[1]
    return lines + [f"            {frame}"] if frame else lines


def _layout_text(status: RunStatus) -> str:
    data = status.layout
    if not data:
        return "not published yet (rank 0 of an elastic_rt.run job writes it)"
    axes = data.get("layout", data)
    text = " ".join(f"{k}={v}" for k, v in axes.items()) if isinstance(axes, dict) else str(axes)
    current = status.round["number"] if status.round else None
    if "round" in data and data["round"] != current:
        return f"{text}  (from round {data['round']}; the current round has not published one)"
    return text


def _checkpoint_text(data: dict[str, Any] | None) -> str:
    if not data:
        return "none committed"
    parts = [str(data.get("name", "?"))]
    if data.get("step") is not None:
        parts.append(f"step {data['step']}")
    if data.get("url"):
        parts.append(str(data["url"]))
    return "  ".join(parts)


def _restarts_text(status: RunStatus) -> str:
    if status.max_restarts is None:
        return f"{status.restarts_used} used (budget unknown: no max_restarts key)"
    return f"{status.restarts_used} used, {status.restarts_left} left of {status.max_restarts}"


def _table(nodes: Sequence[NodeStatus]) -> list[str]:
    header = ("node", "host", "nproc", "group rank", "state")
    rows = [header] + [
        (n.node_id, n.host, str(n.nproc), "-" if n.group_rank is None else str(n.group_rank),
         n.state)
        for n in nodes
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    table = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return table if nodes else table + ["(no node registered)"]

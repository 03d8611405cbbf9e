"""The soak's printed figures: faults by kind, then the audit, footprint and leftovers."""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from elastic_rt.events import Event
from elastic_rt.harness.chaos.config import TOLERANCE
from elastic_rt.harness.soak.footprint import FIGURES
from elastic_rt.harness.soak.run import SoakResult


def report(result: SoakResult) -> str:
    return "\n\n".join([faults_table(result), summary(result), footprint_table(result),
                        leftovers_lines(result)])


def faults_table(result: SoakResult) -> str:
    pairs = list(zip(result.injections, result.verdicts))
    injected = Counter(i.kind for i, _ in pairs)
    survived = Counter(i.kind for i, v in pairs if v.survived)
    designed = Counter(i.kind for i, v in pairs if v.as_designed)
    rows = [(kind, str(n), str(survived[kind]), str(designed[kind]), _odd(result, kind))
            for kind, n in injected.items()]
    rows += [(kind, "0", "-", "-", why) for kind, why in result.skipped.items()]
    rows.append(("all", str(len(pairs)), str(sum(survived.values())),
                 str(sum(designed.values())), ""))
    return _table(("fault", "injected", "survived", "as designed", "not as designed"), rows)


def _odd(result: SoakResult, kind: str) -> str:
    """The first few faults of ``kind`` that did not go as designed: victim, when, detail."""
    bad = [i for i, v in zip(result.injections, result.verdicts)
           if i.kind == kind and not v.as_designed]
    return "; ".join(f"{i.victim} at {(i.at_ms - result.started_ms) / 1000:.1f} s {i.detail}"
                     .strip() for i in bad[:3]) + (f" (+{len(bad) - 3})" if len(bad) > 3 else "")


def summary(result: SoakResult) -> str:
    cfg = result.cfg
    drawn = sum(i.kind != "node-join" for i in result.injections)
    held = sum(i.held_s for i in result.injections)
    return "\n".join([
        f"seed {cfg.seed}: {drawn} of {cfg.faults} faults drawn in {result.seconds:.0f} s, "
        f"{cfg.nodes} nodes (--nnodes {cfg.nnodes}), {cfg.sized_steps} steps",
        f"waited {held:.0f} s in all for faults to have a place (a replacement joining, "
        "a second state holder)",
        f"job finished: {'yes' if result.finished else 'NO'}",
        f"final parameters vs the uninterrupted run: max abs diff {result.param_diff:.2e} "
        f"({'<=' if result.param_diff <= TOLERANCE else '>'} {TOLERANCE:g}); "
        f"{result.param_count} {cfg.dtype} parameters, "
        f"{result.state_bytes / 1024:.0f} KiB of state per replica (with AdamW's moments)",
        f"global loss vs the uninterrupted run's, step by step: max abs diff "
        f"{result.loss_gap[1]:.2e} over {result.loss_gap[0]} steps",
        f"steps: {result.lost} lost (never trained included), {result.repeated} repeated, "
        f"{result.redone} redone (trained again after the state that did them died)",
        f"rounds formed: {result.rounds} ({result.rounds - 1} re-forms, "
        f"{result.paused_rounds} paused)",
        f"longest time without a completed step: {result.longest_stall[0]:.1f} s "
        + (f"(ended by step {result.longest_stall[1]})" if result.longest_stall[1] >= 0
           else "(never ended: the log stops first)"),
        f"healthy nodes evicted or fenced (no fault had hit them): {len(result.unprovoked)}"
        + "".join(f"\n  {_describe(e, result)}" for e in result.unprovoked[:10]),
        *(f"problem: {p}" for p in result.problems),
    ])  # fmt: skip


def _describe(event: Event, result: SoakResult) -> str:
    at_s = (event.timestamp_ms - result.started_ms) / 1000
    what = (f"{event.node} evicted {event.metadata.get('evicted')} "
            f"({event.metadata.get('liveness')}, silent {event.metadata.get('silent_ms')} ms)"
            if event.name == "node.evicted" else
            f"{event.node} fenced itself ({event.metadata.get('reason')})")
    return f"{at_s:.1f} s: {what} in round {event.round}"


def footprint_table(result: SoakResult) -> str:
    curve = result.curve
    if curve is None:
        return "footprint: no groups.reformed event carried one"
    rows = []
    for figure in FIGURES:
        values = curve.values(figure)
        if not values:
            continue
        scale = 2**20 if figure == "rss_bytes" else 1
        name = "rss_mib" if figure == "rss_bytes" else figure
        rows.append((name, f"{values[0] / scale:.0f}", f"{values[-1] / scale:.0f}",
                     f"{max(values) / scale:.0f}", f"{curve.slope(figure) / scale:+.3f}"))
    head = (f"longest-lived worker: node {curve.node} pid {curve.pid}, "
            f"{curve.reforms} re-forms")
    return head + "\n" + _table(("figure", "first", "last", "max", "slope/re-form"), rows)


def leftovers_lines(result: SoakResult) -> str:
    etcd = result.etcd
    if etcd is None:
        lines = ["etcd: could not be read"]
    else:
        shapes = ", ".join(f"{k}: {n}" for k, n in etcd.keys.items())
        leases = "unknown (no etcdctl)" if etcd.leases is None else str(etcd.leases)
        lines = [f"etcd keys left under the run's prefix: {etcd.key_count} ({shapes})",
                 f"  on a lease: {etcd.leased_keys}; leases the cluster still grants: {leases}"]
    temp = result.temp
    lines.append(f"temp dir entries left by the run's processes: {len(temp.entries)} "
                 f"({temp.files} files inside)" + (f": {', '.join(temp.entries[:5])}"
                                                   if temp.entries else ""))
    lines.append(f"processes left behind: {result.orphans}")
    return "\n".join(lines)


def _table(head: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
             for row in [head, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)

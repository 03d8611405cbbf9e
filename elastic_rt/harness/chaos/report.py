"""The chaos results table: one row per fault; the bar is 100 % and zeros."""

from __future__ import annotations

from elastic_rt.harness.chaos.audit import TrialResult


def table(results: list[TrialResult]) -> str:
    """One row per fault: the bar is 100 % and zeros."""
    head = ("fault", "trials", "finished", "params=ref", "lost", "repeated", "damaged ckpts",
            "orphans", "checks", "redone", "max s")
    rows = [head]
    for fault in dict.fromkeys(r.fault for r in results):
        mine = [r for r in results if r.fault == fault]
        if mine[0].skipped:
            rows.append((fault, "0", "-", "-", "-", "-", "-", "-", mine[0].skipped, "-", "-"))
            continue
        n = len(mine)
        checks = [c for r in mine for c in r.checks]
        failed = sum(c.startswith("FAILED") for c in checks)
        rows.append((
            fault, str(n), _pct(sum(r.finished for r in mine), n),
            _pct(sum(r.params_equal for r in mine), n), str(sum(r.lost for r in mine)),
            str(sum(r.repeated for r in mine)), str(sum(r.damaged for r in mine)),
            str(sum(r.orphans for r in mine)),
            f"{len(checks) - failed}/{len(checks)} ok" if checks else "-",
            str(sum(r.redone for r in mine)), f"{max(r.seconds for r in mine):.0f}",
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _pct(k: int, n: int) -> str:
    return f"{100 * k // n} % ({k}/{n})"

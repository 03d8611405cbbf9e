"""A short soak: one 4-node job trains through 40 seeded random faults, unchanged.

``scripts/bench/soak.py`` runs the long one (500 faults); this runs the same
machinery (``elastic_rt.harness.soak``) with faults about a second apart, short pauses,
and a fault that cannot land within a second giving way to one that can, in about two
minutes on two cores. The job must finish with the parameters of an uninterrupted
1-node run (float64, 1e-5), every step done once, every fault survived, and its
longest-lived worker must not grow with its re-forms, nor the run's keys in etcd with its
rounds. ``docs/soak.md`` lists what the soak found in the runtime and what it measures.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_rt.harness.chaos.config import TOLERANCE
from elastic_rt.harness.soak.config import SoakConfig
from elastic_rt.harness.soak.report import report
from elastic_rt.harness.soak.run import run_soak
from elastic_rt.rendezvous.registry import FAILURE_CLAIMS_KEPT

CONFIG = SoakConfig(faults=40, interval=0.5, seed=20261206, min_nodes=1, pause_s=(0.3, 1.2),
                    step_time=0.05, steps=1100, hold_timeout=60.0, give_way_s=2.0,
                    stall_timeout=30.0)
MIN_FAULTS = 25
"""Faults that must have landed before training ran out of steps (40 are drawn). A fault
that waits for a place spends steps: with a busy loop beside the suite, a replacement for
the job's one member took 20 s (325 steps) to join and 29 landed (30 were asked then)."""
MIN_REFORMS = 6
"""Re-forms the longest-lived worker must have gone through for the bounds to mean
anything: a worker that leaked a round's threads would be 45 threads up by then (7 and
more were seen in every run; the seed is fixed, the faults' timing is not)."""
THREADS_BOUND = 45
"""Threads the longest-lived worker may hold above its first re-form's count. Measured
(soaks of 30 faults): about +14 from its first re-form on (threads started once, at the
first recovery), then flat; each abandoned round still held adds about 13 (gloo's two
per group and a loop per device) until its collectives finish; two held at once are
allowed. Before abandoned rounds were released, a worker gained 8-9 threads per re-form
(29 -> 150 over 14 faults)."""
SETTLED_BOUND = 22
"""Threads the longest-lived worker may hold at any re-form above its first, not counting
those of abandoned rounds it still holds (``THREADS_PER_ABANDONED_GROUP`` each). Measured
(the seed below, 10-13 re-forms): +14 to +19; what is above the +14 started once is the
previous round's store server (``pt_tcpstore_uv``) kept until the next round's groups
replace the ones that hold it. A leak of a round's threads (8-9 a re-form, as before
abandoned rounds were released) passes this after two re-forms at most."""
THREADS_PER_ABANDONED_GROUP = 3
"""gloo's two worker threads and its loop thread for every group of an abandoned round."""
ABANDONED_BOUND = 12
"""Process groups of abandoned rounds held at once: three rounds of four groups (two were
seen; a worker that never released them held 16 after 8 re-forms)."""


@pytest.mark.slow
@pytest.mark.etcd
@pytest.mark.timeout(300)
def test_a_job_trains_through_a_short_soak_unchanged_and_without_growing(
        tmp_path: Path) -> None:
    result = run_soak(CONFIG, tmp_path)
    print(report(result))
    logs = f"logs under {tmp_path}"
    drawn = sum(i.kind != "node-join" for i in result.injections)
    assert not result.problems, (result.problems, logs)
    assert result.finished, logs
    assert drawn >= MIN_FAULTS, (drawn, logs)
    assert all(v.survived for v in result.verdicts), (
        [i for i, v in zip(result.injections, result.verdicts) if not v.survived], logs)
    assert result.param_diff <= TOLERANCE, (result.param_diff, logs)
    assert (result.lost, result.repeated) == (0, 0), logs
    assert result.orphans == 0, logs
    curve = result.curve
    assert curve is not None and curve.reforms >= MIN_REFORMS, (curve, logs)
    threads, abandoned = curve.values("threads"), curve.values("abandoned_groups")
    assert max(threads) - threads[0] <= THREADS_BOUND, (threads, logs)
    settled = [t - THREADS_PER_ABANDONED_GROUP * a for t, a in zip(threads, abandoned)]
    assert max(settled) - threads[0] <= SETTLED_BOUND, (threads, abandoned, logs)
    assert max(abandoned) <= ABANDONED_BOUND, (abandoned, logs)
    assert result.etcd is not None
    per_round = {k: n for k, n in result.etcd.keys.items() if "<k>" in k}
    assert per_round.get("store/<k>", 0) <= 1, (per_round, logs)  # one a round before
    assert per_round.get("failure/<k>", 0) <= FAILURE_CLAIMS_KEPT + 1, (per_round, logs)

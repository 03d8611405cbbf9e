"""RssPeak sees a transient copy that is gone by the time it is read, and only its own phase."""

from __future__ import annotations

import sys

import pytest
import torch

from elastic_rt.worker.rss_peak import RssPeak

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")

MB = 1 << 20


def test_a_transient_copy_counts_and_an_earlier_one_does_not() -> None:
    earlier = torch.ones(96 * MB // 4)  # touched: resident, then freed before the phase
    del earlier
    peak = RssPeak()
    transient = torch.ones(64 * MB // 4)
    del transient
    grown = peak.growth_bytes()
    assert grown is not None
    assert 56 * MB <= grown < 90 * MB, grown  # about the 64 MB (some pages were resident), not 160

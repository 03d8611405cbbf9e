"""``elastic-rt launch`` against torchrun's own parser, and the flags' pure parts.

torchrun's parser is the reference: a torchrun flag must be supported by ours (every
spelling parses, and it is not refused) or refused with its reason in
docs/torchrun.md. A new torch that adds a flag fails here until it is decided.
"""

from __future__ import annotations

import argparse
import re
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

from elastic_rt.cli import build_parser
from elastic_rt.cli import torchrun_flags as flags
from elastic_rt.config import DEFAULT_JOIN_TIMEOUT
from elastic_rt.errors import ConfigError

DOC = Path(__file__).resolve().parents[2] / "docs" / "torchrun.md"


def _doc_rows() -> dict[str, str]:
    rows = {}
    for line in DOC.read_text().splitlines():
        match = re.match(r"\| `(--[a-z-]+)` \| (.+) \|$", line)
        if match:
            rows[match.group(1)] = match.group(2)
    return rows


def _launch_parser() -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions
                    if isinstance(a, argparse._SubParsersAction))
    return commands.choices["launch"]  # type: ignore[no-any-return]


def _torchrun_flags() -> list[argparse.Action]:
    return [a for a in get_args_parser()._actions if a.option_strings and a.dest != "help"]


def test_every_torchrun_spelling_parses_in_launch() -> None:
    ours = _launch_parser()._option_string_actions
    missing = [s for a in _torchrun_flags() for s in a.option_strings if s not in ours]
    assert not missing, f"torchrun flags unknown to elastic-rt launch: {missing}"


def test_every_torchrun_flag_is_supported_or_refused_with_a_documented_reason() -> None:
    rows = _doc_rows()
    for action in _torchrun_flags():
        name = next(s for s in action.option_strings if s.startswith("--"))
        if name in flags.REFUSED:
            assert rows.get(name, "").startswith("refused:"), f"{name}: no reason in {DOC.name}"
        else:
            assert name in rows, f"{name} is supported but missing from {DOC.name}"


def test_refused_flags_are_refused_in_the_doc_too() -> None:
    rows = _doc_rows()
    assert all(rows[name].startswith("refused") for name in flags.REFUSED)


def test_a_refused_flag_with_a_value_does_not_swallow_the_script() -> None:
    args = _launch_parser().parse_args(["--numa-binding", "node", "train.py", "--lr", "1"])
    assert args.refused == "--numa-binding" and args.script == "train.py"
    args = _launch_parser().parse_args(["--virtual_local_rank", "train.py"])
    assert args.refused == "--virtual-local-rank" and args.script == "train.py"
    with pytest.raises(ConfigError, match="LOCAL_RANK"):
        flags.check_refused(args)


@pytest.mark.parametrize("text", ["0", "65536", "x", "-1"])
def test_port_refuses_what_is_not_1_to_65535(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="1-65535"):
        flags.port(text)


def test_nproc_per_node_takes_torchruns_values() -> None:
    assert flags.resolve_nproc("3") == 3
    assert flags.resolve_nproc("cpu") >= 1
    for bad, match in (("0", "Pass 1 or more"), ("many", "cpu, gpu, xpu or auto")):
        with pytest.raises(ConfigError, match=match):
            flags.resolve_nproc(bad)


def test_rdzv_conf_sets_timeouts_and_names_the_known_keys() -> None:
    assert flags.parse_rdzv_conf("join_timeout=30,last_call_timeout=0.5") == {
        "join_timeout": timedelta(seconds=30), "last_call_timeout": timedelta(seconds=0.5),
    }  # fmt: skip
    assert flags.parse_rdzv_conf("") == {}
    assert flags.parse_rdzv_conf("read_timeout=5") == {"read_timeout": timedelta(seconds=5)}
    with pytest.raises(ConfigError, match="join_timeout"):
        flags.parse_rdzv_conf("keep_alive_interval=5")
    with pytest.raises(ConfigError, match="SECONDS"):
        flags.parse_rdzv_conf("join_timeout=-1")


def test_our_timeout_flags_win_over_rdzv_conf_which_wins_over_the_default() -> None:
    from elastic_rt.cli.launch import agent_config

    def join_timeout(*flags_: str) -> timedelta:
        args = _launch_parser().parse_args([*flags_, __file__])
        return agent_config(args).rendezvous.join_timeout

    conf = ["--rdzv-conf", "join_timeout=2"]
    assert join_timeout("--join-timeout", "1", *conf) == timedelta(seconds=1)
    assert join_timeout(*conf) == timedelta(seconds=2)
    assert join_timeout() == DEFAULT_JOIN_TIMEOUT

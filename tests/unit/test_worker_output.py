"""torchrun's output flags: the pure plan, and real worker processes following it."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from agents.output import OutputSpec, Std, parse_ranks, parse_std, plan_streams
from agents.processes import WorkerGroup
from agents.worker_state import WorkerState
from elastic_rt.harness import wait_until

pytestmark = pytest.mark.timeout(60)


def test_parse_std_reads_a_value_or_per_rank_pairs_like_torchrun() -> None:
    assert parse_std("3", "-r") is Std.ALL
    assert parse_std("0:1,1:2", "-t") == {0: Std.OUT, 1: Std.ERR}


@pytest.mark.parametrize("text", ["4", "x", "0:9", "1:"])
def test_parse_std_names_the_flag_and_the_accepted_forms(text: str) -> None:
    with pytest.raises(ValueError, match=r"--tee .* is not a stream setting"):
        parse_std(text, "--tee")


def test_parse_ranks_is_none_for_all_and_refuses_garbage() -> None:
    assert parse_ranks("") is None
    assert parse_ranks("0,2") == {0, 2}
    with pytest.raises(ValueError, match="local-ranks-filter"):
        parse_ranks("a")
    with pytest.raises(ValueError, match="local-ranks-filter"):
        parse_ranks("-1")


def test_tee_writes_the_file_and_shows_the_stream_redirect_only_writes() -> None:
    spec = OutputSpec(redirects={1: Std.ALL}, tee=Std.OUT)
    shown, hidden = plan_streams(spec, 2, "/logs/attempt_0")
    assert shown.stdout_file == "/logs/attempt_0/0/stdout.log" and shown.show_stdout
    assert shown.stderr_file is None and shown.show_stderr
    assert hidden.stdout_file and hidden.show_stdout  # tee wins over redirect for stdout
    assert hidden.stderr_file and not hidden.show_stderr
    assert hidden.error_file == "/logs/attempt_0/1/error.json"


def test_filtered_out_ranks_reach_neither_console_nor_a_file_unless_redirected() -> None:
    first, second = plan_streams(OutputSpec(ranks_filter=frozenset({0})), 2, "/a")
    assert first.show_stdout and first.show_stderr
    assert not second.show_stdout and not second.show_stderr and second.stdout_file is None


def _run(group: WorkerGroup, code: str, nproc: int) -> None:
    envs = [{**os.environ, "LOCAL_RANK": str(i)} for i in range(nproc)]
    group.start([sys.executable, "-c", code], envs)
    wait_until(lambda: group.poll()[0] is not WorkerState.RUNNING, timeout=30, what="workers exit")
    group.stop()


def test_tee_copies_each_line_to_the_log_and_prefixed_to_the_console(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    group = WorkerGroup(output=OutputSpec(log_dir=str(tmp_path), tee=Std.OUT, role="trainer"))
    _run(group, "import os; print('hello from', os.environ['LOCAL_RANK'])", 2)
    logs = sorted(tmp_path.glob("workers_*/attempt_0/*/stdout.log"))
    assert [p.read_text() for p in logs] == ["hello from 0\n", "hello from 1\n"]
    out = capsys.readouterr().out
    assert "[trainer0]:hello from 0" in out and "[trainer1]:hello from 1" in out


def test_workers_get_torchruns_error_file_nccl_setting_and_role(tmp_path: Path) -> None:
    group = WorkerGroup(output=OutputSpec(role="trainer"), log_dir=str(tmp_path))
    code = (
        "import json, os; keys = ('TORCHELASTIC_ERROR_FILE', 'TORCH_NCCL_ASYNC_ERROR_HANDLING',"
        " 'ROLE_NAME'); open(os.environ['TORCHELASTIC_ERROR_FILE'], 'w').write("
        "json.dumps({k: os.environ[k] for k in keys}))"
    )
    _run(group, code, 1)
    (error_file,) = tmp_path.glob("workers_*/attempt_0/0/error.json")
    seen = json.loads(error_file.read_text())
    assert seen == {
        "TORCHELASTIC_ERROR_FILE": str(error_file),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "ROLE_NAME": "trainer",
    }


def test_record_writes_the_workers_exception_to_the_error_file(tmp_path: Path) -> None:
    group = WorkerGroup(log_dir=str(tmp_path))
    code = (
        "from torch.distributed.elastic.multiprocessing.errors import record\n"
        "@record\n"
        "def main():\n"
        "    raise ValueError('bad batch')\n"
        "main()\n"
    )
    _run(group, code, 1)
    (error_file,) = tmp_path.glob("workers_*/attempt_0/0/error.json")
    assert "bad batch" in error_file.read_text()


def test_stop_without_grace_kills_a_worker_that_ignores_sigterm_at_once(tmp_path: Path) -> None:
    group = WorkerGroup(grace_period=30.0, log_dir=str(tmp_path))
    ready = tmp_path / "ready"
    code = ("import signal, time, pathlib; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            f"pathlib.Path({str(ready)!r}).touch(); time.sleep(60)")
    group.start([sys.executable, "-c", code], [dict(os.environ)])
    wait_until(ready.exists, timeout=30, what="the worker ignoring SIGTERM")
    started = time.monotonic()
    exits = group.stop(grace=False)
    assert time.monotonic() - started < 10  # not the 30 s grace period
    assert [e.exitcode for e in exits] == [-signal.SIGKILL]

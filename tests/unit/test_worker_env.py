"""The worker environment: one description, written by the agent and read back by the library."""

from __future__ import annotations

from datetime import timedelta

import pytest

from agents.worker_env import (
    NCCL_ASYNC_ERROR_HANDLING_ENV,
    process_env,
    round_envs,
    standby_envs,
    with_extras,
)
from elastic_rt.config import (
    COLLECTIVE_TIMEOUT_ENV,
    DEFAULT_LEASE_TTL,
    LEASE_TTL_ENV,
    RANK_ENV,
    EtcdAuth,
    WorkerEnv,
    env_seconds,
)
from elastic_rt.errors import ConfigError
from elastic_rt.rendezvous.rounds import Round

NODE = WorkerEnv(
    node_id="b", node_host="10.0.0.2", run_id="llm7b", endpoint="127.0.0.1:2379",
    agent_dir="/tmp/agent-b",
    events_file="/tmp/events.jsonl", lease_ttl=timedelta(seconds=2.5), max_restarts=3,
    auth=EtcdAuth(cacert="/ca.pem", user="u", password="p"),
)  # fmt: skip
ROUND = Round(number=4, members=("a", "b", "c"), nprocs=(2, 3, 1), hosts=("ha", "hb", "hc"),
              token=77)


def test_round_envs_give_torchrun_placement_for_each_local_worker() -> None:
    envs = round_envs(NODE, ROUND, master=("ha", 29500), restart_count=2)

    assert [(e.rank, e.local_rank) for e in envs] == [(2, 0), (3, 1), (4, 2)]
    first = envs[0]
    assert (first.world_size, first.local_world_size) == (6, 3)
    assert (first.group_rank, first.group_world_size) == (1, 3)
    assert (first.master_addr, first.master_port) == ("ha", 29500)
    assert (first.round, first.token, first.restart_count) == (4, 77, 2)
    assert first.lease_ttl == timedelta(seconds=2.5) and first.auth == NODE.auth
    variables = first.to_env()
    assert variables["RANK"] == variables["ROLE_RANK"] == "2"
    assert variables["WORLD_SIZE"] == variables["ROLE_WORLD_SIZE"] == "6"
    assert variables["TORCHELASTIC_RESTART_COUNT"] == "2"
    assert variables["TORCHELASTIC_MAX_RESTARTS"] == "3"
    assert variables[LEASE_TTL_ENV] == "2.5"
    assert variables["ELASTIC_RT_NODE_HOST"] == "10.0.0.2"  # where its state stream listens


def test_standby_workers_have_no_rank_until_a_round_admits_them() -> None:
    envs = standby_envs(NODE, 2, restart_count=1)

    assert [e.local_rank for e in envs] == [0, 1]
    assert all(e.round == -1 and not e.in_round for e in envs)
    variables = envs[1].to_env()
    for name in ("RANK", "WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        assert name not in variables
    assert variables["LOCAL_RANK"] == "1" and variables["LOCAL_WORLD_SIZE"] == "2"


@pytest.mark.parametrize(
    "env",
    [
        WorkerEnv(),
        NODE,
        *round_envs(NODE, ROUND, master=("ha", 29500), restart_count=2),
        *standby_envs(NODE, 2, restart_count=1),
        WorkerEnv(rank=1, world_size=2, lease_ttl=timedelta(seconds=7),
                  collective_timeout=timedelta(minutes=10), auth=EtcdAuth(tls=True)),
        WorkerEnv(hang_factor=2.5),
        WorkerEnv(hang_factor=0.0),
    ],
    ids=lambda env: f"round{env.round}-rank{env.rank}-local{env.local_rank}",
)
def test_from_env_reads_back_what_to_env_wrote(env: WorkerEnv) -> None:
    assert WorkerEnv.from_env(env.to_env()) == env


def test_process_env_keeps_the_agents_environment_under_the_workers() -> None:
    (env,) = round_envs(NODE, ROUND, master=("ha", 1), restart_count=0)[:1]
    full = process_env({"PATH": "/bin", RANK_ENV: "99"}, env)
    assert full["PATH"] == "/bin" and full[RANK_ENV] == "2" and full["PYTHONUNBUFFERED"] == "1"


def test_an_empty_environment_is_a_single_process() -> None:
    env = WorkerEnv.from_env({})
    assert (env.rank, env.world_size, env.lease_ttl) == (0, 1, DEFAULT_LEASE_TTL)
    assert not env.is_elastic and env.collective_timeout is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [("5", timedelta(seconds=5)), ("2.5", timedelta(seconds=2.5)), (" 600 ", timedelta(minutes=10)),
     ("0", timedelta(0)), ("", None)],
)
def test_env_seconds_reads_durations(text: str, expected: timedelta | None) -> None:
    assert env_seconds({LEASE_TTL_ENV: text}, LEASE_TTL_ENV) == expected


@pytest.mark.parametrize("text", ["soon", "-1", "nan", "inf", "5s"])
def test_env_seconds_names_the_variable_of_a_bad_value(text: str) -> None:
    with pytest.raises(ConfigError, match=f"{COLLECTIVE_TIMEOUT_ENV}='{text}' is not a number"):
        env_seconds({COLLECTIVE_TIMEOUT_ENV: text}, COLLECTIVE_TIMEOUT_ENV)


def test_from_env_names_a_variable_that_is_not_a_whole_number() -> None:
    with pytest.raises(ConfigError, match="ELASTIC_RT_ROUND='one' is not a whole number"):
        WorkerEnv.from_env({"ELASTIC_RT_ROUND": "one"})


@pytest.mark.parametrize(("inherited", "want"),
                         [({}, "1"), ({NCCL_ASYNC_ERROR_HANDLING_ENV: "3"}, "3")])
def test_nccl_async_error_handling_is_torchruns_1_unless_the_user_set_it(
    inherited: dict[str, str], want: str
) -> None:
    # torch.distributed.elastic's local agent: os.getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    env = with_extras(inherited, error_file="/tmp/error.json", role="trainer")
    assert env[NCCL_ASYNC_ERROR_HANDLING_ENV] == want


def test_rank_0_hosts_the_store_and_torchruns_signal_list_is_inherited_unless_set() -> None:
    env = with_extras({}, error_file="/tmp/error.json", role="trainer")
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    assert env["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    mine = with_extras({"TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGUSR1"}, error_file="/e", role="r")
    assert mine["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGUSR1"

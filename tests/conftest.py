"""Shared fixtures. Each family lives in its own module under tests/fixtures/."""

pytest_plugins = [
    "tests.fixtures.etcd",
    "tests.fixtures.processes",
    "tests.fixtures.s3",
]

"""The credentials a benchmark gives its processes."""
from benchmarks.processes import AUTH_TOKEN_ENV, credentials_env, credentials_line, driver_token
from pipecast.core.credentials import verify_node_token


def test_an_agent_that_registers_gets_its_node_token_and_everything_else_the_master():
    node = credentials_env("master", "w1")[AUTH_TOKEN_ENV]
    assert node != "master" and verify_node_token("master", node) == "w1"
    assert credentials_env("master") == {AUTH_TOKEN_ENV: "master"}


def test_no_master_turns_auth_off_for_every_process_whatever_the_caller_has(monkeypatch):
    monkeypatch.setenv(AUTH_TOKEN_ENV, "inherited")
    assert credentials_env("", "w1") == credentials_env("") == {AUTH_TOKEN_ENV: ""}
    assert driver_token() == "inherited"
    assert credentials_line(True).startswith("credentials: on")
    assert credentials_line(False) == "credentials: off (--no-auth)"

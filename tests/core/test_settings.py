"""Settings precedence: CLI overrides > PIPECAST_* environment > TOML file > defaults."""

import os
import re

import pytest

from pipecast.core.settings import SettingsError, load_settings, warn_unknown_variables


def test_precedence(tmp_path, monkeypatch):
    config = tmp_path / "pipecast.toml"
    config.write_text("[pipecast]\nagent_port = 1111\nlease_s = 3.5\nmax_queue = 7\n")
    monkeypatch.delenv("PIPECAST_CONFIG", raising=False)
    assert load_settings().agent_port == 7070
    assert load_settings(config).agent_port == 1111
    monkeypatch.setenv("PIPECAST_AGENT_PORT", "2222")
    s = load_settings(config)
    assert (s.agent_port, s.lease_s, s.max_queue) == (2222, 3.5, 7)
    assert load_settings(config, agent_port=3333, max_queue=None).agent_port == 3333
    monkeypatch.setenv("PIPECAST_CONFIG", str(config))
    assert load_settings().lease_s == 3.5


def test_bad_file_and_unknown_key_are_errors(tmp_path, monkeypatch):
    monkeypatch.delenv("PIPECAST_CONFIG", raising=False)
    bad = tmp_path / "bad.toml"
    bad.write_text("agent_port = [")
    with pytest.raises(SettingsError, match="bad.toml"):
        load_settings(bad)
    # Found in use: the model's "agent_prot: Extra inputs are not permitted" named no file and no likely setting.
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[pipecast]\nagent_prot = 1\nzzz_qqq = 2\nAGENT_PORT = 3\n")
    with pytest.raises(SettingsError) as refused:
        load_settings(unknown)
    # Found in review: difflib is case-sensitive, and AGENT_PORT got no suggestion.
    assert str(refused.value) == (f"config file {unknown}: unknown setting AGENT_PORT (did you mean agent_port?); "
                                  "unknown setting agent_prot (did you mean agent_port?); unknown setting zzz_qqq")


@pytest.mark.parametrize("text, problem", [
    (b'config = "other.toml"\n', r"config names a config file, which only the command line or PIPECAST_CONFIG may$"),
    (b'[pipecast]\nconfig = "other.toml"\n', r"config names a config file"),
    (b"\xff\xfeagent_port = 1\n", "codec can't decode byte 0xff"),
    (b"pipecast = 5\n", r"pipecast must be a table of settings \(\[pipecast\]\)$"),
    (b"pipecast = [1]\n", r"pipecast must be a table of settings \(\[pipecast\]\)$"),
    (b'auth_token = "0123456789abcdef0123"\nagent_prot = 1\n[pipecast]\nagent_port = 7071\n',
     r"agent_prot, auth_token outside the \[pipecast\] table \(put every setting in it, or none\)$"),
])
def test_a_config_file_of_the_wrong_shape_is_a_settings_error(tmp_path, monkeypatch, text, problem):
    """Found in review: a file not UTF-8 or a pipecast key that is no table crashed every command (a traceback), and
    keys beside a [pipecast] table were ignored without a word (auth_token among them: auth off)."""
    monkeypatch.delenv("PIPECAST_CONFIG", raising=False)
    config = tmp_path / "pipecast.toml"
    config.write_bytes(text)
    with pytest.raises(SettingsError, match=f"^config file {re.escape(str(config))}: .*{problem}"):
        load_settings(config)


def test_a_setting_of_several_entries_comes_whole_from_the_first_source_that_sets_it(tmp_path, monkeypatch):
    """Found in review: pydantic-settings merged them across sources, so a key revoked in the environment stayed
    valid from the file, and --priority-share added to the variable's shares instead of replacing them."""
    monkeypatch.delenv("PIPECAST_CONFIG", raising=False)
    config = tmp_path / "pipecast.toml"
    config.write_text('router_api_keys = {OLD-REVOKED-KEY = "team-a"}\n')
    monkeypatch.setenv("PIPECAST_ROUTER_API_KEYS", '{"NEW-KEY": "team-a"}')
    assert load_settings(config).router_api_keys == {"NEW-KEY": "team-a"}
    monkeypatch.setenv("PIPECAST_PRIORITY_SHARES", '{"low": 0.25}')
    assert load_settings(priority_shares={"high": 0.5}).priority_shares == {"high": 0.5}
    monkeypatch.delenv("PIPECAST_ROUTER_API_KEYS")
    assert load_settings(config).router_api_keys == {"OLD-REVOKED-KEY": "team-a"}


def test_a_dict_setting_from_the_environment_that_is_not_json_is_a_settings_error(monkeypatch):
    monkeypatch.setenv("PIPECAST_AGENT_LABELS", "rack=r1")
    with pytest.raises(SettingsError, match=r"^invalid settings: error parsing value for field \"agent_labels\" .*: a "
                                            r"setting of several entries takes JSON, e.g. PIPECAST_AGENT_LABELS="):
        load_settings()
    monkeypatch.setenv("PIPECAST_AGENT_LABELS", '{"rack": "r1"}')
    assert load_settings().agent_labels == {"rack": "r1"}


def test_an_empty_variable_of_an_optional_path_leaves_it_unset(tmp_path, monkeypatch):
    paths = ("config", "agent_cache_dir", "agent_local_socket", "tls_cert", "tls_key", "tls_ca")
    for name in paths:
        monkeypatch.setenv(f"PIPECAST_{name.upper()}", "")
    settings = load_settings()
    assert [getattr(settings, name) for name in paths] == [None] * len(paths)  # not Path("."): the working dir
    monkeypatch.setenv("PIPECAST_TLS_CA", str(tmp_path / "ca.pem"))
    assert load_settings().tls_ca == tmp_path / "ca.pem"


def test_a_dict_setting_that_is_not_json_gets_an_example_of_its_own(monkeypatch):
    """Found in review: a bad PIPECAST_ROUTER_API_KEYS was answered with an example for PIPECAST_AGENT_LABELS."""
    monkeypatch.setenv("PIPECAST_ROUTER_API_KEYS", "key=team-a")
    with pytest.raises(SettingsError, match=r"takes JSON, e.g. PIPECAST_ROUTER_API_KEYS='\{\"KEY\": \"team-a\"\}'$"):
        load_settings()


def test_sizes_take_units_and_tenant_limits_rate_burst_as_the_command_line_does(monkeypatch):
    """Found in review: PIPECAST_AGENT_MEMORY_BYTES=16GiB (as --memory and the Helm chart take it) and
    PIPECAST_ROUTER_DEFAULT_TENANT_LIMIT=2:4 (as --tenant-limit takes it) were refused."""
    monkeypatch.setenv("PIPECAST_AGENT_MEMORY_BYTES", "16GiB")
    monkeypatch.setenv("PIPECAST_AGENT_RESERVE_BYTES", "0")
    monkeypatch.setenv("PIPECAST_ROUTER_DEFAULT_TENANT_LIMIT", "2:4")
    monkeypatch.setenv("PIPECAST_ROUTER_TENANT_LIMITS", '{"team-a": "5:10", "team-b": {"rate": 1, "burst": 2}}')
    settings = load_settings()
    assert (settings.agent_memory_bytes, settings.agent_reserve_bytes) == (16 << 30, 0)
    assert (settings.router_default_tenant_limit.rate, settings.router_default_tenant_limit.burst) == (2.0, 4)
    assert {name: (limit.rate, limit.burst) for name, limit in settings.router_tenant_limits.items()} == {
        "team-a": (5.0, 10), "team-b": (1.0, 2)}
    monkeypatch.setenv("PIPECAST_AGENT_MEMORY_BYTES", "lots")
    with pytest.raises(SettingsError, match=r"^invalid settings: agent_memory_bytes: Value error, not a size: 'lots'"):
        load_settings()
    monkeypatch.setenv("PIPECAST_AGENT_MEMORY_BYTES", "1GiB")
    monkeypatch.setenv("PIPECAST_ROUTER_DEFAULT_TENANT_LIMIT", "fast")
    with pytest.raises(SettingsError, match=r"router_default_tenant_limit: Value error, 'fast' is not RATE:BURST"):
        load_settings()


def test_a_size_of_zero_with_a_unit_is_taken_where_zero_is(monkeypatch):
    """Found in review: PIPECAST_AGENT_CACHE_MAX_BYTES=0GiB was refused ("size must be positive") where 0 means no
    bound, while "0" and --reserve 0GiB were taken; a setting whose 0 means nothing still refuses it."""
    for variable, value in (("PIPECAST_AGENT_CACHE_MAX_BYTES", "0GiB"), ("PIPECAST_AGENT_RESERVE_BYTES", "0B"),
                            ("PIPECAST_AGENT_RELAY_BYTES", "0KiB")):
        monkeypatch.setenv(variable, value)
    settings = load_settings()
    assert (settings.agent_cache_max_bytes, settings.agent_reserve_bytes, settings.agent_relay_bytes) == (0, 0, 0)
    monkeypatch.setenv("PIPECAST_AGENT_MEMORY_BYTES", "0GiB")
    with pytest.raises(SettingsError, match=r"^invalid settings: agent_memory_bytes: Input should be greater than 0"):
        load_settings()


@pytest.mark.parametrize("number", ["5", "2.5"])
def test_a_tenant_limit_given_as_a_bare_number_is_refused_as_text_without_a_burst_is(monkeypatch, number):
    """Walkthrough finding 6b: PIPECAST_ROUTER_DEFAULT_TENANT_LIMIT=5 (read as the JSON number 5) got pydantic's
    "Input should be a valid dictionary or instance of TenantLimit", where `abc` is told the RATE:BURST form."""
    monkeypatch.setenv("PIPECAST_ROUTER_DEFAULT_TENANT_LIMIT", number)
    with pytest.raises(SettingsError, match=re.escape(f"router_default_tenant_limit: Value error, {number} is not "
                                                      'RATE:BURST (e.g. 5:10) nor {"rate": 5, "burst": 10}')):
        load_settings()
    monkeypatch.delenv("PIPECAST_ROUTER_DEFAULT_TENANT_LIMIT")
    monkeypatch.setenv("PIPECAST_ROUTER_TENANT_LIMITS", f'{{"team-a": {number}}}')
    with pytest.raises(SettingsError, match=re.escape(f"router_tenant_limits.team-a: Value error, {number} is not "
                                                      "RATE:BURST")):
        load_settings()


@pytest.mark.parametrize("rate", ["1e-320", "1e-9", "0.00001"])
def test_a_tenant_rate_slower_than_one_request_a_day_is_refused(monkeypatch, rate):
    """Found in review: such a rate was taken, and its refusals said Retry-After of 31 years (1e-9) or were
    a 500 (1e-320: an infinite wait)."""
    monkeypatch.delenv("PIPECAST_CONFIG", raising=False)
    monkeypatch.setenv("PIPECAST_ROUTER_DEFAULT_TENANT_LIMIT", f"{rate}:1")
    with pytest.raises(SettingsError, match=re.escape(f"router_default_tenant_limit.rate: Value error, must be at "
                                                      "least 1.16e-05 requests/s (one a day), got "
                                                      f"{float(rate)!r}")):
        load_settings()
    monkeypatch.setenv("PIPECAST_ROUTER_DEFAULT_TENANT_LIMIT", f"{1 / 86400!r}:1")
    assert load_settings().router_default_tenant_limit.rate == 1 / 86400


def test_a_variable_that_names_no_setting_is_warned_of_once_with_the_setting_it_likely_misspells(monkeypatch, caplog):
    """Found in review: a misspelt PIPECAST_AUTH_TOKN was ignored without a word (auth stayed off), where a
    config file's unknown key is refused."""
    monkeypatch.setenv("PIPECAST_AUTH_TOKN", "secret")
    monkeypatch.setenv("PIPECAST_CONFIG", "")
    with caplog.at_level("WARNING", logger="pipecast.core.settings"):
        load_settings()
        load_settings()
    assert [r.getMessage() for r in caplog.records] == [
        "environment variable PIPECAST_AUTH_TOKN is no pipecast setting: ignored (did you mean PIPECAST_AUTH_TOKEN?)"]
    assert warn_unknown_variables({"PIPECAST_ZZZ_QQQ": "1", "PIPECAST_CONTROL_PORT": "1", "HOME": "/"}) == [
        "PIPECAST_ZZZ_QQQ"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="pipecast.core.settings"):
        warn_unknown_variables({"pipecast_agent_prot": "1"})
    assert [r.getMessage() for r in caplog.records] == [
        "environment variable pipecast_agent_prot is no pipecast setting: ignored (did you mean PIPECAST_AGENT_PORT?)"]


@pytest.mark.parametrize("variable, value, message", [
    ("PIPECAST_CONTROL_STRAGGLER_WINDOW_S", "inf", "control_straggler_window_s: Input should be a finite number"),
    ("PIPECAST_CONTROL_STRAGGLER_WINDOW_S", "nan", "control_straggler_window_s: Input should be a finite number"),
    ("PIPECAST_CONTROL_STORE_LINKS", "4097", "control_store_links: Input should be less than or equal to 4096"),
    # Found in review: every other float setting took inf, so a timeout could be turned into a wait without deadline.
    ("PIPECAST_IO_TIMEOUT_S", "inf", "io_timeout_s: Input should be a finite number"),
    ("PIPECAST_CONNECT_TIMEOUT_S", "inf", "connect_timeout_s: Input should be a finite number"),
    ("PIPECAST_AGENT_IDLE_TIMEOUT_S", "inf", "agent_idle_timeout_s: Input should be a finite number"),
    ("PIPECAST_AGENT_LINK_MBIT", "inf", "agent_link_mbit: Input should be a finite number"),
])
def test_an_infinite_straggler_window_and_a_store_of_countless_links_are_refused(monkeypatch, variable, value, message):
    """Found in review: an infinite window turned straggler detection off without a word, and a store of 10**7
    links had every scale-up build 10**7 groups (seconds, a gigabyte)."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError, match=re.escape(message)):
        load_settings()


def test_an_invalid_api_key_entry_is_named_without_its_key(tmp_path, monkeypatch):
    """Found in review: the error named the entry by its key, the API key itself, into pod logs or the journal."""
    config = tmp_path / "k.toml"
    config.write_text('[pipecast]\nrouter_api_keys = {"sk-live-TOPSECRET" = 5}\n')
    with pytest.raises(SettingsError, match=r"router_api_keys \(an entry; its key, a secret, not shown\)") as caught:
        load_settings(config)
    assert "TOPSECRET" not in str(caught.value)
    monkeypatch.setenv("PIPECAST_ROUTER_API_KEYS", '{"sk-live-TOPSECRET": 5}')
    with pytest.raises(SettingsError) as caught:
        load_settings()
    assert "TOPSECRET" not in str(caught.value)


def test_variables_naming_one_setting_in_two_cases_are_refused_and_one_in_another_case_is_not_ignored(monkeypatch):
    """Found in review: pydantic-settings reads PIPECAST_auth_token as PIPECAST_AUTH_TOKEN, and which of the two set
    it was chance (PIPECAST_auth_token= beside the token turned auth off), while a warning called it ignored."""
    monkeypatch.delenv("PIPECAST_CONFIG", raising=False)
    monkeypatch.setenv("PIPECAST_AUTH_TOKEN", "0123456789abcdefXYZ0123456789")
    monkeypatch.setenv("PIPECAST_auth_token", "")
    with pytest.raises(SettingsError, match=re.escape(
            "environment variables naming one setting, in other cases: PIPECAST_AUTH_TOKEN and PIPECAST_auth_token "
            "(keep one, in upper case)")):
        load_settings()
    monkeypatch.delenv("PIPECAST_AUTH_TOKEN")
    assert warn_unknown_variables({"PIPECAST_auth_token": "", "pipecast_io_timeout_s": "3"}) == []
    assert warn_unknown_variables({"PIPECAST_auth_tokn": ""}) == ["PIPECAST_auth_tokn"]


@pytest.mark.parametrize("variable, value", [("PIPECAST_CONTROL_FLUSH_S", "1e-6"), ("PIPECAST_HEARTBEAT_S", "1e-6"),
                                             ("PIPECAST_LEASE_S", "1e-5"), ("PIPECAST_CONTROL_SCAN_S", "1e-6")])
def test_a_period_of_the_control_plane_near_zero_is_refused(monkeypatch, variable, value):
    """Found in review: each passed the start-up checks and spun the control plane at 100% CPU."""
    monkeypatch.delenv("PIPECAST_CONFIG", raising=False)
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError, match=f"{variable.removeprefix('PIPECAST_').lower()}: Input should be greater "
                                            "than or equal to"):
        load_settings()


def test_an_empty_variable_of_a_setting_that_may_be_unset_unsets_it(monkeypatch):
    """Found in review: an empty port or scan period (a template rendering an empty value) was an error, where an
    empty path was unset."""
    monkeypatch.delenv("PIPECAST_CONFIG", raising=False)
    for name in ("PIPECAST_CONTROL_METRICS_PORT", "PIPECAST_ROUTER_METRICS_PORT", "PIPECAST_CONTROL_SCAN_S"):
        monkeypatch.setenv(name, "")
    settings = load_settings()
    assert (settings.control_metrics_port, settings.router_metrics_port, settings.control_scan_s) == (None, None, None)


SECRET_LINE = 'auth_token = "0123456789abcdef0123"\n'


@pytest.mark.parametrize("mode, whom", [(0o620, "group"), (0o602, "others"), (0o666, "group and others")])
def test_a_config_file_holding_a_secret_that_another_user_may_change_is_refused(tmp_path, monkeypatch, mode, whom):
    """Found in review: auth_token was read from a config file of any mode: another user who could write it could
    point control_plane and tls_ca at a control plane of theirs, and collect the token."""
    monkeypatch.delenv("PIPECAST_CONFIG", raising=False)
    config = tmp_path / "pipecast.toml"
    config.write_text(SECRET_LINE)
    config.chmod(mode)
    with pytest.raises(SettingsError) as refused:
        load_settings(config)
    assert str(refused.value) == (f"config file {config} holds auth_token and is writable by {whom} (mode "
                                  f"{mode:04o}): refused, as another user could change it (chmod go-w)")


def owned_by_someone_else(path, monkeypatch) -> None:
    """Make ``path`` another user's than this process's (not root's)."""
    if os.getuid() == 0:  # root gives the file away; another user is taken for someone else
        os.chown(path, 4242, -1)
    else:
        someone_else = os.getuid() + 1
        monkeypatch.setattr(os, "getuid", lambda: someone_else)


@pytest.mark.parametrize("text, variables, holds, mode", [
    (SECRET_LINE, {}, "holds auth_token", 0o600),
    ('control_plane = "127.0.0.1:9"\n', {"PIPECAST_ROUTER_API_KEYS": '{"KEY": "team-a"}'},
     "is read with router_api_keys from a variable or the command line", 0o644)])
def test_a_config_file_owned_by_another_user_is_refused_beside_a_secret(tmp_path, monkeypatch, text, variables, holds,
                                                                        mode):
    """Found in review: a config file of another user (not root) was read, and its owner could change it: one
    holding a secret, or (a second review) one beside a secret given elsewhere."""
    monkeypatch.delenv("PIPECAST_CONFIG", raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    config = tmp_path / "pipecast.toml"
    config.write_text(text)
    config.chmod(mode)
    owned_by_someone_else(config, monkeypatch)
    with pytest.raises(SettingsError) as refused:
        load_settings(config)
    assert str(refused.value) == (f"config file {config} {holds} and is owned by uid {config.stat().st_uid} "
                                  f"(mode {mode:04o}), neither this user (uid {os.getuid()}) nor root: refused, as "
                                  "its owner could change it")


@pytest.mark.parametrize("text, secrets", [
    (SECRET_LINE, "auth_token"),
    ('[pipecast]\nrouter_api_keys = {KEY = "team-a"}\n' + SECRET_LINE, "auth_token, router_api_keys"),
    ('control_db = "postgresql://cp:hunter2@db:5432/cp"\n', "control_db"),
    ('control_db = "postgresql://cp@db/cp?sslmode=require&password=hunter2"\n', "control_db"),
])
def test_a_config_file_holding_a_secret_others_may_read_is_warned_of_once_and_a_private_one_loads_quietly(
        tmp_path, monkeypatch, caplog, text, secrets):
    """Found in review: a config file holding the token (or API keys, a database password) was read whatever its
    mode, without a word where others could read it."""
    monkeypatch.delenv("PIPECAST_CONFIG", raising=False)
    shared, private, plain = tmp_path / "shared.toml", tmp_path / "private.toml", tmp_path / "plain.toml"
    group = tmp_path / "group.toml"  # read by the group only: how a Kubernetes Secret is shared with the pod's group
    for path, mode in ((shared, 0o644), (private, 0o600), (group, 0o640)):
        path.write_text(text)
        path.chmod(mode)
    plain.write_text('agent_port = 7071\ncontrol_db = "postgresql://cp@db:5432/cp"\n')  # no secret: any mode
    plain.chmod(0o666)
    with caplog.at_level("WARNING", logger="pipecast.core.settings"):
        load_settings(shared)
        load_settings(shared)
        assert [r.getMessage() for r in caplog.records] == [
            f"config file {shared} holds {secrets} and is readable by others (mode 0644): chmod o-r, or anyone who "
            "can read it holds the secret"]
        caplog.clear()
        load_settings(private)
        load_settings(group)
        assert load_settings(plain).agent_port == 7071
        assert caplog.records == []


@pytest.mark.parametrize("token_from", ["variable", "command line"])
def test_a_config_file_another_user_may_change_is_refused_beside_a_token_given_elsewhere(tmp_path, monkeypatch,
                                                                                         token_from):
    """Found in review: a config file was refused only where it held the secret itself, but one that another user
    may change points control_plane and tls_ca at their server as well when the token comes from
    PIPECAST_AUTH_TOKEN, --token-file or --token."""
    monkeypatch.delenv("PIPECAST_CONFIG", raising=False)
    shared = tmp_path / "shared.toml"
    shared.write_text('control_plane = "127.0.0.1:9"\n')
    shared.chmod(0o666)
    overrides = {"auth_token": "tok"} if token_from == "command line" else {}
    if token_from == "variable":
        monkeypatch.setenv("PIPECAST_AUTH_TOKEN", "tok")
    with pytest.raises(SettingsError) as refused:
        load_settings(shared, **overrides)
    assert str(refused.value) == (f"config file {shared} is read with auth_token from a variable or the command line "
                                  "and is writable by group and others (mode 0666): refused, as another user could "
                                  "change it (chmod go-w)")


def test_a_config_file_others_may_change_loads_where_the_settings_hold_no_secret(tmp_path, monkeypatch, caplog):
    """A file without secrets that other users may change (a shared host's, or made under umask 002) still serves a
    process that holds none (auth off), and a private one beside a token given elsewhere, without a warning."""
    monkeypatch.delenv("PIPECAST_CONFIG", raising=False)
    shared, private = tmp_path / "shared.toml", tmp_path / "private.toml"
    for path, mode in ((shared, 0o666), (private, 0o644)):
        path.write_text('control_plane = "127.0.0.1:9"\n')
        path.chmod(mode)
    with caplog.at_level("WARNING", logger="pipecast.core.settings"):
        assert load_settings(shared).control_plane == "127.0.0.1:9"
        monkeypatch.setenv("PIPECAST_AUTH_TOKEN", "")  # auth off
        assert load_settings(shared).control_plane == "127.0.0.1:9"
        monkeypatch.setenv("PIPECAST_AUTH_TOKEN", "tok")
        assert load_settings(private).auth_token == "tok"
    assert caplog.records == []

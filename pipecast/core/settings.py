"""The one settings module: every tunable of pipecast, with precedence CLI > env > file > default.

Environment variables use the ``PIPECAST_`` prefix (``PIPECAST_AGENT_PORT=7000``); a TOML config file
is named by ``PIPECAST_CONFIG`` (or ``--config`` of the commands that take it: ``control-plane``, ``cp``,
``scaler``); command-line flags override both through
:func:`load_settings`'s ``overrides``.
"""

import difflib
import logging
import os
import re
import stat
import tomllib
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
import pydantic_settings
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from pipecast.core.engines import SERVING_ENGINES
from pipecast.core.errors import PipecastError
from pipecast.core.priorities import PRIORITIES
from pipecast.core.units import parse_size

log = logging.getLogger(__name__)


class SettingsError(PipecastError):
    """A config file or value that cannot be used."""


#: The slowest tenant rate accepted (requests/s): one request a day. A rate near 0 is no limit anyone means,
#: and the wait it gives a refused request runs to years, or overflows (1e-320).
MIN_TENANT_RATE = 1 / 86400
#: The smallest relay piece a plan asks the agents for (``agent_relay_bytes`` is theirs): smaller ones cost them more
#: CPU than 256 KiB for no gain measured (docs/benchmarks.md, "Relaying a chunk as it lands").
MIN_RELAY_PIECE_BYTES = 64 << 10


class TenantLimit(BaseModel):
    """One tenant's admission limit at the router: a token bucket of ``burst`` requests refilled at ``rate``/s."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rate: float = Field(allow_inf_nan=False, description="requests per second, sustained (at least one a day)")
    burst: int = Field(ge=1, description="requests admitted at once after a quiet spell")

    @field_validator("rate")
    @classmethod
    def _at_least_one_a_day(cls, rate: float) -> float:
        if rate < MIN_TENANT_RATE:
            raise ValueError(f"must be at least {MIN_TENANT_RATE:.3g} requests/s (one a day), got {rate!r}")
        return rate

    @model_validator(mode="before")
    @classmethod
    def _from_text(cls, value: Any) -> Any:
        # "RATE:BURST", as `pipecast router --tenant-limit NAME=RATE:BURST` takes it, besides {rate, burst}. A number
        # too gets this message: an environment variable is read as JSON first, so ..._TENANT_LIMIT=5 comes as 5.
        if isinstance(value, str | int | float):
            rate, colon, burst = str(value).partition(":")
            if not colon:
                raise ValueError(f"{value!r} is not RATE:BURST (e.g. 5:10) nor {{\"rate\": 5, \"burst\": 10}}")
            return {"rate": rate.strip(), "burst": burst.strip()}
        return value


class Settings(BaseSettings):
    """All of pipecast's settings; see the README's configuration table."""

    # No setting takes inf or NaN: an infinite timeout is a network wait without a deadline, an infinite link rate
    # a share of it that caps nothing.
    model_config = SettingsConfigDict(env_prefix="PIPECAST_", extra="forbid", allow_inf_nan=False)

    config: Path | None = Field(None, description="TOML file of settings (flat keys, optionally under [pipecast])")

    # Node agent (data plane).
    agent_host: str = Field("127.0.0.1", description="data-plane listen address")
    agent_port: int = Field(7070, ge=0, le=65535, description="data-plane listen port (0: any free port)")
    agent_node_id: str = Field("", description="node id; default: hostname:port")
    agent_transport: Literal["auto", "tcp", "ucx"] = Field(
        "auto", description="data transport; auto: UCX on GPU/RDMA nodes with ucxx installed, else TCP (TCP when "
                            "tls_cert, tls_key and tls_ca are all set: UCX does not encrypt; and where UCX does not "
                            "start); an agent exchanges blocks only with agents on its transport")
    agent_memory_bytes: int = Field(8 << 30, gt=0, description="host memory budget for block buffers")
    agent_reserve_bytes: int = Field(
        0, ge=0, description="host memory the agent populates at start and hands over to the blocks it receives "
                             "(VMs that back memory lazily; 0: none)")
    agent_cache_dir: Path | None = Field(None, description="disk cache of verified blocks (off if unset)")
    agent_cache_max_bytes: int = Field(0, ge=0, description="the most the disk cache holds: the packages used least "
                                                            "recently and not held in memory make room (0: no bound)")
    agent_local_socket: Path | None = Field(None, description="local API socket for engines on this node")
    egress_mbit: float = Field(0.0, ge=0, description="application-level egress cap (0: none)")
    ingress_mbit: float = Field(0.0, ge=0, description="application-level ingress cap (0: none)")
    agent_link_mbit: float = Field(0.0, ge=0, description="this node's link rate, Mbit/s, that multicast_share is "
                                                          "a share of and the control plane judges stragglers by "
                                                          "(0: unknown)")
    multicast_share: float = Field(
        1.0, gt=0, le=1, description="largest share of the link the data plane takes, each direction (below 1 needs "
                                     "agent_link_mbit; 1: the whole link)")
    priority_shares: dict[Literal[PRIORITIES], Annotated[float, Field(gt=0, le=1)]] = Field(
        default_factory=dict, description="a share of the link per package priority (a deployment's), each "
                                          "direction, for the priorities named (the others: multicast_share); all "
                                          "packages together take at most the largest share")
    connect_timeout_s: float = Field(5.0, gt=0, description="deadline of a connection to a peer")
    io_timeout_s: float = Field(10.0, gt=0, description="longest silence tolerated from a peer mid-transfer")
    io_min_rate_mbit: float = Field(0.1, ge=0, description="over TCP, a peer mid-transfer that sends less than this "
                                                            "over an io_timeout_s is dropped as stale, as a silent "
                                                            "one is (0: silence only)")
    agent_fetch_concurrency: int = Field(4, ge=1, description="parents a node fetches from at once")
    agent_relay_bytes: int = Field(256 << 10, ge=0, description="over TCP a relay passes a chunk on in pieces this "
                                                                "big as they arrive (a long chain's plan may ask for "
                                                                "smaller), its last byte once verified (0: whole "
                                                                "verified chunks only)")
    agent_fetch_retries: int = Field(2, ge=0, le=100, description="retries of a failed parent before giving up on it")
    agent_fetch_backoff_s: float = Field(0.2, ge=0, le=30, description="first retry backoff (doubling per retry, "
                                                                       "30 s a wait at most)")
    agent_replan_wait_s: float = Field(
        5.0, gt=0, description="after reporting a failed parent, how long to wait for the control plane's new "
                               "parents before fetching around it from the plan's sources")
    agent_progress_interval_s: float = Field(0.1, gt=0, description="how often a receiving agent reports the bytes "
                                                                    "it holds, in a plan whose ASSIGN asks for it "
                                                                    "(the control plane finds stragglers from them)")
    agent_idle_timeout_s: float = Field(60.0, gt=0, description="a served peer connection with no request this long "
                                                                "is closed")
    agent_max_connections: int = Field(256, ge=1, description="peer connections an agent serves at once; past it a "
                                                              "new one closes the one longest in its hello, or is "
                                                              "closed at once if none is")
    agent_max_connections_per_address: int = Field(32, ge=1, description="peer connections an agent serves at once "
                                                                         "from one address")
    agent_labels: dict[str, str] = Field(default_factory=dict,
                                         description="topology labels the agent registers with, e.g. rack")
    agent_serve_url: str = Field("", description="HTTP base URL of the serving worker on this node (router)")
    agent_engine: Literal[SERVING_ENGINES] = Field(
        "pipecast", description="what answers at agent_serve_url: pipecast's serving worker or vLLM")
    agent_serve_package: str = Field("", description="the package id the serving worker at agent_serve_url serves "
                                                     "(scale-ups for a deployment place only there; empty: any)")

    # Control plane.
    control_plane: str = Field("127.0.0.1:7000", description="host:port of the control plane, or of its replicas "
                                                              "separated by commas (calls follow the leader)")
    control_host: str = Field("127.0.0.1", description="control plane listen address")
    control_port: int = Field(7000, ge=0, le=65535, description="control plane listen port")
    control_db: str = Field("pipecast-control.sqlite3",
                            description="control plane state: a SQLite file, or a postgresql:// URL that several "
                                        "replicas share (one leads)")
    control_advertise: str = Field("", description="host:port clients reach this control plane replica at, named "
                                                   "to them by standbys (empty: control_host:control_port)")
    auth_token: str = Field("", description="the cluster's master secret on the control plane, and the token a client "
                                           "sends: the master (operator) or a node token from `pipecast cp "
                                           "issue-token` (empty: auth off; a master needs 16 characters, 8 different: "
                                           "`openssl rand -hex 32`)")
    tls_cert: Path | None = Field(None, description="PEM certificate (TLS on when set with tls_key)")
    tls_key: Path | None = Field(None, description="PEM private key of tls_cert")
    tls_ca: Path | None = Field(None, description="CA for verifying peers; set on the server for mTLS")
    # Floors: a period near 0 passed the cross-checks and spun the control plane (and every agent's heartbeat) at
    # 100% CPU.
    lease_s: float = Field(10.0, ge=0.1, description="worker lease; a worker silent this long is dead. Also the "
                                                   "lease of the leading control plane replica. At least twice "
                                                   "heartbeat_s (the control plane refuses to start otherwise)")
    heartbeat_s: float = Field(2.0, ge=0.05, description="worker heartbeat interval, as the control plane tells its "
                                                      "workers; at most half of lease_s")
    rpc_timeout_s: float = Field(5.0, gt=0, description="deadline of one control-plane call")
    control_scan_s: float | None = Field(
        None, ge=0.01, description="lease scan interval (unset: min(heartbeat, lease/4)); at most lease/4")
    control_flush_s: float = Field(0.5, ge=0.01,
                                   description="how often the control plane writes its state to its database")
    control_metrics_port: int | None = Field(None, ge=0, le=65535,
                                             description="Prometheus port of the control plane (unset: off)")
    # Bounded: no store's egress is thousands of worker links, and a typo (1e9) should not pass for one.
    control_store_links: int = Field(1, ge=1, le=4096, description="a store's egress in worker links: a scale-up "
                                                                   "gives the store this many rotated groups (8: a "
                                                                   "store at 8x the link rate is 8 sources)")
    control_straggler_factor: float = Field(0.5, ge=0, lt=1, description="a receiver slower than this share of "
                                            "what its parents deliver (or of its declared link) is a straggler: "
                                            "its children move to faster parents and it becomes a leaf (0: off)")
    control_straggler_window_s: float = Field(0.4, gt=0,
                                              description="how long a receiver's progress is measured before it may "
                                                          "be called a straggler")
    control_store_beside_holders: bool = Field(True, description="a rotated scale-up also sends from an idle store "
                                                                 "beside the workers holding the package (off: "
                                                                 "the store sends only when nobody else can)")

    # Engine and serving worker.
    device: str = Field("cpu", description="where the engine runs: cpu, cuda, cuda:1 ...")
    serve_host: str = Field("127.0.0.1", description="serving worker listen address")
    serve_port: int = Field(8000, ge=0, le=65535, description="serving worker listen port")
    max_queue: int = Field(64, ge=1, description="requests waiting in a serving worker beyond this get 429 (the "
                                                 "router's own bound is its --max-queue)")
    max_batch: int = Field(16, ge=1, description="sequences sharing one forward pass")

    # Router.
    router_forward_auth: bool = Field(False, description="pass clients' Authorization header on to the workers "
                                                         "(off: dropped, so workers never see client credentials)")
    router_api_keys: dict[str, str] = Field(
        default_factory=dict, description="API key -> tenant; when set, a request needs `Authorization: Bearer <key>` "
                                          "(401 otherwise) and is its key's tenant's. Config file or environment only, "
                                          "never the command line")
    router_tenant_header: str = Field("x-pipecast-tenant", min_length=1,
                                      description="header naming a request's tenant when router_api_keys is empty "
                                                  "(missing: tenant `default`)")
    router_tenant_limits: dict[str, TenantLimit] = Field(
        default_factory=dict, description="tenant -> {rate: requests/s, burst: requests}: a token bucket per tenant; "
                                          "a request beyond it gets 429 with Retry-After (`pipecast router "
                                          "--tenant-limit NAME=RATE:BURST` adds or overrides one)")
    router_default_tenant_limit: TenantLimit | None = Field(
        None, description="the limit of every tenant not in router_tenant_limits (unset: those are unlimited)")
    router_metrics_port: int | None = Field(None, ge=0, le=65535,
                                            description="port serving the router's /metrics to anyone, for Prometheus "
                                                        "(unset: none; with an auth_token the main port's /metrics "
                                                        "needs the serving key)")
    router_tenant_pacing: float = Field(
        2.0, ge=0, description="while other tenants are active, a tenant with a limit is sent to the workers at most "
                               "this many times its rate, so its burst does not fill the others' batches (0: never "
                               "paced)")

    @field_validator("agent_memory_bytes", "agent_reserve_bytes", "agent_relay_bytes", "agent_cache_max_bytes",
                     mode="before")
    @classmethod
    def _size_text(cls, value: Any) -> Any:
        # "16GiB" as the agent's --memory and the Helm chart's values take it; a plain count as it is. Zero with a
        # unit too ("0GiB", as --reserve takes it): each field's own gt/ge says whether 0 (none) is allowed.
        if isinstance(value, str) and not value.strip().isdigit():
            return parse_size(value, allow_zero=True)
        return value

    @field_validator("config", "agent_cache_dir", "agent_local_socket", "tls_cert", "tls_key", "tls_ca",
                     "control_scan_s", "control_metrics_port", "router_metrics_port", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any) -> Any:
        # ``PIPECAST_TLS_CA=`` means unset (as a Path, "" would be "." (the working directory)), as an empty
        # variable of any setting that may be unset does (a template rendering an empty value).
        return None if value == "" else value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # init (CLI overrides) > env > config file > defaults
        config = init_settings.init_kwargs.get("config") or os.environ.get("PIPECAST_CONFIG")
        return (_FirstThatSets(settings_cls, (init_settings, env_settings), _TomlFileSource(settings_cls, config)),)


class _FirstThatSets(PydanticBaseSettingsSource):
    """Each setting whole from the first of ``sources``, then ``file``, that sets it. pydantic-settings would merge a
    setting of several entries across them: a key revoked by ``PIPECAST_ROUTER_API_KEYS`` would stay valid from the
    file. The file is then checked against the settings in force (:meth:`_TomlFileSource.check`)."""

    def __init__(self, settings_cls: type[BaseSettings], sources: tuple[PydanticBaseSettingsSource, ...],
                 file: "_TomlFileSource"):
        super().__init__(settings_cls)
        self.sources, self.file = sources, file

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        values = dict(self.file())
        for source in reversed(self.sources):  # the last wins: the first source's
            values.update(source())
        self.file.check(values)
        return values


class _TomlFileSource(PydanticBaseSettingsSource):
    """Values from a TOML config file (flat keys named as the fields, optionally under [pipecast])."""

    def __init__(self, settings_cls: type[BaseSettings], path: str | Path | None):
        super().__init__(settings_cls)
        self.path = path
        self.read: tuple[os.stat_result, list[str]] | None = None  # the file's status and secrets, once read

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = self.path
        if not path:
            return {}
        try:
            with open(path, "rb") as file:
                info = os.fstat(file.fileno())  # of the file read: a name could be swapped between stat and read
                data = tomllib.load(file)
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise SettingsError(f"config file {path}: {exc}") from exc
        table = data
        if "pipecast" in data:
            table, outside = data["pipecast"], sorted(set(data) - {"pipecast"})
            if not isinstance(table, dict):
                raise SettingsError(f"config file {path}: pipecast must be a table of settings ([pipecast])")
            if outside:  # read, they would be settings ignored without a word (a typo, or auth_token)
                raise SettingsError(f"config file {path}: {', '.join(outside)} outside the [pipecast] table (put "
                                    "every setting in it, or none)")
        if "config" in table:  # no file names another: it would be ignored without a word
            raise SettingsError(f"config file {path}: config names a config file, which only the command line or "
                                "PIPECAST_CONFIG may")
        # Refused here, not by the model: its error named neither the file nor the setting the key likely misspells.
        known = self.settings_cls.model_fields.keys()
        unknown = sorted(set(table) - known)
        if unknown:
            raise SettingsError(f"config file {path}: " + "; ".join(
                f"unknown setting {key}{_did_you_mean(key, known)}" for key in unknown))
        self.read = info, secrets_of(table)
        return table

    def check(self, values: dict[str, Any]) -> None:
        """Refuse the file read if another user could change it and it holds a secret, or the settings in force
        (``values``, from every source) hold one: they could point control_plane and tls_ca at a server of theirs
        and collect a token given by a variable or on the command line just as well. Warn once if others may read
        a file holding a secret (:func:`check_private_file`)."""
        if self.read is None:
            return
        info, held = self.read
        name = f"config file {self.path}"
        if held:
            check_private_file(name, info, ", ".join(held))
        elif in_force := secrets_of(values):
            check_unchangeable(name, info, f"is read with {', '.join(in_force)} from a variable or the command line")


#: Settings that are secrets: the master or a node token, the router's API keys; and control_db where its URL holds
#: a password (:data:`_URL_PASSWORD`).
SECRET_SETTINGS = frozenset({"auth_token", "router_api_keys"})
#: A password in a PostgreSQL URL as libpq reads one: in the user part (before an '@' ahead of the first '/'), or a
#: password parameter.
_URL_PASSWORD = re.compile(r"://[^/]*:[^/]*@|[?&]password=", re.IGNORECASE)
_warned_readable: set[str] = set()  # files holding secrets that others may read, warned of in this process


def secrets_of(values: dict[str, Any]) -> list[str]:
    """The settings of ``values`` that hold a secret (an empty token or key table holds none), sorted."""
    return sorted(name for name, value in values.items()
                  if name in SECRET_SETTINGS and value or name == "control_db" and _URL_PASSWORD.search(str(value)))


def _whom(mode: int, bits: int) -> str:
    """Who besides a file's owner has ``bits`` (0o044: read, 0o022: write) of its ``mode``: group, others or both."""
    return " and ".join(who for who, theirs in (("group", 0o070), ("others", 0o007)) if mode & bits & theirs)


def check_unchangeable(name: str, info: os.stat_result, why: str) -> None:
    """Refuse the file ``name`` (as messages name it: ``config file PATH``) of status ``info`` with
    :class:`SettingsError` if a user other than this process's could change it: it is writable by its group or
    others, or owned by another user than this process's or root (who may change any file). ``why`` it matters
    follows the name in the message (``holds auth_token``). A changed file could send the token to a control plane
    of theirs (control_plane and tls_ca)."""
    mode, me = stat.S_IMODE(info.st_mode), os.getuid()
    if mode & 0o022:
        raise SettingsError(f"{name} {why} and is writable by {_whom(mode, 0o022)} (mode {mode:04o}): "
                            "refused, as another user could change it (chmod go-w)")
    if info.st_uid not in (me, 0):
        raise SettingsError(f"{name} {why} and is owned by uid {info.st_uid} (mode {mode:04o}), neither "
                            f"this user (uid {me}) nor root: refused, as its owner could change it")


def check_private_file(name: str, info: os.stat_result, secrets: str) -> None:
    """Refuse the file ``name`` of status ``info``, which holds ``secrets``, if another user could change it
    (:func:`check_unchangeable`); warn once if others may read it (not its group: a Kubernetes Secret is shared with
    the pod's group, ``fsGroup``, so)."""
    check_unchangeable(name, info, f"holds {secrets}")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o004 and name not in _warned_readable:
        _warned_readable.add(name)
        log.warning("%s holds %s and is readable by others (mode %04o): chmod o-r, or anyone who can read it holds "
                    "the secret", name, secrets, mode)


def read_token_file(path: Path) -> str:
    """The token the file ``path`` holds (``--token-file``), white space around it left out; refused and warned of
    as a config file setting auth_token is (:func:`check_private_file`), and refused when empty."""
    name = f"token file {path}"
    try:
        with open(path, "rb") as file:
            check_private_file(name, os.fstat(file.fileno()), "a token")
            token = file.read().decode().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError(f"{name}: {exc}") from exc
    if not token:
        raise SettingsError(f"{name} is empty")
    return token


def configured_control_plane(settings: Settings) -> str | None:
    """The control plane ``settings`` name by choice (``PIPECAST_CONTROL_PLANE``, the config file, an override),
    not by default: what the agent and the router, which also run without one, register with or learn from."""
    return settings.control_plane if "control_plane" in settings.model_fields_set else None


#: An example value of each setting of several entries, as its PIPECAST_* variable takes it (JSON).
JSON_EXAMPLES = {
    "agent_labels": '{"rack": "r1"}',
    "priority_shares": '{"low": 0.25}',
    "router_api_keys": '{"KEY": "team-a"}',
    "router_tenant_limits": '{"team-a": "5:10"}',
}


#: PIPECAST_* variables that are no setting: the config file's name, and the test suite's and Makefile's own.
OTHER_VARIABLES = frozenset({"PIPECAST_CONFIG", "PIPECAST_VLLM_VENV", "PIPECAST_REQUIRE_POSTGRES",
                             "PIPECAST_REQUIRE_NETNS"})
_warned: set[str] = set()  # unknown variables warned of in this process


def _did_you_mean(name: str, known: Collection[str]) -> str:
    """`` (did you mean X?)``, X the name of ``known`` that ``name`` likely misspells, case aside (difflib's
    ratio is not: AGENT_PORT was close to no setting); empty where none is close."""
    by_lower = {k.lower(): k for k in sorted(known)}
    close = difflib.get_close_matches(name.lower(), by_lower, n=1)
    return f" (did you mean {by_lower[close[0]]}?)" if close else ""


def warn_unknown_variables(environ: dict[str, str] | None = None) -> list[str]:
    """Warn once per process of each ``PIPECAST_*`` variable of ``environ`` (default: this process's) that names
    no setting, with the setting's it likely misspells: the environment, unlike the config file, would ignore it
    without a word (``PIPECAST_AUTH_TOKN`` would leave auth off). Returns those warned of now."""
    known = {f"PIPECAST_{name.upper()}" for name in Settings.model_fields} | OTHER_VARIABLES
    # Case aside: pydantic-settings reads PIPECAST_auth_token as PIPECAST_AUTH_TOKEN.
    unknown = sorted(name for name in (os.environ if environ is None else environ)
                     if name.upper().startswith("PIPECAST_") and name.upper() not in known and name not in _warned)
    for name in unknown:
        _warned.add(name)
        log.warning("environment variable %s is no pipecast setting: ignored%s", name, _did_you_mean(name, known))
    return unknown


#: Settings whose entries' keys are secrets (an API key): an error names the setting, not the key.
SECRET_KEYS = frozenset({"router_api_keys"})


def _where(loc: tuple) -> str:
    """Where a validation error is, as the message shows it: ``setting.key``, or for a key that is a secret
    (:data:`SECRET_KEYS`) the setting and that one of its entries is wrong."""
    if loc and loc[0] in SECRET_KEYS and len(loc) > 1:
        return f"{loc[0]} (an entry; its key, a secret, not shown)"
    return ".".join(map(str, loc))


def check_one_variable_a_setting(environ: Mapping[str, str] | None = None) -> None:
    """Raise :class:`SettingsError` where two ``PIPECAST_*`` variables of ``environ`` (default: this process's) name
    one setting, their names differing in case only: pydantic-settings reads names in any case, and which one
    set it was chance (``PIPECAST_auth_token=`` beside the token turned auth off)."""
    names: dict[str, list[str]] = {}
    for name in (os.environ if environ is None else environ):
        if name.upper().startswith("PIPECAST_"):
            names.setdefault(name.upper(), []).append(name)
    clashes = sorted(sorted(group) for group in names.values() if len(group) > 1)
    if clashes:
        raise SettingsError("environment variables naming one setting, in other cases: " + "; ".join(
            " and ".join(group) for group in clashes) + " (keep one, in upper case)")


def load_settings(config: Path | None = None, **overrides: Any) -> Settings:
    """Build settings; ``overrides`` (CLI flags) whose value is None are ignored. ``PIPECAST_*`` variables that
    name no setting are warned of (:func:`warn_unknown_variables`)."""
    warn_unknown_variables()
    check_one_variable_a_setting()
    try:
        return Settings(config=config, **{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        problems = "; ".join(f"{_where(e['loc'])}: {e['msg']}" for e in exc.errors())
        raise SettingsError(f"invalid settings: {problems}") from None
    except pydantic_settings.SettingsError as exc:  # a PIPECAST_* variable of a dict setting that is not JSON
        field = next((name for name in JSON_EXAMPLES if f'"{name}"' in str(exc)), "agent_labels")
        raise SettingsError(f"invalid settings: {exc}: a setting of several entries takes JSON, e.g. "
                            f"PIPECAST_{field.upper()}='{JSON_EXAMPLES[field]}'") from None

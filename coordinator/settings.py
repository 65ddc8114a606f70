"""Settings, each declared once: its field, environment variable, parser and meaning.

Every setting can be given three ways, and the first one present wins: an argument
(to :func:`coordinator.compile_once`, :meth:`Config.resolve` or
:meth:`JobSettings.resolve`), an environment variable, then the default. The variables
let a launcher switch the coordinator on and tune it without touching the training
script.

Two dataclasses hold them. :class:`Config` is one ``compile_once`` session's settings.
:class:`JobSettings` is what the launcher, the SLURM hooks, the bundle functions and the
logging of a job read around the sessions: the on switch, the log level, the bundle to
restore, save or push, and the SLURM hooks' own settings. Each field names its
variable, its parser and a one-line meaning beside it (:func:`_setting`); the tables
the rest of the package reads (:data:`DESCRIPTIONS`, :func:`variable`, the
``coordinator-run --help`` text) are derived from the fields. No other module reads a
variable of ours from the environment: they ask here, and every yes/no value is read
by :func:`parse_flag`.

Importing this module imports neither torch nor Inductor's compatibility layer: the
cache kinds (:data:`CACHE_KINDS`, :data:`DEFAULT_CACHES`) are looked up at first use.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shlex
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlparse

from coordinator.errors import ConfigError

log = logging.getLogger(__name__)

#: Log levels a job's ``log_level`` may name.
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
DEFAULT_LEVEL = "INFO"
_SLURM_TIMEOUT_S = 300.0


def given(source: str, raw: str) -> str:
    """How an error names a value from the environment or the command line, as it was
    written (a password in it as ``***``, :func:`shown_url`): ``COORDINATOR_LEASE_S=-3``, or
    ``--coordinator-store bogus://x`` for an option."""
    shown = shlex.quote(shown_url(raw))
    return f"{source} {shown}" if source.startswith("-") else f"{source}={shown}"


def parse_flag(raw: str, source: str) -> bool:
    """The one reading of a yes/no setting: 1/true/yes/on or 0/false/no/off, any case.

    Raises:
        ConfigError: ``raw`` is neither, naming ``source`` (the variable it came from).
    """
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{given(source, raw)}: expected one of 1/0, true/false, yes/no, on/off")


def parse_level(raw: str | None, source: str) -> int:
    """A log level's name as a logging level (unset: ``INFO``).

    Raises:
        ConfigError: not one of ``LEVELS``, naming ``source`` (where the value came from).
    """
    name = (raw or DEFAULT_LEVEL).strip().upper()
    if name not in LEVELS:
        raise ConfigError(f"{given(source, raw or '')}: expected one of {', '.join(LEVELS)}")
    return getattr(logging, name)


# Parsers: (where the value came from, the value as written) -> the setting's value.

def _text(source: str, raw: str) -> str:
    return raw


def _seconds(source: str, raw: str) -> timedelta:
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{given(source, raw)}: not a number of seconds") from None
    return timedelta(seconds=value)


def _seconds_or_default(source: str, raw: str) -> float:
    """A number of seconds; anything else is logged and means the default (a hook never fails)."""
    try:
        return float(raw)
    except ValueError:
        log.warning("coordinator slurm: %s=%r is not a number; using %g", source, raw, _SLURM_TIMEOUT_S)
        return _SLURM_TIMEOUT_S


def _integer(source: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{given(source, raw)}: not a whole number") from None


def _flag(source: str, raw: str) -> bool:
    return parse_flag(raw, source)


def _level(source: str, raw: str) -> int:
    return parse_level(raw, source)


def _names(source: str, raw: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in raw.split(",") if part.strip())


def _exactly_one(source: str, raw: str) -> bool:
    return raw == "1"


def _path(source: str, raw: str) -> Path:
    return Path(raw)


def _setting(default: Any, *, env: str, parse: Callable[[str, str], Any], help: str) -> Any:
    """A settings field: its default, its environment variable, how the variable's value
    is read, and one line on what it does (``coordinator-run --help``; ``{cache_kinds}``
    stands for the cache kinds)."""
    return dataclasses.field(default=default, metadata={"env": env, "parse": parse, "help": help})


def _cache_kinds() -> dict:
    from coordinator import _compat

    return _compat.CACHE_KINDS


def __getattr__(name: str) -> Any:
    """``CACHE_KINDS``, ``DEFAULT_CACHES`` and ``DESCRIPTIONS``, computed at first use."""
    if name == "CACHE_KINDS":  # Inductor caches the coordinator can route (one record each)
        return tuple(_cache_kinds())
    if name == "DEFAULT_CACHES":  # routed unless ``caches`` says otherwise
        return tuple(kind_name for kind_name, kind in _cache_kinds().items() if kind.default)
    if name == "DESCRIPTIONS":  # one line per setting: what it does, and its default
        return descriptions()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: The shortest secret taken (``secret``, ``job_secret``): 128 bits.
MIN_SECRET_BYTES = 16

#: The settings whose values are secrets: never shown; set but empty is refused, not unset.
_SECRETS = ("secret", "job_secret")

#: The settings that are whole numbers: each one's least value, and the reason an error gives.
_WHOLE_NUMBERS = (("publish_queue_mb", 0, "must be a whole number of MB, 0 or more"),
                  ("prefetch_mb", 0, "must be a whole number of MB, 0 or more"),
                  ("chunk_bytes", 1024, "must be a whole number of bytes, at least 1024"))


@dataclasses.dataclass(kw_only=True, slots=True)
class Config:
    """Validated settings of one ``compile_once`` session."""

    store: Any = _setting(
        None, env="COORDINATOR_STORE", parse=_text,
        help="where ranks meet: redis://host:port/db, rediss://..., file:///dir (default: the job's TCPStore)")
    """Where ranks meet: ``None`` for the job's torch.distributed store (the TCPStore
    behind the default process group), a ``redis://``/``rediss://`` URL, a ``file://``
    directory, a ``torch.distributed.Store`` or a ``coordinator.Store``. Not an object
    store (``s3://``, ``gs://``, ``az://``): it holds no claims; see ``persist``."""

    persist: str | None = _setting(
        None, env="COORDINATOR_PERSIST", parse=_text,
        help="keep compiled graphs between jobs behind the live store: s3://bucket/prefix, gs://..., az://..., "
             "file:///dir, redis://... (default: none)")
    """The persistent layer behind the live store (``coordinator.features.persistent``): an
    object store (``s3://bucket/prefix``, ``gs://bucket/prefix``, ``az://container/prefix``),
    a ``file://`` directory or a ``redis://``/``rediss://`` URL. A graph missing from the live
    store is looked up here before a rank compiles it, and what the job compiles is written
    here in the background."""

    secret: bytes | None = _setting(
        None, env="COORDINATOR_SECRET", parse=_text,
        help="sign every value with HMAC-SHA256 and refuse unsigned or wrongly signed ones (default: none)")
    """Shared secret: when set, every value is signed with HMAC-SHA256 and unsigned or
    wrongly signed values are refused. At least ``MIN_SECRET_BYTES`` long; with none, the
    job's own store is signed with ``job_secret`` where ``coordinator-run`` made one, and
    everything else (a store URL, the persistent layer, bundles) is checksummed only."""

    job_secret: bytes | None = _setting(
        None, env="COORDINATOR_JOB_SECRET", parse=_text,
        help="set by coordinator-run for its workers: signs the job's own store when no secret is set")
    """A secret one job's processes share (``coordinator-run`` makes one per launch and hands
    it to its workers in their environment): with no ``secret`` set, it signs the values in
    the job's own store, which no later job reads. It never signs what outlives the job."""

    lease: timedelta = _setting(
        timedelta(seconds=20), env="COORDINATOR_LEASE_S", parse=_seconds,
        help="seconds without a heartbeat after which a waiter takes over a compile (default 20)")
    """A claim whose heartbeat has not moved for this long is taken over by a waiter."""

    wait_timeout: timedelta = _setting(
        timedelta(seconds=1800), env="COORDINATOR_WAIT_TIMEOUT_S", parse=_seconds,
        help="longest wait for one graph in seconds; then the rank compiles it itself (default 1800)")
    """Longest wait for one key; past it the waiter compiles locally."""

    progress_interval: timedelta = _setting(
        timedelta(seconds=10), env="COORDINATOR_PROGRESS_S", parse=_seconds,
        help="seconds between a waiting rank's progress lines (default 10)")
    """How often a waiting rank logs a progress line."""

    namespace: str = _setting(
        "", env="COORDINATOR_NAMESPACE", parse=_text,
        help="extra key prefix (model, team) for stores that many jobs share (default: none)")
    """Extra key prefix, e.g. a model or team name, for stores shared across jobs."""

    caches: tuple[str, ...] = _setting(
        None, env="COORDINATOR_CACHES", parse=_names,
        help="comma-separated caches to share: {cache_kinds} (default: all but bundled_autotune)")
    """Which Inductor caches to route through the coordinator (see ``CACHE_KINDS``);
    ``None``: ``DEFAULT_CACHES``."""

    chunk_bytes: int = _setting(
        64 * 1024 * 1024, env="COORDINATOR_CHUNK_BYTES", parse=_integer,
        help="largest single Redis value; larger ones are chunked (default 64 MiB)")
    """Largest single value written to Redis; larger values are split into chunks."""

    publish_queue_mb: int = _setting(
        1024, env="COORDINATOR_PUBLISH_QUEUE_MB", parse=_integer,
        help="MB of entries a rank may have waiting to be published behind its compile; 0 publishes "
             "inside the compile (default 1024)")
    """A rank publishes what it compiled behind its compile, in a thread of its own
    (``coordinator.protocol.writer``): at most this many MB wait at once; an entry past the
    bound is not published (other ranks compile it). 0: publish inside the compile."""

    prefetch_mb: int = _setting(
        1024, env="COORDINATOR_PREFETCH_MB", parse=_integer,
        help="MB of the last run's entries a rank fetches and verifies while its script starts, from the "
             "store URL and the persistent layer; 0 turns it off (default 1024)")
    """Each rank keeps an index of the entries it asked for in the stores a later run can
    reach at its start (a ``store`` URL, the persistent layer); a restarting rank fetches and
    verifies what its last index names, up to this many MB, while its script starts
    (``coordinator.features.prefetch``). 0: no index, no prefetch."""

    drain_timeout: timedelta = _setting(
        timedelta(seconds=300), env="COORDINATOR_DRAIN_TIMEOUT_S", parse=_seconds,
        help="longest wait, when compile_once ends, for the entries still being published and for the "
             "persistent layer's writes, each; then they are dropped (default 300)")
    """When the session ends, the entries still waiting to be published behind the compile
    get up to this long, and then the persistent layer's queued writes as long again; what is
    left is dropped with a warning (the ranks and jobs that need it compile it)."""

    ship_cpu_kernels: bool = _setting(
        True, env="COORDINATOR_SHIP_CPU_KERNELS", parse=_flag,
        help="ship compiled C++ kernels with FX graphs (1/0, default 1)")
    """Ship the compiled C++ kernel libraries with each FX-graph entry (CPU), and on GPUs
    the host C modules Triton built for it (kernel launchers, driver utilities)."""

    triton_kernels: bool = _setting(
        True, env="COORDINATOR_TRITON_KERNELS", parse=_flag,
        help="share Triton kernels outside Inductor (libraries', users') and their autotune results (default 1)")
    """Compile each Triton kernel that Inductor did not generate once per job, and run each
    of its autotunings once per kind of GPU, through Triton's own cache manager
    (``coordinator.features.triton_kernels``); a manager the user installed stays in place."""

    share_local_hits: bool = _setting(
        True, env="COORDINATOR_SHARE_LOCAL_HITS", parse=_flag,
        help="publish graphs found in the local cache, or wait while another rank compiles them (default 1)")
    """When a rank finds an FX graph in its own local cache: publish it if no rank has,
    or wait on the store while another rank compiles it, so that a warm rank neither
    leaves cold ranks compiling nor reaches the first collective long before them."""

    compile_choices_once: bool = _setting(
        True, env="COORDINATOR_COMPILE_CHOICES_ONCE", parse=_flag,
        help="max-autotune: compile each GEMM choice once, in threads of the rank (default 1)")
    """In max-autotune, precompile a GEMM selection's Triton template choices in threads
    of this process rather than in Inductor's compile workers, whose kernels the timing
    does not find on some torch versions and compiles a second time, one at a time
    (``_compat.precompile_choices_in_process``)."""

    signalled_waits: bool = _setting(
        True, env="COORDINATOR_SIGNALLED_WAITS", parse=_flag,
        help="waiting ranks block on the compiling rank's signals instead of polling (default 1)")
    """Waiting ranks block on the claimant's heartbeat and end signals (the c10d store's
    server-side ``wait``, Redis publish/subscribe) instead of polling the store; the
    directory store polls either way. False polls (three reads every 10 to 200 ms)."""

    early_backward: bool = _setting(
        True, env="COORDINATOR_EARLY_BACKWARD", parse=_flag,
        help="a waiting rank compiles the backward graphs it knows meanwhile (default 1)")
    """A rank that waits for another rank's FX graph first compiles the backward graphs
    it already knows, which AOTAutograd would compile one by one at the first backward
    pass (``coordinator.features.early_backward``)."""

    cache_ddp_graphs: bool = _setting(
        True, env="COORDINATOR_CACHE_DDP_GRAPHS", parse=_flag,
        help="serve DDP's split graphs from AOTAutograd's cache (default 1 where torch allows)")
    """Serve the graphs DDPOptimizer splits out of a DDP model from AOTAutograd's cache,
    which bypasses them, so that a restart (and a rank that finds another rank's entry)
    skips AOTAutograd for them (``_compat.cached_split_graphs``). Only on the torch
    versions it was checked on; elsewhere it stays off, with one INFO line."""

    concurrent_splits: bool = _setting(
        True, env="COORDINATOR_CONCURRENT_SPLITS", parse=_flag,
        help="each rank compiles a share of every frame DDPOptimizer splits, at the same time (default 1)")
    """When DDPOptimizer splits a frame of a DDP model into one graph per bucket, the ranks
    compile a share of its graphs each, at the same time, before the chain that compiles
    them one after another, and the chain loads what the others compiled
    (``coordinator.features.split_shares``). Needs ``cache_ddp_graphs`` and more than one rank."""

    warm_compile_pool: bool = _setting(
        True, env="COORDINATOR_WARM_COMPILE_POOL", parse=_flag,
        help="on a GPU, start Inductor's compile workers at the script's torch.compile call (default 1)")
    """On a GPU, start Inductor's pool of compile workers when the session's compile part
    starts (the script's ``torch.compile`` call, ``coordinator.starts``), as Inductor's own
    ``inductor`` backend module does at the first compile, so that the first
    graphs' kernels compile in the workers rather than one by one in the rank
    (``_compat.compile_workers``). Off: torch starts them at the first compile. torch's
    ``TORCH_WARM_POOL=0`` turns off both."""

    precompile: bool = _setting(
        False, env="COORDINATOR_PRECOMPILE", parse=_flag,
        help="share each function's precompiled form, installed without tracing (default 0)")
    """Share each compiled function's precompiled form (Dynamo's caching precompile):
    ranks and later jobs that find it install the function before its first call and
    skip Dynamo's tracing for it (``coordinator.features.precompiled``). Only on the torch
    versions it was checked on. Off by default: while on, torch drops some guards
    (``ID_MATCH``, ``CLOSURE_MATCH``, ``WEAKREF_ALIVE``, ``DICT_VERSION``) from every
    compile of the process, and a model whose frames torch cannot package (HF layers
    under FSDP2: their ``CLASS_MATCH`` guards) restarts slower with it."""

    trace_dir: Path | None = _setting(
        None, env="COORDINATOR_TRACE", parse=_path,
        help="write this rank's coordinator events into this dir, for coordinator report (default: none)")
    """Write this rank's coordinator events (claims, compiles, waits, receives) as Chrome
    trace JSON into this directory, for ``coordinator report`` (``coordinator.observe.trace``)."""

    def __post_init__(self) -> None:
        for name in _SECRETS:
            setattr(self, name, _checked_secret(name, getattr(self, name)))
        for name in ("lease", "wait_timeout", "progress_interval", "drain_timeout"):
            value = getattr(self, name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                value = timedelta(seconds=value)
            if not isinstance(value, timedelta) or value <= timedelta(0):
                raise self._invalid(name, "must be a positive number of seconds (or a positive timedelta)")
            setattr(self, name, value)
        _check_caches(self)
        for name, least, reason in _WHOLE_NUMBERS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise self._invalid(name, reason)
        if not isinstance(self.namespace, str) or not re.fullmatch(r"[A-Za-z0-9._-]*", self.namespace):
            raise self._invalid("namespace", "may only hold letters, digits, '.', '_' and '-'")
        if isinstance(self.trace_dir, str):
            self.trace_dir = Path(self.trace_dir)
        if self.trace_dir is not None and self.trace_dir.exists() and not self.trace_dir.is_dir():
            raise self._invalid("trace_dir", "exists and is not a directory")
        _check_store(self)
        _check_persist(self)

    def _invalid(self, name: str, reason: str) -> ConfigError:
        return _invalid(name, getattr(self, name), reason)

    @property
    def store_secret(self) -> bytes | None:
        """The secret values in the live store are signed with: ``secret``, else the job's
        own (``job_secret``) where the store is the job's TCPStore and nothing is persisted
        (its values die with the job), else none."""
        if self.secret is not None:
            return self.secret
        return self.job_secret if self.store is None and self.persist is None else None

    @classmethod
    def resolve(cls, environ: Mapping[str, str] | None = None, *, sources: Mapping[str, str] | None = None,
                **arguments: Any) -> Config:
        """Build a config: arguments that are not ``None`` first, then the variables of
        ``environ`` (default ``os.environ``), then defaults. ``sources`` names where a
        variable's value came from in errors (``coordinator-run`` passes its options).

        Raises:
            ConfigError: a setting is invalid, naming the variable or argument it came
                from and the value given.
        """
        _say_unknown_variables(os.environ if environ is None else environ)
        if environ is None and _taken_job_secret and variable("job_secret") not in os.environ:
            environ = {**os.environ, variable("job_secret"): _taken_job_secret[0]}
        return _resolve(cls, environ, sources, arguments)

    def replace(self, **arguments: Any) -> Config:
        """This config with the arguments that are not ``None`` in place of its values,
        validated again.

        Raises:
            ConfigError: a setting is unknown or invalid.
        """
        _check_names(type(self), arguments)
        return dataclasses.replace(self, **{name: value for name, value in arguments.items() if value is not None})


@dataclasses.dataclass(kw_only=True, frozen=True)
class JobSettings:
    """What a job reads around its ``compile_once`` sessions: the launcher's switch and log
    level, the bundle settings, and the SLURM hooks' own.

    Values are parsed, not checked against each other or against stores: a bundle URL
    or name is checked by :meth:`check_bundles` where a bad one must stop a job before
    it starts (``coordinator-run``), and otherwise where it is used.
    """

    enable: bool = _setting(
        False, env="COORDINATOR_ENABLE", parse=_flag,
        help="run every worker process under compile_once (set by coordinator-run)")
    log_level: int = _setting(
        logging.INFO, env="COORDINATOR_LOG_LEVEL", parse=_level,
        help="the workers' coordinator log lines: DEBUG, INFO, WARNING, ERROR (default: INFO)")
    restore_bundle: str | None = _setting(
        None, env="COORDINATOR_RESTORE_BUNDLE", parse=_text,
        help="install the bundle saved in this store once per node before the workers start")
    save_bundle: str | None = _setting(
        None, env="COORDINATOR_SAVE_BUNDLE", parse=_text,
        help="rank 0 saves the job's bundle into this store at exit (outbox: into the node's outbox, "
             "for the SLURM Epilog)")
    push_bundle: str | None = _setting(
        None, env="COORDINATOR_PUSH_BUNDLE", parse=_text,
        help="the SLURM Epilog publishes the bundles of the node's outbox to this store")
    bundle_name: str = _setting(
        "default", env="COORDINATOR_BUNDLE_NAME", parse=_text,
        help="the bundle to save or restore (default: default)")
    job_config: str | None = _setting(
        None, env="COORDINATOR_JOB_CONFIG", parse=_text,
        help="a job's settings file for the SLURM hooks (its comment's coordinator.config=PATH)")
    node_cache_dir: str | None = _setting(
        None, env="COORDINATOR_NODE_CACHE_DIR", parse=_text,
        help="the node's Inductor cache dir for a SLURM job, {user}, {uid}, {job} filled in "
             "(default: Inductor's own default dir)")
    slurm_as_user: bool = _setting(
        False, env="COORDINATOR_SLURM_AS_USER", parse=_exactly_one,
        help="set for the SLURM hook's run as the job's user (1)")
    slurm_clean: bool = _setting(
        False, env="COORDINATOR_SLURM_CLEAN", parse=_flag,
        help="the SLURM Epilog removes the node's cache dir (default 0)")
    slurm_timeout: float = _setting(
        _SLURM_TIMEOUT_S, env="COORDINATOR_SLURM_TIMEOUT", parse=_seconds_or_default,
        help="seconds a SLURM hook may take, then the job compiles as usual (default 300)")

    @classmethod
    def resolve(cls, environ: Mapping[str, str] | None = None, *, sources: Mapping[str, str] | None = None,
                names: Iterable[str] | None = None, **arguments: Any) -> JobSettings:
        """Build a job's settings as :meth:`Config.resolve` does, reading from ``environ``
        only the settings in ``names`` (default: all); the others keep their defaults.

        Raises:
            ConfigError: a setting is unknown or invalid, naming the variable (or option)
                and the value given.
        """
        return _resolve(cls, environ, sources, arguments, names)

    def check_bundles(self, sources: Mapping[str, str] | None = None) -> None:
        """Refuse a bundle URL that names no store (``save_bundle`` may be ``outbox``) or a
        bundle name that cannot name a bundle.

        Raises:
            ConfigError: naming the variable or option (``sources``) and the value given.
        """
        for name in ("restore_bundle", "save_bundle", "bundle_name"):
            value = getattr(self, name)
            if not value:
                continue
            try:
                if name == "bundle_name":
                    check_bundle_name(value)
                elif not (name == "save_bundle" and value == "outbox"):
                    check_store_url(value)
            except ConfigError as exc:
                env_name = variable(name)
                raise ConfigError(f"{given((sources or {}).get(env_name, env_name), value)}: {exc}") from None


def enable_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the on switch is set at all (its value is read by :meth:`JobSettings.resolve`):
    the one check ``coordinator/_site/sitecustomize.py`` makes in every process it runs in."""
    return bool((os.environ if environ is None else environ).get(variable("enable"), "").strip())


def take_enable_switch(environ: dict[str, str] | None = None) -> bool:
    """Whether the on switch is on; when it is, it is taken out of ``environ`` (default
    ``os.environ``), so that the processes this one starts do not switch on too, and so is
    the job's secret (``job_secret``), which this process keeps for its sessions.

    Raises:
        ConfigError: the switch's value is not a yes/no value.
    """
    environ = os.environ if environ is None else environ
    if not JobSettings.resolve(environ, names=("enable",)).enable:
        return False
    del environ[variable("enable")]
    secret = environ.pop(variable("job_secret"), None)  # the job's secret, kept in this process only
    if secret:
        _taken_job_secret[:] = [secret]
    return True


#: The job secret ``take_enable_switch`` took out of the environment: :meth:`Config.resolve`
#: reads it where the environment it is given is the process's own.
_taken_job_secret: list[str] = []


#: Object stores: URL scheme -> (the fsspec provider that reaches it, the extra that installs it).
OBJECT_SCHEMES = {"s3": ("s3fs", "s3"), "gs": ("gcsfs", "gcs"), "az": ("adlfs", "azure")}
#: The URL schemes a store can be named by (``coordinator.protocol.stores`` opens each).
STORE_SCHEMES = ("file", "redis", "rediss", *OBJECT_SCHEMES)
#: The forms a store URL takes, as errors name them: where ranks meet, and what outlives a job.
_LIVE_FORMS = ("redis://host:port/db, rediss://..., file:///path, or leave it unset for the job's "
               "torch.distributed store")
_LASTING_FORMS = "s3://bucket/prefix, gs://bucket/prefix, az://container/prefix, file:///dir or redis://host:port/db"
#: The distribution's name, for install hints.
DISTRIBUTION = "torch-compile-coordinator"


def shown_url(url: str) -> str:
    """A store URL (or any setting's text) as a message shows it: as given, every password in
    it replaced by ``***``. The one way a store is named in messages, log lines, errors and
    command output.

    Masked are the user information of ``scheme://user:password@host`` (``user:***@``; a
    user information with no ``:`` as a whole, ``***@``: it may be a token), also where the
    port is not a number and where an unescaped ``/``, ``?`` or ``#`` in the password ends
    the host part early, and the value of every ``name=value`` item of a query or a
    connection string whose name names a credential (redis-py's ``?password=``, an Azure
    SAS token's ``sig=``, a connection string's ``AccountKey=``). It reads no more than
    the text: it never fails, whatever the text holds.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    host_end = min([i for i in (rest.find(c) for c in "/?#") if i >= 0], default=len(rest))
    netloc = rest[:host_end]
    if "@" in netloc:
        at = netloc.rindex("@")
    elif ":" in netloc and "@" in rest[host_end:]:  # a password holding "/", "?" or "#"
        at = rest.index("@", host_end)
    else:
        at = 0
    user, colon, _ = rest[:at].partition(":")
    if at and (colon or sep):  # outside a URL, a "name@" holds no password
        rest = (f"{user}:***" if colon else "***") + rest[at:]
    return _SECRET_ITEM.sub(r"\1***", scheme + sep + rest)


#: A ``name=value`` item (of a query, or of a connection string's ``;``-separated items)
#: whose name names a credential; its value runs to the next ``&``, ``;`` or ``#``.
_SECRET_ITEM = re.compile(r"(?i)((?:^|[?&;])[\w.-]*(?:pass|pwd|secret|token|sig|key|credential|auth)[\w.-]*=)"
                          r"[^&;#]*")


def check_store_url(url: str, *, live: bool = False) -> None:
    """The one check of a store URL, for settings and ``open_store`` alike; it reaches no
    server. ``live``: the URL is the ``store`` setting's, where ranks meet (not an object
    store); else it may also be one (the persistent layer, bundles). Whether the store is
    up is found out at first use, where an unreachable store means compiling locally; a
    URL that can never work is a configuration error. Its errors show the URL as
    :func:`shown_url` does, and the forms the setting takes.

    Raises:
        ConfigError: ``url`` cannot name a store.
    """
    shown = shown_url(url)
    forms = _LIVE_FORMS if live else _LASTING_FORMS
    if "://" not in url:
        raise ConfigError(f"store {shown!r} is not a URL; use {forms}")
    try:
        parsed = urlparse(url)
    except ValueError as exc:  # an unclosed "[" of an IPv6 address
        raise ConfigError(f"store URL {shown!r} cannot be read: {exc}") from None
    if parsed.scheme not in STORE_SCHEMES:
        raise ConfigError(f"unknown store URL scheme {parsed.scheme!r} in {shown!r}; use {forms}")
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ConfigError(f"file store URL {shown!r} names a host; use file:///absolute/path")
        if not parsed.path:
            raise ConfigError(f"file store URL {shown!r} names no directory; use file:///absolute/path")
        if not parsed.path.startswith("/"):
            raise ConfigError(f"file store URL {shown!r} names a relative path; use file:///absolute/path")
        return
    if parsed.scheme in OBJECT_SCHEMES:
        _check_object_url(shown, parsed.scheme, parsed.netloc)
        if live:
            raise ConfigError("an object store keeps bundles and the persistent layer, not a job's live claims: "
                              "give it as persist (COORDINATOR_PERSIST) or a bundle URL, and leave store unset for "
                              "the job's TCPStore")
        return
    _check_redis_url(shown, parsed)


def _check_object_url(shown: str, scheme: str, netloc: str) -> None:
    """An object store URL names a bucket (container), holds no credentials, and its provider
    is installed (looked for, not imported). ``shown``: the URL as errors show it."""
    import importlib.util

    bucket = "container" if scheme == "az" else "bucket"
    if not netloc:
        raise ConfigError(f"object store URL {shown!r} names no {bucket}; use {scheme}://{bucket}/prefix")
    if "@" in netloc:
        raise ConfigError(f"object store URL {shown!r} holds credentials or an account; credentials come from the "
                          "provider's own chain (environment, profile, instance role), never from the URL")
    module, extra = OBJECT_SCHEMES[scheme]
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"{shown!r} needs {module}, which is not installed: pip install {module} (or, from a "
                          f"checkout of {DISTRIBUTION}, pip install \".[{extra}]\")")


def _check_redis_url(shown: str, parsed: Any) -> None:
    """A ``redis://``/``rediss://`` URL as redis-py reads it: a host, a port that is a
    whole number from 1 to 65535 (default 6379), a database that is a whole number
    (the path, or ``?db=``; default 0). ``shown``: the URL as errors show it."""
    form = f"use {parsed.scheme}://[:password@]host:port/db"
    if not parsed.hostname:
        raise ConfigError(f"redis store URL {shown!r} names no host; {form}")
    try:
        port = parsed.port
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise ConfigError(f"redis store URL {shown!r}: the port is not a whole number from 1 to 65535; {form}")
    databases = [parsed.path.strip("/")] if parsed.path.strip("/") else []
    databases += [value for name, value in parse_qsl(parsed.query, keep_blank_values=True) if name == "db"]
    for db in databases:
        if not db.isdigit():
            raise ConfigError(f"redis store URL {shown!r}: the database {db!r} is not a whole number; {form}")


def check_bundle_name(name: str) -> None:
    """Raise ``ConfigError`` unless ``name`` can name a bundle (letters, digits, '.', '_', '-')."""
    if not re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9._-]*", name):
        raise ConfigError(f"bundle name {name!r} may only hold letters, digits, '.', '_' and '-'")


_ALL = (Config, JobSettings)


def variable(setting: str) -> str:
    """The environment variable of ``setting`` (a field of :class:`Config` or :class:`JobSettings`)."""
    for cls in _ALL:
        for field in dataclasses.fields(cls):
            if field.name == setting:
                return field.metadata["env"]
    raise KeyError(setting)


def descriptions(cls: type = Config) -> dict[str, str]:
    """One line per setting of ``cls``: what it does, and its default (``coordinator-run --help``)."""
    kinds = ", ".join(_cache_kinds())
    return {field.name: field.metadata["help"].replace("{cache_kinds}", kinds) for field in dataclasses.fields(cls)}


#: Setting -> environment variable, for each ``Config`` field.
_ENV = {field.name: field.metadata["env"] for field in dataclasses.fields(Config)}
#: Setting -> parser of its variable's value, for each ``Config`` field.
_PARSE_ENV = {field.name: field.metadata["parse"] for field in dataclasses.fields(Config)}


def _resolve(cls: type, environ: Mapping[str, str] | None, sources: Mapping[str, str] | None,
             arguments: Mapping[str, Any], names: Iterable[str] | None = None) -> Any:
    """``cls`` built from the arguments that are not ``None``, else the variables of
    ``environ`` (those of ``names``, default all), else the defaults; an invalid value
    from a variable is named as the variable (or the option of ``sources``) gave it."""
    environ = os.environ if environ is None else environ
    names = None if names is None else set(names)
    _check_names(cls, arguments)
    values: dict[str, Any] = {}
    from_environ: dict[str, str] = {}
    for field in dataclasses.fields(cls):
        env_name = field.metadata["env"]
        if arguments.get(field.name) is not None:
            values[field.name] = arguments[field.name]
        elif (names is None or field.name in names) and (
                environ.get(env_name) or (field.name in _SECRETS and env_name in environ)):
            source = (sources or {}).get(env_name, env_name)
            values[field.name] = field.metadata["parse"](source, environ[env_name])
            from_environ[field.name] = source if field.name in _SECRETS else given(source, environ[env_name])
    try:
        return cls(**values)
    except ConfigError as exc:
        if getattr(exc, "setting", None) in from_environ:
            raise ConfigError(f"{from_environ[exc.setting]}: {exc.reason}") from None
        raise


#: ``COORDINATOR_*`` variables that are no setting but are read by the project's SLURM hooks
#: (``launch/slurm``) and its benchmarks.
_OTHER_VARIABLES = frozenset({"COORDINATOR_HOOK", "COORDINATOR_PYTHON", "COORDINATOR_SLURM_LOG", "COORDINATOR_RUN",
                              "COORDINATOR_TIER_LOG_LEVEL", "COORDINATOR_WHEEL_INSTALLED"})
_told_unknown: set[str] = set()


def unknown_variables(environ: Mapping[str, str]) -> dict[str, str | None]:
    """The ``COORDINATOR_*`` variables of ``environ`` that name no setting, each with the
    setting's variable it is closest to (a misspelling), or ``None``."""
    import difflib

    known = {field.metadata["env"] for cls in _ALL for field in dataclasses.fields(cls)}
    found = {}
    for name in sorted(environ):
        if name.startswith("COORDINATOR_") and name not in known and name not in _OTHER_VARIABLES:
            prefix = len("COORDINATOR_")  # compared after it, which every name shares
            close = difflib.get_close_matches(name[prefix:], sorted(k[prefix:] for k in known), n=1, cutoff=0.75)
            found[name] = "COORDINATOR_" + close[0] if close else None
    return found


def _say_unknown_variables(environ: Mapping[str, str]) -> None:
    """Warn once per process of each ``COORDINATOR_*`` variable that names no setting."""
    for name, close in unknown_variables(environ).items():
        if name not in _told_unknown:
            _told_unknown.add(name)
            log.warning("coordinator: %s is not a setting and is ignored%s", name,
                        f"; did you mean {close}?" if close else " (coordinator-run --help lists the settings)")


def _check_caches(config: Config) -> None:
    kinds = tuple(_cache_kinds())
    if config.caches is None:
        config.caches = tuple(name for name, kind in _cache_kinds().items() if kind.default)
    if isinstance(config.caches, str):
        config.caches = _names("caches", config.caches)
    config.caches = tuple(config.caches)
    unknown = sorted(set(config.caches) - set(kinds))
    if unknown:
        raise config._invalid("caches", f"unknown cache kinds {unknown}; allowed: {', '.join(kinds)}")

def _check_store(config: Config) -> None:
    if isinstance(config.store, str):
        _check_url(config, "store", live=True)
    elif getattr(config.store, "live", True) is False:
        raise config._invalid("store", f"{config.store!r} cannot hold a job's live claims; give it as persist")
    elif config.store is not None:
        import torch.distributed as dist

        # A coordinator.Store is known by its atomic add (the stores' layer sits above this one).
        if not (isinstance(config.store, dist.Store) or callable(getattr(config.store, "add_if_absent", None))):
            raise config._invalid("store", f"cannot use {type(config.store).__name__} as a store; give a URL, "
                                         "a torch.distributed.Store or a coordinator.Store")

def _check_persist(config: Config) -> None:
    if config.persist is None:
        return
    if not isinstance(config.persist, str):
        raise config._invalid("persist", "must be a store URL: s3://bucket/prefix, gs://..., az://..., "
                                       "file:///dir, redis://...")
    _check_url(config, "persist")

def _check_url(config: Config, name: str, *, live: bool = False) -> None:
    """The setting ``name``'s URL checked as every store URL is (:func:`check_store_url`)."""
    try:
        check_store_url(getattr(config, name), live=live)
    except ConfigError as exc:
        raise config._invalid(name, str(exc)) from None


def _checked_secret(name: str, value: str | bytes | None) -> bytes | None:
    """A secret setting's value as bytes; one shorter than ``MIN_SECRET_BYTES`` is refused,
    its value never shown."""
    if isinstance(value, str):
        value = value.encode()
    if value is not None and len(value) < MIN_SECRET_BYTES:
        reason = (f"a secret of {len(value)} bytes is refused: it must be at least {MIN_SECRET_BYTES} bytes "
                  "(unset it to run unsigned)")
        error = ConfigError(f"{name}: {reason}")
        error.setting, error.reason = name, reason
        raise error
    return value


def config_differences(active: Config, other: Config) -> list[str]:
    """Each setting in which ``other`` differs from ``active``, as ``name (VARIABLE): active
    VALUE, requested VALUE``; a secret's value and a password are never shown."""
    found = []
    for field in dataclasses.fields(active):
        mine, theirs = getattr(active, field.name), getattr(other, field.name)
        if mine is theirs or (type(mine) is type(theirs) and mine == theirs):
            continue
        if field.name in _SECRETS:
            shown = ("none" if mine is None else "set",
                     "none" if theirs is None else "set" if mine is None else "another one")
        else:
            shown = (_shown(mine), _shown(theirs))
            if shown[0] == shown[1]:  # they differ where a password is shown as ***
                shown = (shown[0], f"{shown[1]} (another password)")
        found.append(f"{field.name} ({field.metadata['env']}): active {shown[0]}, requested {shown[1]}")
    return found


def _invalid(setting: str, value: Any, reason: str) -> ConfigError:
    """The error for an invalid value of ``setting``, named as an argument (``lease=-3``);
    :meth:`Config.resolve` names the variable instead when the value came from one."""
    error = ConfigError(f"{setting}={_shown(value)}: {reason}")
    error.setting, error.reason = setting, reason
    return error


def _shown(value: Any) -> str:
    """A setting's value as a message shows it: seconds for a timedelta, else its repr (a
    password in a text as ``***``, :func:`shown_url`)."""
    if isinstance(value, timedelta):
        return f"{value.total_seconds():g}s"
    if isinstance(value, Path):
        return repr(str(value))
    if isinstance(value, str):
        return repr(shown_url(value))
    return repr(value)


def _check_names(cls: type, arguments: Mapping[str, Any]) -> None:
    allowed = [field.name for field in dataclasses.fields(cls)]
    unknown = sorted(set(arguments) - set(allowed))
    if unknown:
        raise ConfigError(f"unknown settings {unknown}; allowed: {', '.join(allowed)}")

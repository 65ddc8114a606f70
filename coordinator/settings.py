"""Settings for ``compile_once``, validated in one dataclass.

Every setting can be given three ways, and the first one present wins: an argument
to :func:`coordinator.compile_once` (or :meth:`Config.resolve`), an environment
variable, then the default. ``compile_once``, ``coordinator-run``, the bundle
functions, the CLI and the SLURM hooks all build their settings here, and every
yes/no value is read by :func:`parse_flag`. The environment variables let a launcher switch the
coordinator on and tune it without touching the training script.

===========================  ==================================  ==========================
setting                      environment variable                default
===========================  ==================================  ==========================
store                        COORDINATOR_STORE                   the job's c10d store
secret                       COORDINATOR_SECRET                  none (checksums only)
lease                        COORDINATOR_LEASE_S                 20 s
wait_timeout                 COORDINATOR_WAIT_TIMEOUT_S          1800 s
progress_interval            COORDINATOR_PROGRESS_S              10 s
namespace                    COORDINATOR_NAMESPACE               ""
caches                       COORDINATOR_CACHES                  all but bundled_autotune
chunk_bytes                  COORDINATOR_CHUNK_BYTES             64 MiB
ship_cpu_kernels             COORDINATOR_SHIP_CPU_KERNELS        true
share_local_hits             COORDINATOR_SHARE_LOCAL_HITS        true
compile_choices_once         COORDINATOR_COMPILE_CHOICES_ONCE    true
signalled_waits              COORDINATOR_SIGNALLED_WAITS         true
early_backward               COORDINATOR_EARLY_BACKWARD          true
cache_ddp_graphs             COORDINATOR_CACHE_DDP_GRAPHS        true (where torch allows)
concurrent_splits            COORDINATOR_CONCURRENT_SPLITS       true (with cache_ddp_graphs)
precompile                   COORDINATOR_PRECOMPILE              false
trace_dir                    COORDINATOR_TRACE                   none (no trace)
===========================  ==================================  ==========================
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from coordinator import _compat
from coordinator.errors import ConfigError

#: Inductor caches the coordinator can route (one record each: ``_compat.CACHE_KINDS``).
CACHE_KINDS = tuple(_compat.CACHE_KINDS)
#: Routed unless ``caches`` says otherwise.
DEFAULT_CACHES = tuple(name for name, kind in _compat.CACHE_KINDS.items() if kind.default)

_ENV = {
    "store": "COORDINATOR_STORE",
    "secret": "COORDINATOR_SECRET",
    "lease": "COORDINATOR_LEASE_S",
    "wait_timeout": "COORDINATOR_WAIT_TIMEOUT_S",
    "progress_interval": "COORDINATOR_PROGRESS_S",
    "namespace": "COORDINATOR_NAMESPACE",
    "caches": "COORDINATOR_CACHES",
    "chunk_bytes": "COORDINATOR_CHUNK_BYTES",
    "ship_cpu_kernels": "COORDINATOR_SHIP_CPU_KERNELS",
    "share_local_hits": "COORDINATOR_SHARE_LOCAL_HITS",
    "compile_choices_once": "COORDINATOR_COMPILE_CHOICES_ONCE",
    "signalled_waits": "COORDINATOR_SIGNALLED_WAITS",
    "early_backward": "COORDINATOR_EARLY_BACKWARD",
    "cache_ddp_graphs": "COORDINATOR_CACHE_DDP_GRAPHS",
    "concurrent_splits": "COORDINATOR_CONCURRENT_SPLITS",
    "precompile": "COORDINATOR_PRECOMPILE",
    "trace_dir": "COORDINATOR_TRACE",
}

#: One line per setting: what it does, and its default (``coordinator-run --help``).
DESCRIPTIONS = {
    "store": "where ranks meet: redis://host:port/db, rediss://..., file:///dir (default: the job's TCPStore)",
    "secret": "sign every value with HMAC-SHA256 and refuse unsigned or wrongly signed ones (default: none)",
    "lease": "seconds without a heartbeat after which a waiter takes over a compile (default 20)",
    "wait_timeout": "longest wait for one graph in seconds; then the rank compiles it itself (default 1800)",
    "progress_interval": "seconds between a waiting rank's progress lines (default 10)",
    "namespace": "extra key prefix (model, team) for stores that many jobs share (default: none)",
    "caches": "comma-separated caches to share: " + ", ".join(CACHE_KINDS) + " (default: all but bundled_autotune)",
    "chunk_bytes": "largest single Redis value; larger ones are chunked (default 64 MiB)",
    "ship_cpu_kernels": "ship compiled C++ kernels with FX graphs (1/0, default 1)",
    "share_local_hits": "publish graphs found in the local cache, or wait while another rank compiles them (default 1)",
    "compile_choices_once": "max-autotune: compile each GEMM choice once, in threads of the rank (default 1)",
    "signalled_waits": "waiting ranks block on the compiling rank's signals instead of polling (default 1)",
    "early_backward": "a waiting rank compiles the backward graphs it knows meanwhile (default 1)",
    "cache_ddp_graphs": "serve DDP's split graphs from AOTAutograd's cache (default 1 where torch allows)",
    "concurrent_splits": "each rank compiles a share of every frame DDPOptimizer splits, at the same time "
                         "(default 1)",
    "precompile": "share each function's precompiled form, installed without tracing (default 0)",
    "trace_dir": "write this rank's coordinator events into this dir, for coordinator report (default: none)",
}


def given(source: str, raw: str) -> str:
    """How an error names a value from the environment or the command line, as it was
    written: ``COORDINATOR_LEASE_S=-3``, or ``--coordinator-store bogus://x`` for an option."""
    return f"{source} {shlex.quote(raw)}" if source.startswith("-") else f"{source}={shlex.quote(raw)}"


def _seconds(source: str, raw: str) -> timedelta:
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{given(source, raw)}: not a number of seconds") from None
    return timedelta(seconds=value)


def _integer(source: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{given(source, raw)}: not a whole number") from None


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


def _flag(source: str, raw: str) -> bool:
    return parse_flag(raw, source)


_PARSE_ENV = {
    "store": lambda name, raw: raw,
    "secret": lambda name, raw: raw,
    "lease": _seconds,
    "wait_timeout": _seconds,
    "progress_interval": _seconds,
    "namespace": lambda name, raw: raw,
    "caches": lambda name, raw: tuple(part.strip() for part in raw.split(",") if part.strip()),
    "chunk_bytes": _integer,
    "ship_cpu_kernels": _flag,
    "share_local_hits": _flag,
    "compile_choices_once": _flag,
    "signalled_waits": _flag,
    "early_backward": _flag,
    "cache_ddp_graphs": _flag,
    "concurrent_splits": _flag,
    "precompile": _flag,
    "trace_dir": lambda name, raw: Path(raw),
}


@dataclasses.dataclass(kw_only=True, slots=True)
class Config:
    """Validated settings of one ``compile_once`` session."""

    store: Any = None
    """Where ranks meet: ``None`` for the job's torch.distributed store (the TCPStore
    behind the default process group), a ``redis://``/``rediss://`` URL, a ``file://``
    directory, a ``torch.distributed.Store`` or a ``coordinator.Store``."""

    secret: bytes | None = None
    """Shared secret: when set, every value is signed with HMAC-SHA256 and unsigned or
    wrongly signed values are refused."""

    lease: timedelta = timedelta(seconds=20)
    """A claim whose heartbeat has not moved for this long is taken over by a waiter."""

    wait_timeout: timedelta = timedelta(seconds=1800)
    """Longest wait for one key; past it the waiter compiles locally."""

    progress_interval: timedelta = timedelta(seconds=10)
    """How often a waiting rank logs a progress line."""

    namespace: str = ""
    """Extra key prefix, e.g. a model or team name, for stores shared across jobs."""

    caches: tuple[str, ...] = DEFAULT_CACHES
    """Which Inductor caches to route through the coordinator (see ``CACHE_KINDS``)."""

    chunk_bytes: int = 64 * 1024 * 1024
    """Largest single value written to Redis; larger values are split into chunks."""

    ship_cpu_kernels: bool = True
    """Ship the compiled C++ kernel libraries with each FX-graph entry (CPU), and on GPUs
    the host C modules Triton built for it (kernel launchers, driver utilities)."""

    share_local_hits: bool = True
    """When a rank finds an FX graph in its own local cache: publish it if no rank has,
    or wait on the store while another rank compiles it, so that a warm rank neither
    leaves cold ranks compiling nor reaches the first collective long before them."""

    compile_choices_once: bool = True
    """In max-autotune, precompile a GEMM selection's Triton template choices in threads
    of this process rather than in Inductor's compile workers, whose kernels the timing
    does not find on some torch versions and compiles a second time, one at a time
    (``_compat.precompile_choices_in_process``)."""

    signalled_waits: bool = True
    """Waiting ranks block on the claimant's heartbeat and end signals (the c10d store's
    server-side ``wait``, Redis publish/subscribe) instead of polling the store; the
    directory store polls either way. False polls (three reads every 10 to 200 ms)."""

    early_backward: bool = True
    """A rank that waits for another rank's FX graph first compiles the backward graphs
    it already knows, which AOTAutograd would compile one by one at the first backward
    pass (``coordinator.features.early_backward``)."""

    cache_ddp_graphs: bool = True
    """Serve the graphs DDPOptimizer splits out of a DDP model from AOTAutograd's cache,
    which bypasses them, so that a restart (and a rank that finds another rank's entry)
    skips AOTAutograd for them (``_compat.cached_split_graphs``). Only on the torch
    versions it was checked on; elsewhere it stays off, with one INFO line."""

    concurrent_splits: bool = True
    """When DDPOptimizer splits a frame of a DDP model into one graph per bucket, the ranks
    compile a share of its graphs each, at the same time, before the chain that compiles
    them one after another, and the chain loads what the others compiled
    (``coordinator.features.split_shares``). Needs ``cache_ddp_graphs`` and more than one rank."""

    precompile: bool = False
    """Share each compiled function's precompiled form (Dynamo's caching precompile):
    ranks and later jobs that find it install the function before its first call and
    skip Dynamo's tracing for it (``coordinator.features.precompiled``). Only on the torch
    versions it was checked on. Off by default: while on, torch drops some guards
    (``ID_MATCH``, ``CLOSURE_MATCH``, ``WEAKREF_ALIVE``, ``DICT_VERSION``) from every
    compile of the process, and a model whose frames torch cannot package (HF layers
    under FSDP2: their ``CLASS_MATCH`` guards) restarts slower with it."""

    trace_dir: Path | None = None
    """Write this rank's coordinator events (claims, compiles, waits, receives) as Chrome
    trace JSON into this directory, for ``coordinator report`` (``coordinator.observe.trace``)."""

    def __post_init__(self) -> None:
        if isinstance(self.secret, str):
            self.secret = self.secret.encode()
        if self.secret is not None and len(self.secret) == 0:
            self.secret = None
        for name in ("lease", "wait_timeout", "progress_interval"):
            value = getattr(self, name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                value = timedelta(seconds=value)
            if not isinstance(value, timedelta) or value <= timedelta(0):
                raise self._invalid(name, "must be a positive number of seconds (or a positive timedelta)")
            setattr(self, name, value)
        if isinstance(self.caches, str):
            self.caches = tuple(part.strip() for part in self.caches.split(",") if part.strip())
        self.caches = tuple(self.caches)
        unknown = sorted(set(self.caches) - set(CACHE_KINDS))
        if unknown:
            raise self._invalid("caches", f"unknown cache kinds {unknown}; allowed: {', '.join(CACHE_KINDS)}")
        if not isinstance(self.chunk_bytes, int) or self.chunk_bytes < 1024:
            raise self._invalid("chunk_bytes", "must be a whole number of bytes, at least 1024")
        if not isinstance(self.namespace, str) or not re.fullmatch(r"[A-Za-z0-9._-]*", self.namespace):
            raise self._invalid("namespace", "may only hold letters, digits, '.', '_' and '-'")
        if isinstance(self.trace_dir, str):
            self.trace_dir = Path(self.trace_dir)
        if self.trace_dir is not None and self.trace_dir.exists() and not self.trace_dir.is_dir():
            raise self._invalid("trace_dir", "exists and is not a directory")
        if isinstance(self.store, str):
            from coordinator.protocol.stores import check_store_url

            try:
                check_store_url(self.store)
            except ConfigError as exc:
                raise self._invalid("store", str(exc)) from None
        elif self.store is not None:
            import torch.distributed as dist

            from coordinator.protocol.stores import Store

            if not isinstance(self.store, (Store, dist.Store)):
                raise self._invalid("store", f"cannot use {type(self.store).__name__} as a store; give a URL, "
                                             "a torch.distributed.Store or a coordinator.Store")

    def _invalid(self, name: str, reason: str) -> ConfigError:
        return _invalid(name, getattr(self, name), reason)

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
        environ = os.environ if environ is None else environ
        _check_names(arguments)
        values: dict[str, Any] = {}
        from_environ: dict[str, str] = {}
        for name, env_name in _ENV.items():
            if arguments.get(name) is not None:
                values[name] = arguments[name]
            elif environ.get(env_name):
                source = (sources or {}).get(env_name, env_name)
                values[name] = _PARSE_ENV[name](source, environ[env_name])
                from_environ[name] = given(source, environ[env_name])
        try:
            return cls(**values)
        except ConfigError as exc:
            if getattr(exc, "setting", None) in from_environ:
                raise ConfigError(f"{from_environ[exc.setting]}: {exc.reason}") from None
            raise

    def differences(self, other: Config) -> list[str]:
        """Each setting in which ``other`` differs from this config, as ``name
        (VARIABLE): active VALUE, requested VALUE``; a secret's value is never shown."""
        found = []
        for field in dataclasses.fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            if mine is theirs or (type(mine) is type(theirs) and mine == theirs):
                continue
            if field.name == "secret":
                shown = ("none" if mine is None else "set",
                         "none" if theirs is None else "set" if mine is None else "another one")
            else:
                shown = (_shown(mine), _shown(theirs))
            found.append(f"{field.name} ({_ENV[field.name]}): active {shown[0]}, requested {shown[1]}")
        return found

    def replace(self, **arguments: Any) -> Config:
        """This config with the arguments that are not ``None`` in place of its values,
        validated again.

        Raises:
            ConfigError: a setting is unknown or invalid.
        """
        _check_names(arguments)
        return dataclasses.replace(self, **{name: value for name, value in arguments.items() if value is not None})


def _invalid(setting: str, value: Any, reason: str) -> ConfigError:
    """The error for an invalid value of ``setting``, named as an argument (``lease=-3``);
    :meth:`Config.resolve` names the variable instead when the value came from one."""
    error = ConfigError(f"{setting}={_shown(value)}: {reason}")
    error.setting, error.reason = setting, reason
    return error


def _shown(value: Any) -> str:
    """A setting's value as a message shows it: seconds for a timedelta, else its repr."""
    if isinstance(value, timedelta):
        return f"{value.total_seconds():g}s"
    if isinstance(value, Path):
        return repr(str(value))
    return repr(value)


def _check_names(arguments: Mapping[str, Any]) -> None:
    unknown = sorted(set(arguments) - set(_ENV))
    if unknown:
        raise ConfigError(f"unknown settings {unknown}; allowed: {', '.join(_ENV)}")

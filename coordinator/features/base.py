"""The seam of a compile feature: what it is given, and what it may contribute.

A compile feature changes how a rank compiles or shares its graphs (backward graphs
compiled early, shares of DDP's split frames, whole precompiled functions, ...). Each is
one :class:`Feature` subclass in a module of its own, listed once in
``coordinator.features.FEATURES``. A session builds every listed feature with a
:class:`Context`, the narrow interface to the session (look a key up, publish an entry,
verify one, count, record an event), and asks it:

* :attr:`Feature.part` - the part of the session it belongs to (:class:`Part`), which
  starts at the first sign that it is needed (``coordinator.starts``);
* :meth:`Feature.enabled` - whether it runs, from its settings, the routed cache kinds
  and what this torch supports, asked when its part starts;
* :meth:`Feature.hooks` - the patches of torch it installs when its part starts;
* :meth:`Feature.started` - its part has started and its hooks are in: the place to start
  work in the background (a constructor starts nothing);
* :attr:`Feature.counts` - a dataclass of counters (built from :attr:`Feature.counts_type`),
  shown under :attr:`Feature.name` in ``coordinator.stats()`` (``None`` while the feature is off);
* the lookup-policy methods below, each a no-op by default, which the session calls at
  fixed points of a cache lookup or publish. A feature overrides only those it needs.

The session never names a feature or a cache kind: what differs per kind is in the
kind's record (``_compat.CACHE_KINDS``), and a feature that cares about a kind checks it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from coordinator.features.artifacts import ShippedKernels
    from coordinator.observe.stats import Stats
    from coordinator.observe.trace import NoEvents
    from coordinator.protocol.integrity import Sealed
    from coordinator.protocol.singleflight import LookupResult, Singleflight
    from coordinator.settings import Config


log = logging.getLogger(__name__)


def supported(switch: bool, unsupported: Callable[[], str | None], off_because: str) -> bool:
    """Whether a feature switched on by its setting runs on this torch; ``unsupported()``
    gives why not, logged once at INFO as ``off_because: why``."""
    if not switch:
        return False
    reason = unsupported()
    if reason is not None:
        log.info("compile_once: %s: %s", off_because, reason)
        return False
    return True


class Part(enum.Enum):
    """The parts of a session, each started at the first sign that it is needed
    (``coordinator.starts``); the features of a part are enabled and hooked when it starts."""

    #: What serves every lookup (entries fetched ahead, the persistent layer): started with
    #: the compile part, or at the session's first lookup.
    CORE = "core"
    #: ``torch.compile``'s caches and compiles: started when the script calls
    #: ``torch.compile`` or a frame reaches Dynamo.
    COMPILE = "compile"
    #: Triton's own cache manager and autotuner: hooked once Triton is imported; its lookups
    #: start the core at Triton's first compile or tuning.
    TRITON = "triton"


@dataclasses.dataclass(frozen=True)
class Context:
    """What a feature may use of its session."""

    config: Config
    events: NoEvents
    stats: Stats
    #: The C++ kernels and Triton modules that travel with entries.
    kernels: ShippedKernels
    #: The singleflight client, ``None`` while no store exists.
    flight: Callable[[], Singleflight | None]
    #: ``store_key(kind, inductor_key)``: the store key of an Inductor key of a kind.
    store_key: Callable[[str, str], str]
    #: ``lookup(flight, kind, key)``: look ``key`` up as the session does (the node's
    #: copy first, blocking as its kind allows).
    lookup: Callable[[Singleflight, str, str], LookupResult]
    #: ``publish(flight, kind, key, data, files, extra_meta=None, *, local_copy=False)``:
    #: seal an entry, keep it on this node, publish it; returns whether it was published.
    publish: Callable[..., bool]
    #: ``verify(kind, key, value)``: the sealed value opened and verified, or ``None``
    #: (logged, and recorded as a rejection).
    verify: Callable[[str, str, bytes], Sealed | None]
    #: ``feature(cls)``: the ``Session``'s instance of another feature (``None`` if not listed).
    feature: Callable[[type[Feature]], Feature | None]
    #: ``peers(world, wait_s)``: the ranks of the job that compile for this rank's device
    #: index (``coordinator.protocol.devices``), this rank among them, in rank order.
    peers: Callable[[int, float], list[int]]
    #: ``get(kind, key)`` and ``put(kind, key, data, meta=None)``: a cache's lookup and
    #: save, as Inductor's cache backends make them (``Session.get``, ``Session.put``): for
    #: a feature that routes another cache through the session (Triton's own).
    get: Callable[[str, str], bytes | None]
    put: Callable[..., None]


class Feature:
    """One compile feature. Subclasses set :attr:`name` and override what they need; one
    that counts names its counters' class in its class line: ``class Mine(Feature,
    counts=MineCounts)``."""

    #: Its key in ``coordinator.stats()``; its counts are shown there.
    name: ClassVar[str] = ""
    #: The class of its counters (a ``coordinator.observe.stats.Counts``), built with it;
    #: ``None``: it counts nothing.
    counts_type: ClassVar[type | None] = None
    #: The part of the session it belongs to: enabled and hooked when that part starts.
    part: ClassVar[Part] = Part.COMPILE

    def __init_subclass__(cls, counts: type | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if counts is not None:
            cls.counts_type = counts

    def __init__(self, context: Context) -> None:
        self.context = context
        #: Counters (a dataclass), or ``None`` if it counts nothing.
        self.counts: Any = self.counts_type() if self.counts_type is not None else None

    def enabled(self, routed: frozenset[str]) -> bool:
        """Whether it runs in its ``Session``, given the routed cache kinds (from its
        settings, and whether this torch supports it)."""
        return True

    def hooks(self, routed: frozenset[str]) -> Iterable[contextlib.AbstractContextManager[Any]]:
        """The patches it installs when its part starts, removed when the session ends."""
        return ()

    def started(self) -> None:
        """Its part has started and every hook of that part is in: start what it does in the
        background here (its constructor starts nothing: a session that never starts its
        part pays nothing for it)."""

    # -- a lookup --------------------------------------------------------------------------

    def claims(self) -> list[str] | None:
        """The claim list of a compile this feature runs on this thread (a claimed lookup
        inside it appends its key, released when that compile ends); ``None``: none runs."""
        return None

    def lets_wait(self, kind: str) -> bool:
        """Whether a lookup of ``kind`` on this thread may wait for another rank although
        the kind's rule alone would not let it."""
        return False

    def forbids_waits(self) -> bool:
        """Whether no lookup on this thread may wait (a compile that must never wait runs)."""
        return False

    def work_while_waiting(self, kind: str) -> Callable[[], bool] | None:
        """Work a rank waiting for a key of ``kind`` does first (returns whether it did any)."""
        return None

    def looked_up(self, flight: Singleflight, kind: str, key: str, result: LookupResult,
                  rejected: bytes | None) -> LookupResult:
        """Seen after each lookup, in registry order: may raise ``_compat.SkipCompile`` to
        stop the compile that asked, or return another result (look again after a wait)."""
        return result

    def prepared(self, key: str, *, wait: bool) -> bytes | None:
        """The value of store key ``key`` if this feature fetched it ahead (unverified by
        the session yet); ``None``: look it up. ``wait``: the lookup may wait for a value
        still being fetched."""
        return None

    def asked(self, kind: str, inductor_key: str) -> None:
        """The store was asked for ``inductor_key`` of ``kind`` (hit or miss)."""

    def accepts(self, kind: str, key: str, meta: dict) -> bool:
        """Whether a verified entry with ``meta`` may be loaded; ``False``: a miss."""
        return True

    def missed(self, kind: str, key: str, inductor_key: str) -> None:
        """This rank compiles ``key`` of ``kind`` itself."""

    def publishes(self, flight: Singleflight, kind: str, key: str, data: bytes) -> bool:
        """Inductor saves ``key``'s entry: return ``True`` to publish it in its place
        (later, or as something else)."""
        return False

    def published(self, kind: str, key: str, blob: bytes) -> None:
        """The session published ``blob``, the sealed value of ``key`` of ``kind`` (or tried
        to: the store may have failed)."""

    # -- Inductor's local cache and AOTAutograd -------------------------------------------

    def served_locally(self, inductor_key: str, remote_value: Callable[[], bytes | None],
                       kernel_paths: list[str], local_key: str = "", compile_s: float = 0.0) -> None:
        """Inductor served FX graph ``inductor_key`` from a cache (the local one unless the
        store was asked); ``remote_value`` builds its entry as Inductor would publish it;
        ``local_key`` is Inductor's own key of it, ``compile_s`` the compile time its entry
        records."""

    def keeps_locally(self, local_key: str) -> bool:
        """Whether Inductor may write the FX graph of ``local_key`` to its local cache."""
        return True

    def backward_deferred(self, backward: Any) -> bool:
        """AOTAutograd deferred a backward graph's compile; returns whether it took it."""
        return False

    def compile_ended(self) -> None:
        """An outermost compile ended."""

    def close(self) -> None:
        """Its session closes: finish, within a deadline, or stop what it does in the background."""

"""DDP's split graphs compiled at the same time: each rank compiles a share of a frame.

DDPOptimizer splits each frame of a DDP model into one submodule per gradient bucket and
compiles them in a chain, each compile handed the previous one's fake outputs; every rank
walks that chain, so with the other ranks' graphs loaded instead of compiled a job's cold
start still takes one chain's time. Yet all K submodules are known the moment the frame
is split, and their inputs follow from running the earlier submodules, uncompiled, on fake
tensors (``_compat.SplitFrame``).

So when a frame is split, before its chain, each rank compiles a share of its submodules:

* **Shares.** Submodules are dealt to the job's ranks that compile for this rank's device
  index (``coordinator.protocol.devices``: ranks on other indices compile under other keys)
  by their operator counts, largest first, each to the rank with the least so far (ties:
  lowest index, lowest rank).
  Submodules of one kind (identical layers: the same operations on inputs of the same
  sizes, which compile to the same FX graphs) go to one rank together, where the first
  compiles the graphs and the others find them in Inductor's cache. Every rank computes
  the same deal from the same frame. A frame split again (Dynamo's recompile of the same
  frame, into as many submodules) is dealt by what each submodule's compile took the first
  time, as its owner published it with its slot, where every slot has that value; else
  by operator counts again.
* **Slots.** Each submodule has a slot in the store, keyed by the job, a digest of the
  split frame that every rank computes alike, the compile settings, and its index. A rank
  claims the slots of a group just before it compiles it, compiles each submodule from its
  propagated inputs (forward, first call, backward, AOTAutograd entry: what the chain would
  do), publishes the entries through the store as any compile does, then publishes the
  slot. A global "done" mark lets a later job skip the submodules already in the store.
* **Taking unstarted work.** Operator counts only estimate what a compile costs (a rank's
  first compile also pays its one-time set-up): a rank done with its own groups goes on
  with the groups of other ranks that nobody has claimed yet, those their owners would
  reach last first (:func:`work_order`). The claim decides; a group already claimed is
  passed over. So every slot is claimed before any rank that tried it starts its chain.
* **The chain.** Then every rank walks the chain as DDPOptimizer does. Where a submodule's
  AOTAutograd entry is not in the store, the rank follows its slot: it waits while the
  slot's owner holds it, then reads the entry again. A slot that nobody claims within a
  short grace, that its owner abandons (a graph it needed was being compiled elsewhere, or
  its compile failed) or whose owner's lease lapses (it died), leaves that submodule to the
  chain, which compiles it as before: AOTAutograd here, Inductor once per job through the
  FX graphs' own claims. So AOTAutograd runs once per split graph and job.

Why no wait cycle forms: slots are claimed only in a share, before the chain (taking
another rank's group is a claim like any other, made under the same rule). A share
waits on nothing: its lookups return at once (``Singleflight.no_waits``), an FX graph that
another rank is compiling stops that submodule's compile (``SkipCompile``; its slot is
abandoned), and it runs no collective; so every slot it claims is published or abandoned
without waiting, or lapses with its owner's lease. A rank follows a slot only in its
chain, holding no claim. Every wait on a slot therefore points at a rank in a step that
waits for nobody.

Why a propagated input gives the chain's key or a miss: the share compiles under the key
AOTAutograd computes from the propagated inputs, and the chain finds the entry only under
the key it computes from its own; an input that differs in anything the key reads (sizes,
strides, storage offsets, dtypes, requires_grad, ...: Inductor gave the previous
submodule's output other strides) gives the chain another key, so it misses and compiles,
as without shares. The entry's fake outputs are checked against the FX entry again when
they are served (``_compat.split_graphs``). The chain's misses of a slot are counted.
"""

from __future__ import annotations

import heapq
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Any

from coordinator import _compat
from coordinator.features.base import Context, Feature
from coordinator.observe.stats import Counts
from coordinator.observe.trace import short_key
from coordinator.protocol.liveness import job_id
from coordinator.protocol.outcome import Outcome
from coordinator.protocol.singleflight import LookupResult, Singleflight

log = logging.getLogger(__name__)

#: How long the chain looks for the claim of a slot that nobody holds yet (its owner may
#: still be tracing the frame) before it compiles the submodule itself.
CLAIM_GRACE_S = 5.0


class FrameCounts(Counts, graphs=0, dealt=0, compiled=0, taken=0, served=0, missed=0, compile_id="", share_s=0.0,
                  chain_s=0.0, waited_s=0.0, costs_from=""):
    """One split frame, as this rank saw it (frames numbered in the order this process
    split them, the same on every rank that runs the same steps): its submodules (split
    ``graphs``); those the deal gave this rank (``dealt``); those this rank ``compiled`` for
    the job, ``taken`` of them from another rank's deal once its own were done; those whose AOTAutograd entry
    this rank's chain found (``served``: in its own cache, or in the store, at once or after
    waiting); those this rank's chain compiled itself (``missed``); Dynamo's id of the
    frame's compile (``compile_id``, ``"0/1"``), as tlparse names it; the seconds this rank
    spent on its share of the frame (``share_s``: its inputs, claims, compiles) and those of
    the frame's chain on this rank (``chain_s``: looking up, waiting for, loading or compiling
    each submodule), not counting the backward graphs it compiled lazily, ``waited_s`` of
    them waiting on other ranks' shares; and what the deal weighed its submodules by
    (``costs_from``: ``"operators"``, or ``"seconds of frame #N"``, the first split of the
    same frame)."""


class SplitShareCounts(Counts, compiled=0, skipped=0, lost=0, failed=0, seconds=0.0, waited=0, missed=0,
                       frames=list):
    """What one rank's shares of split frames did: submodules this rank ``compiled`` for the
    job (their entries saved and published); submodules of its share it ``skipped`` (already
    in the store, or one of their graphs was being compiled by another rank); submodules of
    its deal another rank claimed first (``lost``: taken, or claimed in an earlier try); share compiles
    that ``failed`` (raised: the chain compiles them); ``seconds`` in shares (propagating
    inputs and compiling); submodules of other ranks' shares the chain ``waited`` for and then
    loaded; submodules of split frames the chain compiled itself (``missed``: an entry not
    found, a propagated input that differed from the chain's or an owner that gave up or
    died, or a frame whose submodules no rank shared: this rank alone, or alone on its device
    index, or no store); and each split frame's :class:`FrameCounts` (``frames``), in the
    order this process split them."""

    def summary(self) -> str:
        if not (self.compiled or self.skipped or self.lost or self.failed or self.waited or self.missed):
            return ""
        frames = ", ".join(f"#{n} {f.graphs} graphs: {f.compiled} compiled here ({f.share_s:.1f}s; dealt {f.dealt}, "
                           f"taken {f.taken}), {f.served} served, {f.missed} missed ({f.chain_s:.1f}s, "
                           f"{f.waited_s:.1f}s waiting)" for n, f in enumerate(self.frames))
        return (f"split graphs compiled for the job: {self.compiled} ({self.seconds:.1f}s), {self.skipped} skipped, "
                f"{self.lost} taken by other ranks, {self.failed} failed; waited for {self.waited}, {self.missed} "
                f"compiled in the chain"
                + (f"; per frame in the chain: {frames}" if frames else ""))


#: What a submodule costs its rank when another of its kind compiled before it on that rank:
#: AOTAutograd traces it (its own key), Inductor finds its graphs in the local cache.
REPEAT_COST = 0.3


def kind_groups(count: int, kinds: list[str] | None) -> list[list[int]]:
    """The indices of ``count`` submodules grouped by kind (none given: each its own), by first index."""
    groups: dict[str, list[int]] = {}
    for index, kind in enumerate(kinds if kinds is not None else map(str, range(count))):
        groups.setdefault(kind, []).append(index)
    return list(groups.values())


def deal(costs: list[float], world: int, kinds: list[str] | None = None) -> list[int]:
    """The rank that compiles each submodule. Submodules of one kind (``kinds``: the same
    graphs, which Inductor compiles once and then finds in its cache) go to one rank
    together, as a group that costs its first member's cost and :data:`REPEAT_COST` of
    each other's; groups largest first, each to the rank with the least cost so far (ties:
    lower first index, lower rank). Spread over ranks, a second member would meet its
    graphs being compiled by another rank (a share waits on nothing: the chain would
    compile it)."""
    def cost(members: list[int]) -> float:
        return costs[members[0]] + REPEAT_COST * sum(costs[index] for index in members[1:])

    owners = [0] * len(costs)
    loads = [(0.0, rank) for rank in range(world)]
    heapq.heapify(loads)
    for members in sorted(kind_groups(len(costs), kinds), key=lambda members: (-cost(members), members[0])):
        load, rank = heapq.heappop(loads)
        for index in members:
            owners[index] = rank
        heapq.heappush(loads, (load + cost(members), rank))
    return owners


def work_order(owners: list[int], rank: int, kinds: list[str] | None = None) -> list[list[int]]:
    """The groups of submodules ``rank`` tries to compile, in order: its own (the deal's
    ``owners``; submodules of one kind together), by first index; then, once those are done,
    the other ranks' groups that their owners reach last, first (the last group of each
    owner, then the one before it, ...; ties: lower owner). A group another rank claimed
    first is passed over, so a rank whose share went quickly takes unstarted work from a
    rank whose share goes slowly, and none sits waiting while work is left unstarted."""
    per_owner: dict[int, list[list[int]]] = {}
    for members in kind_groups(len(owners), kinds):  # the deal gives a kind's group one owner
        per_owner.setdefault(owners[members[0]], []).append(members)
    theirs = sorted(((len(owned) - position, owner, members) for owner, owned in per_owner.items() if owner != rank
                     for position, members in enumerate(owned)), key=lambda item: (item[0], item[1]))
    return per_owner.get(rank, []) + [members for _, _, members in theirs]


def job_ranks() -> tuple[int, int]:
    """(rank, world size) of this process in its job: torchrun's environment, else the
    default process group, else a lone rank."""
    if os.environ.get("RANK") and os.environ.get("WORLD_SIZE"):
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class SplitShares(Feature, counts=SplitShareCounts):
    """One rank's shares of the frames DDPOptimizer splits, and the chain's slot waits."""

    name = "split_shares"

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        self._flight = context.flight
        self._store_key = context.store_key
        self._events = context.events
        self._job: str | None = None
        self._running = threading.local()
        #: (id of a split frame, index) -> (its slot's key, its "done" mark's key).
        self._slots: dict[tuple[int, int], tuple[str, str]] = {}
        #: A split frame -> its number (the order this process split them in).
        self._numbers: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        #: (Dynamo's frame id, submodules) -> the number and slot keys of the first frame
        #: split so that had shares: a recompile of it is dealt by their measured seconds.
        self._first_split: dict[tuple[str, int], tuple[int, list[str]]] = {}

    def compiling(self) -> bool:
        """Whether this thread is compiling a share's submodule."""
        return getattr(self._running, "share", False)

    # -- the feature's seam --------------------------------------------------------------

    def enabled(self, routed: frozenset[str]) -> bool:
        """Where the split graphs are served from AOTAutograd's cache: the chain loads the
        shares through it."""
        config = self.context.config
        return (config.concurrent_splits and config.cache_ddp_graphs and {"aot_autograd", "fx_graph"} <= routed
                and _compat.split_graphs_unsupported() is None)

    def hooks(self, routed: frozenset[str]) -> Iterable:
        return (_compat.split_frames(self.before_chain, self.chain_compiled, self.chain_ended),)

    def looked_up(self, flight: Singleflight, kind: str, key: str, result: LookupResult,
                  rejected: bytes | None) -> LookupResult:
        if kind == "fx_graph" and result.value is None and result.outcome != Outcome.CLAIMED and self.compiling():
            # A share waits on nothing: a graph another rank is compiling leaves this
            # submodule to the chain.
            raise _compat.SkipCompile(f"FX graph {key}: {result.outcome}")
        if kind == "aot_autograd" and rejected is None and result.value is None:
            return self._follow_share(flight, kind, key, result)
        return result

    def _follow_share(self, flight: Singleflight, kind: str, key: str, result: LookupResult) -> LookupResult:
        """A split frame's chain found no AOTAutograd entry: wait while another rank
        compiles that submodule for the job, then look again."""
        position = _compat.chain_position()
        if position is not None and self.follow(flight, position):
            result = self.context.lookup(flight, kind, key)
        return result

    def chain_compiled(self, frame: Any, index: int, served: bool) -> None:
        """The chain of a split frame is past submodule ``index``: AOTAutograd's cache
        served it (this rank's own cache, or the store), or the chain compiled it."""
        number = self._numbers.get(frame)
        if number is None:  # a frame of one submodule: no shares
            return
        counts = self.counts.frames[number]
        if served:
            counts.served += 1
        else:
            counts.missed += 1
            self.counts.missed += 1
        slot = self._slots.get((id(frame), index))
        self._events.instant("chain", key=short_key(slot[0]) if slot else "", frame=number, index=index,
                             outcome="served" if served else "missed")

    def chain_ended(self, frame: Any, began: float) -> None:
        """The chain of a split frame ended (its frame's compile went on, or raised);
        ``began`` (``time.time()``) is when the frame was split."""
        number = self._numbers.get(frame)
        if number is None:
            return
        counts = self.counts.frames[number]
        counts.chain_s = max(time.time() - began - counts.share_s, 0.0)
        self._events.span("split frame", began, frame=number, graphs=counts.graphs, share_s=round(counts.share_s, 3),
                          chain_s=round(counts.chain_s, 3), waited_s=round(counts.waited_s, 3), dealt=counts.dealt,
                          compiled=counts.compiled, taken=counts.taken)

    def backward_deferred(self, backward: Any) -> bool:
        """A share's own backward is compiled with it."""
        return _compat.capture_backward(backward)

    # -- the share -------------------------------------------------------------------------

    def before_chain(self, frame: Any) -> None:
        """Called with a frame DDPOptimizer just split: compile this rank's share of it."""
        self._numbers[frame] = len(self.counts.frames)
        counts = FrameCounts(graphs=len(frame), compile_id=_compat.current_compile_id() or "")
        self.counts.frames.append(counts)
        flight = self._flight()
        rank, world = job_ranks()
        if flight is None or world < 2:
            return
        # Only ranks on this rank's device index compile under its keys.
        peers = self.context.peers(world, CLAIM_GRACE_S)
        if len(peers) < 2:
            return
        if frame.has_symbolic_floats():
            # Its chain may make Dynamo trace it again (specializing the float): shares
            # compiled before that would be thrown away. The chain compiles it, as stock.
            log.debug("compile_once: a split frame computes with a symbolic float; no shares for it")
            return
        started = time.monotonic()
        try:
            slots = self._slot_keys(frame)
            costs, kinds = self._costs(flight, frame, counts, [slot for slot, _ in slots]), frame.kinds()
            owners = [peers[owner] for owner in deal(costs, len(peers), kinds)]
            counts.dealt = owners.count(rank)
            log.debug("compile_once: split frame #%d (%s): costs %s, kinds %s, owners %s",
                      len(self.counts.frames) - 1, counts.compile_id, costs, [k[:6] for k in kinds], owners)
            # Each group is claimed just before it is compiled: a rank done with its own
            # takes the groups nobody has started.
            for group in work_order(owners, rank, kinds):
                mine = owners[group[0]] == rank
                for index in self._claim(flight, [slots[i][0] for i in group], group, len(frame), mine):
                    self._compile(flight, frame, index, *slots[index], taken=not mine)
        except Exception as exc:  # never fail the frame over a share: the chain compiles it all
            if _compat.is_restart(exc):
                flight.abandon_all(_not_triton)
                log.debug("compile_once: a share asked Dynamo to trace its frame again (%s)", type(exc).__name__)
                raise
            log.warning("compile_once: compiling this rank's share of a split frame failed", exc_info=True)
            flight.abandon_all(_not_triton)
        finally:
            counts.share_s = time.monotonic() - started
            self.counts.seconds += counts.share_s

    def _costs(self, flight: Singleflight, frame: Any, counts: FrameCounts, slots: list[str]) -> list[float]:
        """What each submodule of ``frame`` costs the deal: the seconds its compile took in
        the first split of the same frame (Dynamo's frame id, as many submodules), as each
        owner published them with its slot, where all of them are in the store; else its
        operator count. Every rank reads the same published values (the first frame's
        chains waited for them), so every rank deals alike; one that reads otherwise deals
        otherwise, and the claims still give each submodule one rank."""
        family = (counts.compile_id.split("/")[0], len(frame))
        first = self._first_split.get(family) if family[0] else None
        if first is None:
            if family[0]:
                self._first_split[family] = (len(self.counts.frames) - 1, slots)
            counts.costs_from = "operators"
            return [float(cost) for cost in frame.costs()]
        number, earlier = first
        try:
            seconds = [float(flight.lookup(slot, blocking=False).value or b"") for slot in earlier]
        except ValueError:  # a slot with no value (its submodule left to the chains) or the store's silence
            counts.costs_from = "operators"
            return [float(cost) for cost in frame.costs()]
        counts.costs_from = f"seconds of frame #{number}"
        return seconds

    def _slot_keys(self, frame: Any) -> list[tuple[str, str]]:
        """Each submodule's slot (this job's) and "done" mark (any job's) keys."""
        if self._job is None:
            self._job = job_id()
        identity = f"{frame.identity()}/{_compat.compile_settings_digest()}"
        keys = [(self._store_key("split_share", f"{self._job}/{identity}/{i}"),
                 self._store_key("split_done", f"{identity}/{i}")) for i in range(len(frame))]
        for index, pair in enumerate(keys):
            self._slots[(id(frame), index)] = pair
        return keys

    def _claim(self, flight: Singleflight, slots: list[str], indices: list[int], parts: int, mine: bool) -> list[int]:
        """Claim ``slots`` (those of ``indices``, of a frame of ``parts`` submodules; ``mine``:
        dealt to this rank); returns the indices claimed. Each claim says which part it
        compiles, for the chains that wait on it."""
        claimed = []
        with flight.no_waits():
            for slot, index in zip(slots, indices, strict=True):
                what = _compat.compiling_now(part=(index, parts))
                if flight.lookup(slot, blocking=True, what=what).outcome == Outcome.CLAIMED:
                    claimed.append(index)
                elif mine:
                    self.counts.lost += 1  # another rank claimed it first (or published it)
        return claimed

    def _compile(self, flight: Singleflight, frame: Any, index: int, slot: str, done: str, *, taken: bool) -> None:
        """Compile submodule ``index`` of ``frame`` for the job (``taken``: from another
        rank's deal), then end its slot."""
        if flight.lookup(done, blocking=False).value is not None:
            self.counts.skipped += 1  # a job before this one compiled it: in the store
            _mark(flight, slot, b"in the store")  # no seconds to deal a recompile by
            return
        began = time.time()
        outcome = "failed"
        seconds = 0.0
        self._running.share = True
        try:
            with flight.no_waits():
                saved = frame.compile(index)
            seconds = time.time() - began
            outcome = "compiled" if saved else "skipped"
        except Exception as exc:
            if _compat.is_restart(exc):
                # Dynamo traces the frame again (as the chain's compile of this submodule
                # would have made it): the slot ends, and so does this frame's chain.
                flight.abandon(slot)
                raise
            if _compat.is_skip(exc):
                outcome = "skipped"
            else:
                log.warning("compile_once: compiling split graph %d of a frame for the job failed; the chain "
                            "will compile it", index, exc_info=True)
        finally:
            self._running.share = False
        setattr(self.counts, outcome, getattr(self.counts, outcome) + 1)
        number = self._numbers[frame]
        if outcome == "compiled":
            self.counts.frames[number].compiled += 1
            self.counts.frames[number].taken += taken
        self._events.span("share", began, key=short_key(slot), frame=number, index=index, outcome=outcome,
                          taken=taken)
        if outcome == "compiled":
            # Behind its entries, which the writer publishes first: a follower woken by
            # the slot finds them. The slot's value is the compile's seconds, which a
            # recompile of the frame is dealt by.
            _mark(flight, done)
            _mark(flight, slot, f"{seconds:.3f}".encode())
            log.debug("compile_once: compiled split graph %d of a frame for the job", index)
        else:
            flight.abandon(slot)

    # -- the chain ---------------------------------------------------------------------------

    def follow(self, flight: Singleflight, position: tuple[Any, int]) -> bool | None:
        """The chain found no entry for the submodule at ``position``: wait on its slot
        while another rank compiles it. Returns whether to look the entry up again
        (``None``: the frame has no slots: this rank is alone, or has no store)."""
        keys = self._slots.get((id(position[0]), position[1]))
        if keys is None:
            return None
        began = time.monotonic()
        result = flight.follow(keys[0], grace_s=CLAIM_GRACE_S)
        number = self._numbers.get(position[0])
        if number is not None:
            self.counts.frames[number].waited_s += time.monotonic() - began
        if result.outcome in ("hit", "waited"):
            if result.outcome == "waited":
                self.counts.waited += 1
            return True
        if result.outcome != "nonblocking":
            log.info("compile_once: split graph %d: its share %s; compiling it in the chain",
                     position[1], {"unclaimed": "was not claimed", "abandoned": "was given up",
                                   "expired": "owner stopped", "deadline": "took too long"}.get(
                         result.outcome, result.outcome))
        return False


def _not_triton(store_key: str) -> bool:
    """Whether ``store_key`` (``<prefix>/<kind>/<digest>``) is not a Triton kind's: a Triton
    compile on another thread releases its own claims."""
    return not store_key.rsplit("/", 2)[-2].startswith("triton")


def _mark(flight: Singleflight, key: str, value: bytes = b"1") -> None:
    """Publish a share's mark ``key`` behind the compile."""
    flight.publish_behind(key, lambda: value, nbytes=len(value), what=f"split share {short_key(key)}")

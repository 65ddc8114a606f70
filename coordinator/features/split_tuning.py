"""Max-autotune's GEMM selections timed in shares: the ranks that reach one tune it together.

In max-autotune Inductor precompiles and times every choice of a GEMM selection (Triton
templates, ATen) on the rank's device and keeps the fastest. Where each rank of the node
has a GPU of its own, the ranks that reach the same selection at about the same time
(different graphs with the same GEMM: a transformer's layers in DDP's buckets, split
frames' shares, early backward compiles) split its choices instead, over the store and
never in a collective (``_compat.split_selections`` hands each selection here):

* **The key.** A selection is known by Inductor's own key of it: the operation's name, its
  input layouts, the float32 matmul precision and every choice's hash
  (``_compat.Selection.key``), with the number of shares, under the session's store key
  (which names the environment and the GPU model): ranks with other GPU models, another
  torch, or another share count never meet.
* **The split.** Its choices, sorted by hash (ties: Inductor's order), go round the shares
  in turn: the choice at sorted position ``p`` is in share ``p % N``, where ``N`` is the
  number of local ranks. Every rank computes the same split; the shares are disjoint and
  cover every choice.
* **Shares are claims.** Share ``s`` is the singleflight key ``split_tuning/<digest>``
  (its ``.../share/s``), with the lease, heartbeat and takeover of every claim. A rank
  that reaches the selection goes round the shares starting at its own (its rank modulo
  ``N``), claiming each that nobody holds and timing it (Inductor's own precompile,
  timing cache and benchmark, on those choices alone), one share at a time; then it waits
  on the store for the shares others hold, and takes over one whose holder's lease lapses.
  A share it cannot get (its holder gave up, the deadline passed, the store failed) it
  times itself, unclaimed.
* **Timings are written once per job.** A share's timings (msgpack ``{hash: ms}``, sealed as every
  value is: checksum, HMAC with a secret, the key) are settled with an atomic
  create-if-absent (``Singleflight.settle``) before the claim publishes them: whoever
  times a share, a taker, a late original holder, or a rank past its deadline, every rank
  reads the first value settled. So every rank merges the same timings. The keys name the
  job (``Singleflight.job``): a later job on a shared store times its own GPUs, and no
  measurement outlives the job that made it as the one every job uses.
* **The winner.** The merged timings go back to Inductor ordered by sorted hash, and
  Inductor keeps the first minimum: the fastest over all shares, ties to the lower sorted
  position, the same on every rank that tuned the selection in shares.

A rank that reaches the selection alone claims every share in turn and times them all:
what it did before, plus one store call per share. A rank that loads the graph instead
of compiling it never meets the selection and takes no part.

**Who takes part.** ``split_tuning`` on, two local ranks or more, and a GPU of the rank's
own (``_compat.gpu_identity``: it sees ``LOCAL_WORLD_SIZE`` GPUs and uses the one of its
local rank, or sees exactly one), which no other process of the job has marked as its own
in the store (the first to mark a GPU takes part; the others on it tune as Inductor does).
Ranks that share a GPU would time each other's kernels, and ranks with other GPU models
never share a key: both tune as today.

**Why no wait cycle forms.** A share is a leaf step: holding its claim, the rank precompiles
and times choices on its own GPU, runs no collective, and every lookup it makes returns at
once (it holds a claim: ``Singleflight`` lets it wait nowhere), so the share ends,
published or abandoned, or lapses with its holder's lease. A rank waits on a share only
after it has ended every share it claimed (``Singleflight.claim_or_follow``), possibly
while it holds the FX-graph claim of the graph it compiles: the rank it waits on is inside
a share and waits on nobody. So the wait graph gains edges only into ranks with no edge
out (``docs/design.md``, "Waits never form a cycle").
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Iterable

import msgpack

from coordinator import _compat
from coordinator.features.base import Context, Feature, supported
from coordinator.observe.stats import Counts
from coordinator.observe.trace import short_key
from coordinator.protocol.integrity import seal
from coordinator.protocol.liveness import job_id
from coordinator.protocol.outcome import Outcome
from coordinator.protocol.singleflight import Singleflight

log = logging.getLogger(__name__)

#: The store kind of a share's key, and of a GPU's mark.
KIND = "split_tuning"
GPU_MARKS = "split_tuning_gpu"


class SplitTuningCounts(Counts, selections=0, shares_timed=0, taken_over=0, choices_timed=0, shares_received=0,
                        timed_unclaimed=0, timing_s=0.0, waiting_s=0.0):
    """What one rank's selections tuned in shares did: GEMM ``selections`` this rank tuned
    in shares; shares it claimed and timed for the job (``shares_timed``, ``taken_over`` of
    them after their holder's lease lapsed); choices it timed (``choices_timed``: in its
    shares, and in shares it timed unclaimed); shares other ranks timed whose timings it
    used (``shares_received``); shares timed here without a claim (``timed_unclaimed``: their
    holder gave up, the deadline passed, or the store failed); seconds timing shares
    (``timing_s``) and waiting for others' shares (``waiting_s``)."""

    line = ("GEMM selections tuned in shares: {selections}; shares timed here {shares_timed} ({taken_over} taken "
            "over, {choices_timed} choices, {timing_s:.1f}s), received {shares_received} (waited {waiting_s:.1f}s), "
            "{timed_unclaimed} timed unclaimed")
    shown_if = ("selections",)


def split(hashes: list[str], shares: int) -> tuple[list[int], list[list[int]]]:
    """The choices' order (by hash, ties by index) and each share's choice indices: the
    choice at sorted position ``p`` is in share ``p % shares``."""
    order = sorted(range(len(hashes)), key=lambda index: (hashes[index], index))
    members: list[list[int]] = [[] for _ in range(shares)]
    for position, index in enumerate(order):
        members[position % shares].append(index)
    return order, members


def local_ranks() -> tuple[int, int]:
    """(this process's share, the number of shares): its rank modulo the node's local world
    size, from torchrun's environment (one share each where it is not set)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0)
    return rank % max(local_world, 1), local_world


class SplitTuning(Feature, counts=SplitTuningCounts):
    """GEMM selections timed in shares by the ranks that reach them."""

    name = "split_tuning"

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        self._lock = threading.Lock()
        #: (own share, shares) once decided; ``False``: this process tunes as Inductor does.
        self._plan: tuple[int, int] | bool | None = None

    def enabled(self, routed: frozenset[str]) -> bool:
        return supported(self.context.config.split_tuning, _compat.split_tuning_unsupported,
                         "split_tuning is off")

    def hooks(self, routed: frozenset[str]) -> Iterable:
        return (_compat.split_selections(self.wants, self.tune),)

    # -- who takes part ----------------------------------------------------------------

    def wants(self) -> bool:
        """Whether this process tunes selections in shares (decided once a store exists)."""
        with self._lock:
            if self._plan is None:
                flight = self.context.flight()
                if flight is None:
                    return False  # no store yet: decided later
                self._plan = self._decide(flight)
            return bool(self._plan)

    def _decide(self, flight: Singleflight) -> tuple[int, int] | bool:
        own, shares = local_ranks()
        if shares < 2:
            log.debug("compile_once: split_tuning: one rank on this node; selections are tuned as Inductor does")
            return False
        identity, why = _compat.gpu_identity()
        if identity is None:
            log.info("compile_once: split_tuning: %s; GEMM selections are tuned as Inductor does", why)
            return False
        try:
            first = flight.first_to_mark(self.context.store_key(GPU_MARKS, f"{job_id()}/{identity}"), "used")
        except Exception as exc:
            log.info("compile_once: split_tuning: the store did not answer (%s); GEMM selections are tuned as "
                     "Inductor does", exc)
            return False
        if not first:
            log.info("compile_once: split_tuning: another rank of this job uses this GPU (%s); GEMM selections are "
                     "tuned as Inductor does", identity)
            return False
        return own, shares

    # -- a selection ---------------------------------------------------------------------

    def tune(self, selection: _compat.Selection) -> dict[int, float] | None:
        """Every choice's timing, merged from the shares, in the order whose first minimum
        wins (see the module); ``None``: tune it as Inductor does."""
        flight = self.context.flight()
        plan = self._plan
        if flight is None or not plan:
            return None
        own, shares = plan
        order, members = split(selection.hashes, shares)
        # Timings are this job's: its GPUs, its load; a later job on a shared store times its own.
        keys = [self.context.store_key(KIND, f"{flight.job}/{selection.key}/{shares}/share/{s}")
                for s in range(shares)]
        rotation = [(own + step) % shares for step in range(shares)]
        wanted = [s for s in rotation if members[s]]
        timings: dict[int, float] = {}
        began = time.time()
        remaining = []
        # Claim and time each share nobody holds, one at a time, this rank's own first.
        with flight.no_waits():
            for s in wanted:
                result = flight.lookup(keys[s], blocking=True, what=self._what(selection, s, shares))
                if result.outcome == Outcome.CLAIMED:
                    timings.update(self._time(flight, selection, s, shares, members[s], keys[s], "timed"))
                elif result.value is None or not self._received(selection, members[s], keys[s], result.value,
                                                                timings):
                    remaining.append(s)
        # Then wait for the shares others hold; no share claim is held here.
        for s in remaining:
            waited = time.monotonic()
            result = flight.claim_or_follow(keys[s], what=self._what(selection, s, shares))
            if result.outcome == Outcome.CLAIMED:
                self.counts.waiting_s += time.monotonic() - waited
                outcome = "taken over" if result.waited_s > 0 else "timed"
                if outcome == "taken over":
                    self.counts.taken_over += 1
                timings.update(self._time(flight, selection, s, shares, members[s], keys[s], outcome))
                continue
            self.counts.waiting_s += time.monotonic() - waited
            if result.value is not None and self._received(selection, members[s], keys[s], result.value, timings):
                continue
            log.info("compile_once: split_tuning: share %d of %d of a %d-choice selection: %s; timing it here",
                     s, shares, len(selection), result.outcome)
            timings.update(self._time(flight, selection, s, shares, members[s], keys[s], "unclaimed",
                                      claimed=False))
        merged = {index: timings.get(index, math.inf) for index in order}
        self.counts.selections += 1
        best = min(merged, key=merged.__getitem__)
        self.context.events.span("selection", began, selection=selection.key[:12], shares=shares,
                                 choices=len(selection), winner=selection.names[best])
        log.debug("compile_once: split_tuning: %d choices in %d shares: %s wins (%.4f ms)", len(selection), shares,
                  selection.names[best], merged[best])
        return merged

    @staticmethod
    def _what(selection: _compat.Selection, share: int, shares: int) -> str:
        return f"share {share + 1} of {shares} of a GEMM selection's {len(selection)} choices"

    def _received(self, selection: _compat.Selection, indices: list[int], key: str, blob: bytes,
                  timings: dict[int, float]) -> bool:
        """Take a share's timings from its sealed value; whether it was valid."""
        found = self._opened(key, blob)
        if found is None:
            return False
        timed = found["t"]
        timings.update({index: float(timed.get(selection.hashes[index], math.inf)) for index in indices})
        self.counts.shares_received += 1
        return True

    def _opened(self, key: str, blob: bytes) -> dict | None:
        sealed = self.context.verify(KIND, key, blob)
        if sealed is None:
            return None
        try:
            found = msgpack.unpackb(sealed.payload)
            if not isinstance(found, dict) or not isinstance(found.get("t"), dict):
                raise ValueError("no timings")
        except Exception as exc:
            log.warning("compile_once: split_tuning: share %s holds no timings (%s)", key, exc)
            return None
        return found

    def _time(self, flight: Singleflight, selection: _compat.Selection, share: int, shares: int,
              indices: list[int], key: str, outcome: str, *, claimed: bool = True) -> dict[int, float]:
        """Time the choices of ``indices`` here and settle them as share ``share``'s timings
        (publishing them where this rank holds its claim); returns the timings that stand."""
        began, started = time.time(), time.monotonic()
        try:
            measured = selection.benchmark(indices)
        except BaseException:
            if claimed:
                flight.abandon(key)
            raise
        seconds = time.monotonic() - started
        payload = msgpack.packb({"t": {selection.hashes[i]: float(measured[i]) for i in indices},
                                 "rank": flight.owner.rank, "s": round(seconds, 3)})
        value = seal(key, payload, meta={"rank": flight.owner.rank, "host": flight.owner.host},
                     secret=self.context.config.secret)
        standing = flight.settle(key, value)
        if claimed:
            if standing is not None:
                flight.publish(key, standing)
            else:
                flight.abandon(key)
            self.counts.shares_timed += 1
        else:
            self.counts.timed_unclaimed += 1
        self.counts.choices_timed += len(indices)
        self.counts.timing_s += seconds
        self.context.events.span("tune share", began, key=short_key(key), selection=selection.key[:12],
                                 share=share, shares=shares, choices=len(indices), outcome=outcome)
        if standing is not None and standing != value:
            found = self._opened(key, standing)
            if found is not None:  # another rank's timings were settled first: they stand
                return {index: float(found["t"].get(selection.hashes[index], math.inf)) for index in indices}
        return {index: float(measured[index]) for index in indices}

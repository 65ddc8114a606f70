"""How a singleflight lookup ended (``LookupResult.outcome``)."""

from __future__ import annotations

import enum


class Outcome(str, enum.Enum):
    """How a lookup ended: with a value, or why there is none.

    A ``str`` enum: each member equals its value (``Outcome.CLAIMED == "claimed"``), and
    prints as it.
    """

    HIT = "hit"  # the value was published
    CLAIMED = "claimed"  # this process claimed the key: it computes the value
    WAITED = "waited"  # another process computed it while this one waited
    ABANDONED = "abandoned"  # the claimant gave up without publishing
    DEADLINE = "deadline"  # the wait passed its deadline
    EXPIRED = "expired"  # the claimant's lease lapsed (or another process took the claim over)
    UNCLAIMED = "unclaimed"  # a follower found nobody claiming the key in time
    NONBLOCKING = "nonblocking"  # another process holds the key and this one does not wait
    UNAVAILABLE = "unavailable"  # the store failed
    NODE = "node"  # found on this node (``coordinator.protocol.node``)
    PERSISTED = "persisted"  # found in the persistent layer (``coordinator.features.persistent``)
    PREPARED = "prepared"  # fetched before it was asked for (``coordinator.features.prefetch``)
    REJECTED = "rejected"  # a value that failed its reader's verification

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

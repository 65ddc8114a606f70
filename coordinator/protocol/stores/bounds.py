"""How long a call to a store may wait: the bounds of every backend, in one place.

A call to a store (a read, a write, a listing, a delete) is one request to its server or a few
(an object larger than a part is read and written a part at a time). Each request waits at most
``connect`` for its connection and at most ``answer`` for each answer of the server, and is tried
at most ``tries`` times in all, with a pause of at most ``pause`` before a further try (what is
tried again is the provider's choice: a timeout, a connection refused or dropped, a server's
5xx; never a missing object). So a request fails within
:meth:`CallBounds.longest_request`, and a call fails at its first request that fails: a server
that is down fails a call within seconds, one that accepts connections and never answers within
``longest_request()``, and the caller goes on (a lookup compiles, a restore logs and exits 0).

``answer`` bounds silences, not transfers: a large object takes what the network takes, as
long as the server keeps sending. A server that stops reading an upload midway is not bounded
by ``answer`` either (the clients time answers, not sends): the body's first megabytes fit in
the sockets' buffers, and past them the writer waits on the connection.

Outside these bounds:

- **Waits.** A blocking wait (:meth:`~coordinator.protocol.stores.base.Store.watch`) ends at the
  timeout its caller gives it (``wait_timeout``, a lease), not at ``answer``.
- **The torch.distributed store** (c10d) is the job's, and the coordinator leaves its client as
  it is: torch's client waits for the answer to a read whatever the store's timeout (torch 2.13),
  and a server that is gone fails a call at once. The job's collectives and rendezvous wait on
  the same server.
- **A directory** (``file://``) is local file calls; on a network filesystem the mount bounds
  them (NFS: ``soft`` with ``timeo`` and ``retrans``; a ``hard`` mount waits for its server).
- **Credentials.** Each provider finds its credentials through its own chain (an instance's
  metadata service, a token's refresh), with that library's own timeouts.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta


@dataclasses.dataclass(frozen=True)
class CallBounds:
    """How long one request to a store's server may wait, and how often it is tried."""

    #: Longest wait for a connection to the server (TCP and TLS).
    connect: timedelta
    #: Longest silence of the server on an open connection: before its answer to a request, or
    #: between two pieces of a download.
    answer: timedelta
    #: Most tries of one request, the first included.
    tries: int
    #: Longest pause before a further try (the provider's backoff).
    pause: timedelta = timedelta(0)

    def longest_request(self) -> timedelta:
        """The longest a request can take before it fails: each try connects and then waits
        its longest silence, with the longest pause before each further try."""
        return self.tries * (self.connect + self.answer) + (self.tries - 1) * self.pause


#: Redis: one try (a call that fails is its caller's to handle: it compiles, or waits again).
REDIS = CallBounds(connect=timedelta(seconds=10), answer=timedelta(seconds=10), tries=1)

#: Object stores, by URL scheme. The pauses are the providers' backoffs for up to 3 tries:
#: botocore's standard mode pauses up to 1 s, then up to 2 s; gcsfs 1 to 2 s, then 2 to 3 s;
#: the Azure client is given a pause of 0 to 2 s (``objects.py``).
OBJECT_STORES = {
    "s3": CallBounds(connect=timedelta(seconds=10), answer=timedelta(seconds=30), tries=3,
                     pause=timedelta(seconds=2)),
    "gs": CallBounds(connect=timedelta(seconds=10), answer=timedelta(seconds=30), tries=3,
                     pause=timedelta(seconds=3)),
    "az": CallBounds(connect=timedelta(seconds=10), answer=timedelta(seconds=30), tries=3,
                     pause=timedelta(seconds=2)),
}

"""The single-flight protocol: where ranks meet, and how one of them computes each key.

``stores`` (one ``Store`` interface over the job's c10d store, Redis and a directory),
``singleflight`` (claim, wait, publish; with ``claims``, ``waiting`` and ``outcome``),
``integrity`` (every value sealed and verified), ``fingerprint`` (keys namespaced by the
environment) and ``node`` (one fetch per node, the node-wide locks). Nothing here knows
Inductor: it moves sealed bytes under keys.
"""

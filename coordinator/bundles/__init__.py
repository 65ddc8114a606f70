"""Whole-job bundles: every compiled artifact of a job in one verified container.

``compile_once`` shares graphs one at a time while a job runs. A bundle carries the
whole set at once, for ranks that start later (elastic restarts, a replacement node,
the next job) and for large clusters, where NCCL moves the bytes down a tree at link
speed instead of thousands of ranks reading one store.

The package exports the three things a job does with a bundle: :func:`save_bundle`,
:func:`load_bundle`, :func:`broadcast_bundle`. The parts live in its modules:

* :mod:`~coordinator.bundles.format`: what a bundle holds; pack, seal and verify
  (``pack_bundle``, ``build_bundle``, ``read_bundle``, ``Bundle``);
* :mod:`~coordinator.bundles.keys`: store keys, the secret and namespace, the node's
  outbox (``bundle_key``, ``bundle_settings``, ``bundle_url``, ``OUTBOX``);
* :mod:`~coordinator.bundles.transfer`: bundles in stores (``save_bundle``,
  ``fetch_bundle``, ``copy_bundles``);
* :mod:`~coordinator.bundles.install`: into the local caches, once per node
  (``install_bundle``, ``load_bundle``);
* :mod:`~coordinator.bundles.broadcast`: over the process group (``broadcast_bytes``,
  ``broadcast_bundle``).

A bundle function takes what it needs of a session as arguments (``config``, ``kernels``);
called with neither, it uses the session that ``coordinator`` points
:func:`~coordinator.bundles.keys.use_session_lookup` at (the active ``compile_once``, or
the last to exit), else the settings' environment variables.
"""

from coordinator.bundles.broadcast import broadcast_bundle
from coordinator.bundles.install import load_bundle
from coordinator.bundles.transfer import save_bundle

__all__ = ["broadcast_bundle", "load_bundle", "save_bundle"]

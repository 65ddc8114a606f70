"""Which torch runs, and the torch versions each version-gated hook was checked on.

The one torch version helper (:func:`torch_version`, :func:`torch_before`).
``CHECKED_ON`` is the one support table: a feature whose hooks reach deep into torch is
offered only on the versions (major, minor) whose sources its hooks were read from and
whose tests passed there (:func:`unchecked` says why a feature is off; its module's
docstring says where it ran, ``__init__``'s which machines ran each torch). ``FIXED_IN``
names the torch bugs a hook works around, with the version that fixed each: the workaround
applies before it (:func:`needs_fix`).

No private name: ``torch.__version__`` only.
"""

from __future__ import annotations

import re

#: Feature -> the torch versions (major, minor) its hooks were read from and its tests pass on.
CHECKED_ON: dict[str, tuple[tuple[int, int], ...]] = {
    # DDPOptimizer's split graphs served from AOTAutograd's cache (``split_graphs``).
    "split_graphs": ((2, 11), (2, 13), (2, 14)),
    # Dynamo's precompiled functions (``precompile``).
    "precompile": ((2, 11), (2, 13), (2, 14)),
}

#: Torch bug -> the torch version (major, minor) that fixed it.
FIXED_IN: dict[str, tuple[int, int]] = {
    # AutotuneCache.read_best / CachingAutotuner.recheck_autotune_cache drop
    # ``found_by_coordesc`` (``triton_tuning``'s backports).
    "pytorch#172819": (2, 12),
}

_MAJOR_MINOR = re.compile(r"(\d+)\.(\d+)")


def parse_version(text: str) -> tuple[int, int]:
    """(major, minor) of a torch version string (``"2.13.0+cpu"`` -> ``(2, 13)``)."""
    found = _MAJOR_MINOR.match(text.strip())
    if found is None:
        raise ValueError(f"not a torch version: {text!r}")
    return int(found.group(1)), int(found.group(2))


def torch_version() -> tuple[int, int]:
    """(major, minor) of the torch this process runs."""
    import torch

    return parse_version(torch.__version__)


def torch_before(major: int, minor: int) -> bool:
    """Whether this torch is older than ``major.minor``."""
    return torch_version() < (major, minor)


def needs_fix(bug: str) -> bool:
    """Whether this torch still has ``bug`` (a key of ``FIXED_IN``)."""
    return torch_before(*FIXED_IN[bug])


def unchecked(feature: str) -> str | None:
    """Why ``feature`` (a key of ``CHECKED_ON``) is off on this torch, or ``None``."""
    import torch

    checked = CHECKED_ON[feature]
    if torch_version() in checked:
        return None
    listed = ", ".join(f"{major}.{minor}" for major, minor in checked)
    return f"torch {torch.__version__} is not one of the versions this was checked on ({listed})"

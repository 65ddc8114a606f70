"""Max-autotune's GEMM choices compiled once, in threads of the rank.

In max-autotune, Inductor precompiles a selection's Triton template choices in its
compile workers, whose kernels the timing does not find on some torch versions and
compiles a second time, one at a time. With ``compile_choices_once`` on, each choice is
precompiled in threads of this process, where its timing finds it
(``_compat.precompile_choices_in_process``).
"""

from __future__ import annotations

from collections.abc import Iterable

from coordinator import _compat
from coordinator.features.base import Feature


class CompileChoicesOnce(Feature):
    """Each GEMM choice compiled where its timing finds it."""

    name = "compile_choices_once"

    def enabled(self, routed: frozenset[str]) -> bool:
        return self.context.config.compile_choices_once

    def hooks(self, routed: frozenset[str]) -> Iterable:
        return (_compat.precompile_choices_in_process(),)

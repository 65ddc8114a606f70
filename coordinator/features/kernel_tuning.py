"""The autotune-hold protocol's decisions about a Triton kernel's first-launch tuning.

A Triton kernel tunes at its first launch: it compiles its configs, searches them
(``autotune_to_one_config``), then, with coordinate descent on, refines the winner
(``coordinate_descent_tuning``). ``_compat.triton_tuning_hooks`` patches those two and
calls :meth:`KernelTuning.search` and :meth:`KernelTuning.descend` with the kernel (seen
through a :class:`TunedKernel`) and the original method; :class:`KernelTuning` decides
what runs. Each tuning runs inside one *tuning step* of the session
(:meth:`coordinator.features.tuning_steps.TuningSteps.step`): the only place an autotune
key is claimed, and a leaf (no collective, no blocking lookup), so no wait cycle can form
through it (``docs/design.md``). Inside the step the kernel first looks for a config
another rank published and adopts it; otherwise it tunes, and its save is held during the
search while the descent will refine it (:meth:`KernelTuning.defer_save`), so that waiters
get the final config once. The session's side is ``TuningSteps.step`` and the autotune
branch of ``Session.put``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from coordinator.features.artifacts import read_triton_kernel

log = logging.getLogger(__name__)

#: A held autotune save: called with the Triton cache files of the chosen config.
Publish = Callable[[dict[str, bytes]], None]


class TunedKernel(Protocol):
    """What the decisions need of a kernel tuning at its first launch
    (``_compat.triton_tuning``'s adapter around Inductor's ``CachingAutotuner``)."""

    #: The ``CachingAutotuner`` itself (compared by identity only).
    autotuner: Any
    #: Set once the kernel's descent ran or was declined: Inductor asks again at every launch.
    descended: bool

    @property
    def name(self) -> str | None: ...

    @property
    def refined_by_descent(self) -> bool:
        """Whether coordinate descent is on for the kernel."""

    def descends_next(self) -> bool:
        """Whether the first launch runs coordinate descent after the search."""

    def published_config(self) -> Any:
        """The config another rank published (looked up inside the step), or ``None``."""

    def adopt(self, config: Any) -> Any:
        """Launch with ``config`` without tuning; the launcher, or ``None`` if it cannot."""

    @staticmethod
    def found_by_descent(config: Any) -> bool: ...

    @staticmethod
    def config_of(launcher: Any) -> Any: ...

    def kernel_dir(self, launcher: Any) -> str | None:
        """The Triton cache directory of ``launcher``'s compiled kernel, or ``None``."""


class KernelTuning:
    """Each Triton kernel's first-launch tuning run as one tuning step of the session.

    The step (``step()``) opens before the search (or before the descent, for a kernel
    with one config) and closes after the last of them. At its start the kernel's autotune
    key is looked up: a config another rank published is adopted instead of tuning; while
    another rank tunes the kernel, this rank waits for it; otherwise it claims the key,
    tunes, and its save publishes (held until the descent ends: :meth:`defer_save`).
    Every rank that runs the kernel thus runs the same config, tuned once.
    """

    def __init__(self, step: Callable[[], contextlib.AbstractContextManager[None]],
                 read_kernel: Callable[[str], dict[str, bytes]] = read_triton_kernel) -> None:
        self._step = step
        self._read_kernel = read_kernel
        #: The step open on each thread: the kernel (``kernel``), its exit (``exit``), the
        #: stage (``stage``: "search" while a save must wait for the descent, "descent")
        #: and a held save (``pending``).
        self._thread = threading.local()

    def defer_save(self, publish: Publish) -> bool:
        """Hold an autotune entry Inductor is saving until its kernel's coordinate descent ends.

        Triton kernels tuned at their first launch save a best config after the config
        search and, when coordinate descent is on for the kernel, again when the descent
        has refined it. Sharing the first would give other ranks a different config than
        this rank runs (or, on torch < 2.12, have them run the descent themselves). While
        a kernel whose ``inductor_meta`` turns coordinate descent on searches configs or
        descends, ``publish`` is kept (a later save of the same kernel replaces it) and
        called when the descent returns, with the Triton cache entry of the config it
        chose (compiled during the descent, so not in the FX entry).

        Returns:
            True if held; False if the caller should publish now.
        """
        if getattr(self._thread, "stage", None) is None:
            return False
        self._thread.pending = publish
        return True

    @contextlib.contextmanager
    def saves_published_now(self) -> Iterator[None]:
        """On this thread, for the duration, an autotune save publishes at once even inside
        a tuning step that holds its saves."""
        state = self._thread
        held = getattr(state, "stage", None), getattr(state, "pending", None)
        state.stage = None
        try:
            yield
        finally:
            state.stage, state.pending = held

    def close(self) -> None:
        """Close the step still open on this thread (the hooks are being removed)."""
        self._close_step()

    def _open_step(self, kernel: TunedKernel) -> None:
        exit_stack = contextlib.ExitStack()
        exit_stack.enter_context(self._step())
        state = self._thread
        state.kernel, state.exit, state.stage, state.pending = kernel, exit_stack, None, None

    def _close_step(self) -> None:
        state = self._thread
        exit_stack = getattr(state, "exit", None)
        state.kernel = state.exit = state.stage = state.pending = None
        if exit_stack is not None:
            exit_stack.close()

    def search(self, kernel: TunedKernel, tune: Callable[[], Any]) -> Any:
        """The config search (``tune``, Inductor's), opening the kernel's tuning step:
        a published config is adopted instead."""
        state = self._thread
        self._open_step(kernel)
        try:
            config = kernel.published_config()
            if config is not None and kernel.adopt(config) is not None:
                log.debug("adopted the published config of %s: %s", kernel.name, config)
                result = None
            else:
                if kernel.refined_by_descent:
                    state.stage = "search"  # the descent refines it next: hold the save
                result = tune()
        except BaseException:
            self._close_step()
            raise
        if kernel.descends_next():  # the step goes on into the descent, which publishes
            state.stage = None
        else:
            held, state.stage = state.pending, None
            try:
                if held is not None:  # published before the step releases its claim
                    held({})
            finally:
                self._close_step()
        return result

    def descend(self, kernel: TunedKernel, launcher: Any, descend: Callable[[], Any]) -> Any:
        """The coordinate descent from ``launcher`` (``descend``, Inductor's), closing the
        kernel's tuning step (opening it first for a kernel with one config)."""
        state = self._thread
        if kernel.descended:  # declined before: run() asks at every launch
            return descend()
        opened = getattr(state, "kernel", None)
        if opened is None or opened.autotuner is not kernel.autotuner:  # one config: no search opened it
            self._open_step(kernel)
            config = kernel.published_config()
            if config is not None and kernel.found_by_descent(config):
                adopted = kernel.adopt(config)
                if adopted is not None:
                    kernel.descended = True
                    self._close_step()
                    return adopted
        held_from_search, state.stage, state.pending = getattr(state, "pending", None), "descent", None
        try:
            winner = descend()
            descended = state.pending
            state.stage = state.pending = None
            log.debug("coordinate descent for %s: %s -> %s; saved %s, held from the search %s",
                      kernel.name, kernel.config_of(launcher), kernel.config_of(winner),
                      descended is not None, held_from_search is not None)
            kernel.descended = True
            self._publish_descent(kernel, winner, descended, held_from_search)
            return winner
        finally:
            self._close_step()

    def _publish_descent(self, kernel: TunedKernel, winner: Any, descended: Publish | None,
                         held_from_search: Publish | None) -> None:
        """Publish what a descent chose, with the Triton cache entry of its winner (compiled
        during the descent), or the search's held result for a kernel that did not descend."""
        try:  # the coordinator never fails a kernel launch
            if descended is not None:
                directory = kernel.kernel_dir(winner)
                descended(self._read_kernel(directory) if directory else {})
            elif held_from_search is not None:  # this kernel does not descend: the search's result stands
                held_from_search({})
        except Exception:
            log.warning("compile_once: publishing the tuned config of %s failed", kernel.name, exc_info=True)

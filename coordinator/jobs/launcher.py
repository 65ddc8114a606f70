"""``coordinator-run``: torchrun with compile-once switched on, no code change needed.

    coordinator-run [--coordinator-store URL] [--coordinator-persist URL] [--coordinator-restore URL]
                    [--coordinator-save-bundle URL] [--coordinator-bundle-name NAME]
                    [--coordinator-secret S] [--coordinator-namespace NS]
                    [--coordinator-log-level DEBUG|INFO|WARNING|ERROR]
                    [--coordinator-trace DIR]
                    <every torchrun flag> script.py [args]

Its own options all start with ``--coordinator-`` (or come from the settings' environment
variables, ``coordinator.settings``), so they never collide with torchrun's; everything else is
handed unchanged to ``torch.distributed.run.main``, in this process, so flags, exit
codes and signal handling are torchrun's own. Before the workers start it:

* refuses invalid settings (exit status 1, the ``ConfigError``'s message), which every
  worker would refuse;
* puts ``coordinator/_site`` first on the workers' ``PYTHONPATH`` and turns the ``enable``
  setting on: every worker runs under ``compile_once()``;
* when every worker has a GPU of its own, turns on torchrun's virtual local rank
  (``--virtual-local-rank``): each worker sees its GPU as ``cuda:0``, so Inductor's
  keys match across ranks. With more workers than GPUs (ranks sharing a GPU) it stays
  off: torchrun would give worker ``i`` only GPU ``i``, which does not exist for some;
  the script picks their devices;
* on one node with no secret set, makes a secret for the job (``COORDINATOR_JOB_SECRET``,
  handed to the workers in their environment, which each takes it out of as it starts):
  the values in the job's own store are signed with it, and a value written there by anyone
  else is refused. What outlives the job (a store URL,
  the persistent layer, bundles) is signed with ``COORDINATOR_SECRET`` or not at all;
* with ``--coordinator-restore URL``, installs the persisted bundle once for the node
  (a store it cannot reach is logged, never fatal);
* with ``--coordinator-save-bundle URL``, has rank 0 save the job's bundle at exit
  (``outbox``: into the node's outbox, which the SLURM Epilog publishes);
* with ``--coordinator-trace DIR``, has every worker write its coordinator events into
  ``DIR`` (``coordinator.observe.trace``), which ``coordinator report DIR`` merges.

``coordinator-run --help`` lists these options and the settings' variables, then
torchrun's own help.

Nothing else of the workers' environment changes: the switch, the job's secret and
``PYTHONPATH`` are as the user set them again before the script's first line (the worker
keeps the secret in memory) (``coordinator/_site``), and Inductor's
and Triton's cache dirs are theirs (a node's workers share Inductor's default dir, as
under torchrun).

Each worker shows the ``coordinator`` logger's lines (its summary at exit, who it waits
for) at ``--coordinator-log-level`` (default ``INFO``), on stderr after its rank
(``[rank0]:coordinator: ...``) unless the training script configures logging, whose
handlers then get them; so does ``coordinator-run`` itself (what it restored), with no
rank. See ``coordinator.observe.logs``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import logging
import os
import secrets
import sys

from coordinator.errors import ConfigError
from coordinator.observe.logs import show_coordinator_logs
from coordinator.protocol.stores import shown_url
from coordinator.settings import Config, JobSettings, descriptions, variable

log = logging.getLogger(__name__)

#: Our options: flag -> (the setting it gives, its value in ``--help``).
_OPTION_SETTINGS = {
    "--coordinator-store": ("store", "URL"),
    "--coordinator-persist": ("persist", "URL"),
    "--coordinator-secret": ("secret", "SECRET"),
    "--coordinator-restore": ("restore_bundle", "URL"),
    "--coordinator-save-bundle": ("save_bundle", "URL"),
    "--coordinator-bundle-name": ("bundle_name", "NAME"),
    "--coordinator-namespace": ("namespace", "NS"),
    "--coordinator-log-level": ("log_level", "LEVEL"),
    "--coordinator-trace": ("trace_dir", "DIR"),
}
#: Our options: flag -> environment variable the workers (or we) read.
OPTIONS = {flag: variable(setting) for flag, (setting, _) in _OPTION_SETTINGS.items()}
#: The job settings ``coordinator-run`` reads and checks before the workers start.
_LAUNCH_SETTINGS = ("log_level", "restore_bundle", "save_bundle", "bundle_name")
_HELP_FLAGS = ("-h", "--help")


def split_args(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """Separate ``--coordinator-*`` options (before the training script) from torchrun's.

    Returns:
        (environment settings, torchrun's argv unchanged apart from our options)
    """
    ours: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in OPTIONS:
            if not eq:
                if i + 1 >= len(argv):
                    raise SystemExit(f"coordinator-run: {name} needs a value")
                value = argv[i + 1]
                i += 1
            ours[OPTIONS[name]] = os.path.abspath(value) if name == "--coordinator-trace" else value
        elif arg.startswith("--coordinator-"):
            raise SystemExit(f"coordinator-run: unknown option {name}; known: {', '.join(OPTIONS)}")
        else:
            rest.append(arg)
            # Everything after the training script belongs to the script.
            if not arg.startswith("-") and _is_script(rest):
                rest.extend(argv[i + 1 :])
                break
        i += 1
    return ours, rest


@functools.lru_cache(maxsize=1)
def _torchrun_parser() -> argparse.ArgumentParser:
    """torchrun's parser, for reading its arguments without acting on them: an option
    that prints and exits as it is parsed (``--help``; ``--print-completion``, torch
    2.14) only stores its value here."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    for action in parser._actions:
        if "--print-completion" in action.option_strings:
            action.__class__ = argparse._StoreAction
        elif isinstance(action, argparse._HelpAction):
            action.__class__ = argparse._StoreConstAction
            action.const = True
    return parser


def asks_for_help(torchrun_args: list[str]) -> bool:
    """Whether ``-h``/``--help`` comes before the training script (after it, it is the script's)."""
    for i, arg in enumerate(torchrun_args):
        if arg in _HELP_FLAGS:
            return True
        if not arg.startswith("-") and _is_script(torchrun_args[: i + 1]):
            return False
    return False


def help_text() -> str:
    """Our options and the settings' variables; torchrun's own help follows it."""
    meanings = {**descriptions(Config), **descriptions(JobSettings)}
    lines = [
        "usage: coordinator-run [--coordinator-OPTION VALUE ...] [torchrun options] script.py [script args]",
        "",
        "torchrun with compile_once on in every worker, with no change to the training script. The options",
        "below are coordinator-run's own; every other argument goes to torchrun unchanged (its help follows).",
        "",
        "coordinator-run options (each can be given as its environment variable instead):",
    ]
    for flag, (setting, metavar) in _OPTION_SETTINGS.items():
        lines += [f"  {flag + ' ' + metavar:<36}{OPTIONS[flag]}", f"      {meanings[setting]}"]
    lines += ["", "Other settings the workers read (compile_once arguments; docs/settings.md):"]
    for name, meaning in descriptions(Config).items():
        if variable(name) not in OPTIONS.values():
            lines += [f"  {variable(name)}", f"      {meaning}"]
    return "\n".join(lines + ["", "torchrun's help:", ""])


def _parsed(args: list[str]) -> argparse.Namespace | None:
    """torchrun's reading of ``args`` (quietly), or ``None`` where it refuses them."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return _torchrun_parser().parse_known_args(args)[0]
    except SystemExit:
        return None


def _is_script(args: list[str]) -> bool:
    """Whether the last of ``args`` is torchrun's positional training script."""
    parsed = _parsed(args)
    return parsed is not None and parsed.training_script == args[-1]


def workers_per_node(torchrun_args: list[str]) -> str:
    """torchrun's ``--nproc-per-node`` among ``torchrun_args`` ("1" if absent)."""
    parsed = _parsed(torchrun_args)
    return "1" if parsed is None else str(parsed.nproc_per_node)


def one_node(torchrun_args: list[str]) -> bool:
    """Whether torchrun's ``--nnodes`` among ``torchrun_args`` is one node ("1" or "1:1", the default)."""
    parsed = _parsed(torchrun_args)
    return parsed is not None and str(parsed.nnodes).strip() in ("1", "1:1")


def job_secret(torchrun_args: list[str], environ: dict[str, str]) -> dict[str, str]:
    """A secret for the workers of a one-node job with no secret set (``job_secret``): the
    values in the job's own store are signed with it. It travels in the workers'
    environment only; a job of several nodes has no safe way to hand one to all of them."""
    if environ.get(variable("secret")) or environ.get(variable("job_secret")) or not one_node(torchrun_args):
        return {}
    return {variable("job_secret"): secrets.token_hex(32)}


def one_gpu_per_worker(nproc_per_node: str, gpus: int) -> bool:
    """Whether each of ``nproc_per_node`` workers gets a GPU of its own on a node with ``gpus``."""
    if gpus == 0:
        return False
    if nproc_per_node in ("gpu", "auto"):
        return True
    try:
        return int(nproc_per_node) <= gpus
    except ValueError:  # "cpu", "xpu"...
        return False


def worker_environment(settings: dict[str, str], environ: dict[str, str]) -> dict[str, str]:
    """The environment variables to set for the workers: the settings given as options, the
    switch, and this package's ``_site`` first on ``PYTHONPATH`` (both taken out again as
    each worker starts)."""
    site = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_site")
    pythonpath = environ.get("PYTHONPATH", "")
    env = dict(settings)
    env[variable("enable")] = "1"
    env["PYTHONPATH"] = site + (os.pathsep + pythonpath if pythonpath else "")
    return env


def with_virtual_local_rank(torchrun_args: list[str], environ: dict[str, str]) -> list[str]:
    """torchrun's arguments with its virtual local rank on, unless the user chose already
    (the flag, or ``PET_VIRTUAL_LOCAL_RANK``)."""
    flags = ("--virtual-local-rank", "--virtual_local_rank")
    for i, arg in enumerate(torchrun_args):
        if arg.split("=", 1)[0] in flags:
            return torchrun_args
        if not arg.startswith("-") and _is_script(torchrun_args[: i + 1]):
            break
    if "PET_VIRTUAL_LOCAL_RANK" in environ:
        return torchrun_args
    return ["--virtual-local-rank", *torchrun_args]


def check_settings(environ: dict[str, str], options: dict[str, str] | None = None) -> None:
    """Refuse, before any worker starts, settings every worker would refuse.

    ``options`` are the settings given as ``--coordinator-*`` options (variable -> value),
    which the errors name by their option.

    Raises:
        ConfigError: a setting of ``environ`` is invalid, naming the variable or option
            and the value given.
    """
    sources = {env_name: flag for flag, env_name in OPTIONS.items() if env_name in (options or {})}
    Config.resolve(environ=environ, sources=sources)
    JobSettings.resolve(environ, sources=sources, names=_LAUNCH_SETTINGS).check_bundles(sources)


def restore(url: str, name: str) -> None:
    """Install the persisted bundle for this node; never fails the job."""
    try:
        from coordinator.bundles import load_bundle
        from coordinator.bundles.install import described

        result = load_bundle(url, name=name)
        log.info("coordinator-run: bundle %r from %s: %s", name, shown_url(url), described(result))
    except FileNotFoundError as exc:
        log.warning("coordinator-run: no bundle to restore yet (%s)", exc)
    except Exception as exc:  # an unreachable store or a refused bundle: compile as usual
        log.warning("coordinator-run: could not restore bundle %r from %s: %s", name, shown_url(url), exc)


def main(argv: list[str] | None = None) -> None:
    settings, torchrun_args = split_args(sys.argv[1:] if argv is None else argv)
    if asks_for_help(torchrun_args):
        print(help_text(), flush=True)
        from torch.distributed.run import get_args_parser

        get_args_parser().print_help()
        return
    try:
        check_settings({**os.environ, **settings}, settings)
    except ConfigError as exc:
        raise SystemExit(f"coordinator-run: {exc}") from None
    show_coordinator_logs(JobSettings.resolve({**os.environ, **settings}, names=("log_level",)).log_level, prefix="")
    import torch

    if one_gpu_per_worker(workers_per_node(torchrun_args), torch.cuda.device_count()):
        torchrun_args = with_virtual_local_rank(torchrun_args, dict(os.environ))
    os.environ.update(worker_environment(settings, dict(os.environ)))
    os.environ.update(job_secret(torchrun_args, dict(os.environ)))
    job = JobSettings.resolve(names=("restore_bundle", "bundle_name"))
    if job.restore_bundle:
        restore(job.restore_bundle, job.bundle_name)
    from torch.distributed.run import main as torchrun_main

    torchrun_main(torchrun_args)


if __name__ == "__main__":
    # Run as ``python -m coordinator.jobs.launcher``: through the module under its own name,
    # whose logger is the coordinator's (this copy's is ``__main__``).
    from coordinator.jobs.launcher import main as launcher_main

    launcher_main()

"""The ``coordinator`` command line: bundles, the report of a traced job, SLURM's node hooks.

Every command's help is written for a terminal (``coordinator --help``, ``coordinator
bundle ls --help``): plain text, what it does, an example. ``bundle`` commands name a
store by its URL (a password shown as ``***``) and exit 0 on success, 1 on a refused,
unreadable or missing bundle (``ls`` and ``copy`` list or publish the others first), 2 on
bad usage; ``slurm prolog|epilog`` always exit 0 (see
``coordinator.jobs.slurm``); ``report`` exits 1 when its directory holds no trace (see
``coordinator.observe.report``). Output to a reader that stops reading (``coordinator
bundle ls URL | head``) ends quietly, with exit status 141, as a command killed by SIGPIPE.
``bundle`` commands take a ``redis://``/``rediss://``, ``file://`` or object store URL
(``s3://``, ``gs://``, ``az://``), or ``outbox`` (this node's outbox, which the SLURM
Epilog publishes from); ``ls`` prints each bundle's key, size and age, ``rm`` takes a name,
a listed key or ``--older-than``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NamedTuple

from coordinator.bundles.format import read_bundle
from coordinator.bundles.install import load_bundle
from coordinator.bundles.keys import bundle_key, bundle_url
from coordinator.bundles.transfer import copy_bundles, missing_bundle, save_bundle
from coordinator.errors import ConfigError, CoordinatorError, IntegrityError
from coordinator.protocol.fingerprint import fingerprint
from coordinator.protocol.stores import shown_url
from coordinator.settings import Config, variable

#: The exit status of a command whose reader stopped reading: a command killed by SIGPIPE's.
BROKEN_PIPE_EXIT = 128 + 13


def _read_source(source: str, name: str, config: Config) -> bytes:
    if "://" in source:
        from coordinator.protocol.stores import open_store

        store = open_store(source)
        key = bundle_key(name, config=config)
        blob = store.get(key)
        if blob is None:
            raise missing_bundle(store, key, name, shown_url(source))
        return blob
    with open(source, "rb") as f:
        return f.read()


def _age(modified: float | None, now: float) -> str:
    """How long ago a bundle was written, as ``ls`` shows it (``-``: the store does not say)."""
    if modified is None:
        return "-"
    seconds = max(now - modified, 0.0)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def _save(args: argparse.Namespace, config: Config) -> int:
    with open(args.file, "rb") as f:
        blob = f.read()
    if args.ttl is not None and args.ttl <= 0:
        raise ConfigError(f"--ttl {args.ttl:g}: a time to live must be a positive number of seconds")
    read_bundle(blob, secret=config.secret)  # refuse to publish a bad bundle
    ttl = timedelta(seconds=args.ttl) if args.ttl is not None else None
    size = save_bundle(args.url, name=args.name, ttl=ttl, max_bytes=args.max_bytes, blob=blob, config=config)
    print(f"saved {size} bytes as {bundle_key(args.name, config=config)} in {shown_url(args.url)}")
    return 0


def _load(args: argparse.Namespace, config: Config) -> int:
    if args.out:
        blob = _read_source(args.url, args.name, config)
        read_bundle(blob, secret=config.secret)
        with open(args.out, "wb") as f:
            f.write(blob)
        print(f"wrote {len(blob)} verified bytes from {shown_url(args.url)} to {args.out}")
    else:
        print(json.dumps(load_bundle(args.url, name=args.name, config=config)))
    return 0


def _inspect(args: argparse.Namespace, config: Config) -> int:
    blob = _read_source(args.source, args.name, config)
    described = read_bundle(blob, secret=config.secret, check_environment=False).describe()
    described["matches_this_environment"] = described["fingerprint"] == fingerprint()
    described["bytes"] = len(blob)
    print(json.dumps(described, indent=2, default=str))
    return 0


def _ls(args: argparse.Namespace, config: Config) -> int:
    from coordinator.protocol.stores import open_store

    store = open_store(args.url)
    listed, unreadable = 0, 0
    now = time.time()
    for entry in store.list_entries("bundles/"):
        blob = store.get(entry.key)
        if blob is None:  # removed meanwhile
            continue
        try:  # checksums and layout; a signature needs the bundle's secret, which `load` checks
            read_bundle(blob, check_environment=False)
        except IntegrityError as exc:
            print(f"coordinator: {entry.key} is not a bundle: {exc}", file=sys.stderr)
            unreadable += 1
            continue
        print(f"{entry.key}\t{len(blob)}\t{_age(entry.modified, now)}")
        listed += 1
    if not listed:
        print(f"no bundles in {shown_url(args.url)}")
    return 1 if unreadable else 0


def _rm(args: argparse.Namespace, config: Config) -> int:
    from coordinator.protocol.stores import open_store

    store = open_store(args.url)
    if args.older_than is not None:
        cutoff = time.time() - args.older_than
        keys = [entry.key for entry in store.list_entries("bundles/")
                if entry.modified is not None and entry.modified < cutoff]
    elif args.name is None:
        raise ConfigError("bundle rm: give a NAME (or a key as `coordinator bundle ls` lists it), "
                          "or --older-than SECONDS")
    else:
        keys = [args.name if args.name.startswith("bundles/") else bundle_key(args.name, config=config)]
    for key in keys:
        store.delete(key)
        print(f"removed {key} from {shown_url(args.url)}")
    if not keys:
        print(f"no bundles older than {args.older_than:g}s in {shown_url(args.url)}")
    return 0


def _copy(args: argparse.Namespace, config: Config) -> int:
    refused: dict[str, str] = {}
    for key in copy_bundles(args.src, args.dst, move=not args.keep, config=config, refused=refused):
        print(f"published {key} to {shown_url(args.dst)}")
    for key, reason in refused.items():
        print(f"coordinator: not published {key}: {reason}", file=sys.stderr)
    return 1 if refused else 0


def _bundle_command(args: argparse.Namespace) -> int:
    try:
        config = Config.resolve()  # the secret and namespace: this process runs no compile_once
        return _chosen(_BUNDLE_ACTIONS, args).run(args, config)
    except BrokenPipeError:
        raise
    except (CoordinatorError, FileNotFoundError, OSError) as exc:
        print(f"coordinator: {exc}", file=sys.stderr)
        return 1


def _slurm_command(args: argparse.Namespace) -> int:
    import logging

    from coordinator.jobs import slurm

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    return slurm.prolog() if args.hook == "prolog" else slurm.epilog()


def _report_command(args: argparse.Namespace) -> int:
    from coordinator.observe.report import FRAME_LEGEND, write_report

    try:
        report = write_report(args.dir, picture=not args.no_picture)
    except FileNotFoundError as exc:
        print(f"coordinator: {exc}", file=sys.stderr)
        return 1
    print(report.table())
    print("columns:")
    print(report.legend())
    if report.frames:
        print(report.frame_table())
        print("split frames' columns:")
        print(report.legend(FRAME_LEGEND))
    if report.triton:
        print(report.triton_table())
        print("  an autotune result is shared only between ranks whose GPUs are of one kind (the last column)")
    for warning in report.warnings:
        print(f"warning: {warning}")
    for note in report.notes:
        print(f"note: {note}")
    for path in report.written:
        print(f"wrote {path}")
    return 0


class Arg(NamedTuple):
    """One argument of a command, as ``add_argument(*flags, **options)`` takes it."""

    flags: tuple[str, ...]
    options: dict[str, Any]


def _arg(*flags: str, **options: Any) -> Arg:
    return Arg(flags, options)


class Subcommand(NamedTuple):
    """One command of the table ``build_parser`` reads: its help, its arguments, and what runs it."""

    name: str
    help: str  # its line in its parent's list of commands
    description: str
    examples: tuple[str, ...]
    arguments: tuple[Arg, ...] = ()
    group: Group | None = None  # its own subcommands
    run: Callable[..., int] | None = None  # a command: run(args); a bundle action: run(args, config)


class Group(NamedTuple):
    """The subcommands of a command, as ``add_subparsers`` takes them (``dest``: the name they are parsed to)."""

    dest: str
    title: str
    metavar: str
    commands: tuple[Subcommand, ...]


_URL = ("redis://host:port/db, rediss://..., file:///dir, s3://bucket/prefix, gs://..., az://..., "
        "or outbox (this node's outbox)")
_NAME = (f"bundle name (default: default); the secret and namespace come from {variable('secret')}, "
         f"{variable('namespace')}")
_STORES = f"""\
A store is named by its URL: redis://[:password@]host:port/db, rediss://... (TLS),
file:///shared/dir, or outbox (this node's outbox, <Inductor cache dir>/coordinator-outbox,
which the SLURM Epilog publishes from). Bundles are keyed by the environment (torch,
Triton, CUDA, GPU, Python) and by the secret and namespace of {variable('secret')} and
{variable('namespace')}, as the job that saved them had them."""

_MAIN = f"""\
The command line of coordinator, the compile cache coordinator for distributed
torch.compile. A job runs under it with coordinator-run (a torchrun drop-in: see
coordinator-run --help) or with "with coordinator.compile_once():" in its script; these
commands handle what such a job leaves behind: its bundle (every compiled artifact of
the job in one verified file, for the next job or a new node), its trace (a timeline of
who compiled and who waited), and SLURM's node hooks that move bundles.

{_STORES}"""

_MAIN_EXAMPLES = """\
examples:
  coordinator bundle ls redis://cache:6379/0
  coordinator bundle inspect redis://cache:6379/0 --name gpt-7b
  COORDINATOR_TRACE=trace torchrun --standalone --nproc-per-node 4 train.py && coordinator report trace
  coordinator slurm --help

Run "coordinator COMMAND --help" for each command's options."""

_BUNDLE_ACTIONS = Group("action", "actions", "ACTION", (
    Subcommand(
        "save", "publish a bundle file to a store",
        f"Verify a bundle file (checksums, and the signature with {variable('secret')})\n"
        "and publish it to a store under a name.",
        ("coordinator bundle save redis://cache:6379/0 gpt-7b.bundle --name gpt-7b --ttl 604800",),
        (_arg("url", help="the store to publish to: " + _URL),
         _arg("file", help="the bundle file (from coordinator bundle load URL --out FILE, or "
                           "the bytes of coordinator.bundles.format.pack_bundle())"),
         _arg("--name", default="default", help=_NAME),
         _arg("--ttl", type=float, default=None, help="seconds until Redis expires it (default: never)"),
         _arg("--max-bytes", type=int, default=None, help="refuse a bundle larger than this (default: any)")),
        run=_save),
    Subcommand(
        "load", "fetch, verify and install a bundle (or --out FILE)",
        "Fetch a bundle from a store, verify it and install it into this machine's Inductor\n"
        "cache dir (TORCHINDUCTOR_CACHE_DIR, else Inductor's default), once per node however\n"
        "many processes ask; prints what it installed. With --out, only write the verified\n"
        "bytes to a file.",
        ("coordinator bundle load redis://cache:6379/0 --name gpt-7b",
         "coordinator bundle load redis://cache:6379/0 --name gpt-7b --out gpt-7b.bundle"),
        (_arg("url", help="the store to fetch from: " + _URL),
         _arg("--name", default="default", help=_NAME),
         _arg("--out", default=None, help="write the verified bundle to this file instead of installing it")),
        run=_load),
    Subcommand(
        "inspect", "print a bundle's fingerprint, sizes, kernels, signature",
        "Verify a bundle in a store or a file and print, as JSON, the environment it was\n"
        "built in (and whether it is this one), when and where, its compile time, its\n"
        "sizes by kind, its kernels and its signature.",
        ("coordinator bundle inspect file:///shared/bundles --name nightly",
         "coordinator bundle inspect gpt-7b.bundle"),
        (_arg("source", help="store URL or bundle file"), _arg("--name", default="default", help=_NAME)),
        run=_inspect),
    Subcommand(
        "ls", "list the bundles in a store: key, bytes, age",
        "List every bundle in a store, one line each: its key\n"
        "(bundles/<environment>/<secret>/<namespace>/<name>), its size in bytes and its age\n"
        "('-' where the store keeps no time, as Redis).",
        ("coordinator bundle ls s3://my-bucket/compile | head",), (_arg("url", help="the store: " + _URL),),
        run=_ls),
    Subcommand(
        "rm", "remove a bundle, or every bundle older than an age",
        "Remove bundle NAME (of this environment, secret and namespace), or a key as\n"
        "'coordinator bundle ls' lists it, or with --older-than every bundle in the store\n"
        "(any environment) written longer ago than that.",
        ("coordinator bundle rm redis://cache:6379/0 gpt-7b",
         "coordinator bundle rm s3://my-bucket/compile --older-than 604800"),
        (_arg("url", help="the store: " + _URL),
         _arg("name", nargs="?", default=None, help="bundle name, or a key as `coordinator bundle ls` lists it"),
         _arg("--older-than", type=float, default=None, metavar="SECONDS",
              help="remove every bundle in the store (any environment) written longer ago than this")),
        run=_rm),
    Subcommand(
        "copy", "publish every verified bundle of one store to another (and remove it there)",
        "Publish every bundle of one store to another under the same key, each verified\n"
        "first (a bundle that fails is left out, with a warning); the source copies are\n"
        "removed unless --keep. The SLURM Epilog publishes a node's outbox this way.",
        ("coordinator bundle copy outbox redis://cache:6379/0 --keep",),
        (_arg("src", help="the store to copy from: " + _URL), _arg("dst", help="the store to copy to: " + _URL),
         _arg("--keep", action="store_true", help="leave the source copies")),
        run=_copy),
))

_SLURM_HOOKS = Group("hook", "hooks", "HOOK", (
    Subcommand(
        "prolog", "before a job's tasks start on a node: fetch, verify and install the bundle the job "
                  "names into the node's Inductor cache dir",
        "Before a job's tasks start on a node: fetch the bundle the job names\n"
        f"({variable('restore_bundle')}, {variable('bundle_name')}, or the job's comment),\n"
        "verify it and install it into the node's Inductor cache dir, so that the tasks load\n"
        "their graphs instead of compiling them.",
        ("Prolog=/etc/slurm/coordinator/prolog.sh    # slurm.conf; prolog.sh runs: coordinator slurm prolog",)),
    Subcommand(
        "epilog", "when the job ends on a node: publish the bundles it left in the node's outbox, then "
                  "remove the node's cache dir if asked",
        "When the job's allocation ends on a node: publish the bundles the job left in the\n"
        f"node's outbox (COORDINATOR_SAVE_BUNDLE=outbox) to {variable('push_bundle')}, each verified\n"
        f"first, then remove the node's cache dir if {variable('slurm_clean')}=1.",
        ("Epilog=/etc/slurm/coordinator/epilog.sh    # slurm.conf; epilog.sh runs: coordinator slurm epilog",)),
))

_COMMANDS = Group("command", "commands", "COMMAND", (
    Subcommand(
        "bundle", "save, load, inspect, list, remove and copy bundles",
        "A bundle holds every compiled artifact of a job (the Mega-Cache of its compiles, the\n"
        "compiled CPU kernels, Triton autotune results), sealed with checksums and, with\n"
        f"{variable('secret')} set, an HMAC signature; every one is verified before anything\n"
        "is written. A job saves one with --coordinator-save-bundle URL (coordinator-run) or\n"
        "coordinator.save_bundle(URL); a later job restores it with --coordinator-restore URL.\n\n"
        + _STORES,
        ("coordinator bundle ls file:///shared/bundles",
         "coordinator bundle load redis://cache:6379/0 --name gpt-7b"),
        group=_BUNDLE_ACTIONS, run=_bundle_command),
    Subcommand(
        "slurm", "SLURM node hooks: install a job's bundle before it, publish its bundle after",
        "SLURM's node hooks, run by slurmd through launch/slurm/prolog.sh and epilog.sh (see\n"
        "launch/slurm/README.md for installing them). They read the job's settings from the\n"
        "site's coordinator.env and the job's comment (sbatch --comment\n"
        "\"coordinator.bundle=NAME\"), do their work as the job's user, and always exit 0: an\n"
        "error is logged and the job compiles as usual.",
        ("coordinator slurm prolog    # as slurmd runs it, with SLURM_JOB_ID, SLURM_JOB_UID, ... set",),
        group=_SLURM_HOOKS, run=_slurm_command),
    Subcommand(
        "report", "merge a traced job's rank traces: one timeline, a picture, a table",
        "Merge the rank traces a job wrote into DIR (coordinator-run --coordinator-trace DIR,\n"
        "COORDINATOR_TRACE=DIR, or compile_once(trace_dir=DIR)): print a table per rank (graphs\n"
        "compiled, received, found locally, waits, seconds waited and saved, bytes) with a\n"
        "legend, warn where ranks compiled different graphs, and write DIR/job.trace.json (for\n"
        "Perfetto) and, with matplotlib, DIR/job.png and .svg\n"
        '(pip install "torch-compile-coordinator[plot]").',
        ("COORDINATOR_TRACE=trace torchrun --standalone --nproc-per-node 4 train.py && coordinator report trace",),
        (_arg("dir", help="the job's --coordinator-trace directory"),
         _arg("--no-picture", action="store_true", help="write the trace and the table only")),
        run=_report_command),
))


def _examples(*lines: str) -> str:
    return "example:\n" + "\n".join(f"  {line}" for line in lines) if len(lines) == 1 else \
        "examples:\n" + "\n".join(f"  {line}" for line in lines)


def _add_group(parser: argparse.ArgumentParser, group: Group) -> None:
    """Add ``group``'s subcommands to ``parser``, each with its arguments and subcommands."""
    commands = parser.add_subparsers(dest=group.dest, required=True, title=group.title, metavar=group.metavar)
    for command in group.commands:
        sub = commands.add_parser(command.name, help=command.help, description=command.description,
                                  epilog=_examples(*command.examples),
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        for argument in command.arguments:
            sub.add_argument(*argument.flags, **argument.options)
        if command.group is not None:
            _add_group(sub, command.group)


def _chosen(group: Group, args: argparse.Namespace) -> Subcommand:
    """The subcommand of ``group`` that ``args`` names."""
    name = getattr(args, group.dest)
    return next(command for command in group.commands if command.name == name)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="coordinator", description=_MAIN, epilog=_MAIN_EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_group(parser, _COMMANDS)
    return parser


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("url", "src", "dst"):
        if getattr(args, name, None):
            setattr(args, name, bundle_url(getattr(args, name)))
    return _chosen(_COMMANDS, args).run(args)


def main(argv: list[str] | None = None) -> int:
    try:
        return _run(argv)
    except BrokenPipeError:
        _quiet_stdout()
        return BROKEN_PIPE_EXIT


def _quiet_stdout() -> None:
    """The reader of stdout is gone (``coordinator bundle ls URL | head``): send what is
    left of stdout, and its flush at exit, to /dev/null instead of a traceback."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no file descriptor behind sys.stdout (a test's capture)
        pass


if __name__ == "__main__":
    sys.exit(main())

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
from datetime import timedelta

from coordinator.bundles.format import read_bundle
from coordinator.bundles.install import load_bundle
from coordinator.bundles.keys import bundle_key, bundle_url
from coordinator.bundles.transfer import copy_bundles, save_bundle
from coordinator.errors import ConfigError, CoordinatorError, IntegrityError
from coordinator.protocol.fingerprint import fingerprint
from coordinator.protocol.stores import shown_url
from coordinator.settings import Config, variable

#: The exit status of a command whose reader stopped reading: a command killed by SIGPIPE's.
BROKEN_PIPE_EXIT = 128 + 13


def _read_source(source: str, name: str, config: Config) -> bytes:
    if "://" in source:
        from coordinator.protocol.stores import open_store

        blob = open_store(source).get(bundle_key(name, config=config))
        if blob is None:
            raise FileNotFoundError(f"no bundle {name!r} for environment {fingerprint()} in {shown_url(source)}")
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


def _bundle_command(args: argparse.Namespace) -> int:
    config = Config.resolve()  # the secret and namespace: this process runs no compile_once
    secret = config.secret
    if args.action == "save":
        with open(args.file, "rb") as f:
            blob = f.read()
        if args.ttl is not None and args.ttl <= 0:
            raise ConfigError(f"--ttl {args.ttl:g}: a time to live must be a positive number of seconds")
        read_bundle(blob, secret=secret)  # refuse to publish a bad bundle
        ttl = timedelta(seconds=args.ttl) if args.ttl is not None else None
        size = save_bundle(args.url, name=args.name, ttl=ttl, max_bytes=args.max_bytes, blob=blob, config=config)
        print(f"saved {size} bytes as {bundle_key(args.name, config=config)} in {shown_url(args.url)}")
    elif args.action == "load":
        if args.out:
            blob = _read_source(args.url, args.name, config)
            read_bundle(blob, secret=secret)
            with open(args.out, "wb") as f:
                f.write(blob)
            print(f"wrote {len(blob)} verified bytes from {shown_url(args.url)} to {args.out}")
        else:
            print(json.dumps(load_bundle(args.url, name=args.name, config=config)))
    elif args.action == "inspect":
        blob = _read_source(args.source, args.name, config)
        described = read_bundle(blob, secret=secret, check_environment=False).describe()
        described["matches_this_environment"] = described["fingerprint"] == fingerprint()
        described["bytes"] = len(blob)
        print(json.dumps(described, indent=2, default=str))
    elif args.action == "ls":
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
    elif args.action == "rm":
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
    elif args.action == "copy":
        refused: dict[str, str] = {}
        for key in copy_bundles(args.src, args.dst, move=not args.keep, config=config, refused=refused):
            print(f"published {key} to {shown_url(args.dst)}")
        for key, reason in refused.items():
            print(f"coordinator: not published {key}: {reason}", file=sys.stderr)
        return 1 if refused else 0
    return 0


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


def _examples(*lines: str) -> str:
    return "example:\n" + "\n".join(f"  {line}" for line in lines) if len(lines) == 1 else \
        "examples:\n" + "\n".join(f"  {line}" for line in lines)


def _parser(commands: argparse._SubParsersAction, name: str, help: str, description: str,
            examples: list[str]) -> argparse.ArgumentParser:
    return commands.add_parser(name, help=help, description=description, epilog=_examples(*examples),
                               formatter_class=argparse.RawDescriptionHelpFormatter)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="coordinator", description=_MAIN, epilog=_MAIN_EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")

    bundle = _parser(
        commands, "bundle", "save, load, inspect, list, remove and copy bundles",
        "A bundle holds every compiled artifact of a job (the Mega-Cache of its compiles, the\n"
        "compiled CPU kernels, Triton autotune results), sealed with checksums and, with\n"
        f"{variable('secret')} set, an HMAC signature; every one is verified before anything\n"
        "is written. A job saves one with --coordinator-save-bundle URL (coordinator-run) or\n"
        "coordinator.save_bundle(URL); a later job restores it with --coordinator-restore URL.\n\n"
        + _STORES,
        ["coordinator bundle ls file:///shared/bundles",
         "coordinator bundle load redis://cache:6379/0 --name gpt-7b"])
    actions = bundle.add_subparsers(dest="action", required=True, title="actions", metavar="ACTION")
    save = _parser(actions, "save", "publish a bundle file to a store",
                   "Verify a bundle file (checksums, and the signature with "
                   f"{variable('secret')})\nand publish it to a store under a name.",
                   ["coordinator bundle save redis://cache:6379/0 gpt-7b.bundle --name gpt-7b --ttl 604800"])
    save.add_argument("url", help="the store to publish to: " + _URL)
    save.add_argument("file", help="the bundle file (from coordinator bundle load URL --out FILE, or "
                                   "the bytes of coordinator.bundles.format.pack_bundle())")
    save.add_argument("--name", default="default", help=_NAME)
    save.add_argument("--ttl", type=float, default=None, help="seconds until Redis expires it (default: never)")
    save.add_argument("--max-bytes", type=int, default=None, help="refuse a bundle larger than this (default: any)")
    load = _parser(actions, "load", "fetch, verify and install a bundle (or --out FILE)",
                   "Fetch a bundle from a store, verify it and install it into this machine's Inductor\n"
                   "cache dir (TORCHINDUCTOR_CACHE_DIR, else Inductor's default), once per node however\n"
                   "many processes ask; prints what it installed. With --out, only write the verified\n"
                   "bytes to a file.",
                   ["coordinator bundle load redis://cache:6379/0 --name gpt-7b",
                    "coordinator bundle load redis://cache:6379/0 --name gpt-7b --out gpt-7b.bundle"])
    load.add_argument("url", help="the store to fetch from: " + _URL)
    load.add_argument("--name", default="default", help=_NAME)
    load.add_argument("--out", default=None, help="write the verified bundle to this file instead of installing it")
    inspect = _parser(actions, "inspect", "print a bundle's fingerprint, sizes, kernels, signature",
                      "Verify a bundle in a store or a file and print, as JSON, the environment it was\n"
                      "built in (and whether it is this one), when and where, its compile time, its\n"
                      "sizes by kind, its kernels and its signature.",
                      ["coordinator bundle inspect file:///shared/bundles --name nightly",
                       "coordinator bundle inspect gpt-7b.bundle"])
    inspect.add_argument("source", help="store URL or bundle file")
    inspect.add_argument("--name", default="default", help=_NAME)
    ls = _parser(actions, "ls", "list the bundles in a store: key, bytes, age",
                 "List every bundle in a store, one line each: its key\n"
                 "(bundles/<environment>/<secret>/<namespace>/<name>), its size in bytes and its age\n"
                 "('-' where the store keeps no time, as Redis).",
                 ["coordinator bundle ls s3://my-bucket/compile | head"])
    ls.add_argument("url", help="the store: " + _URL)
    rm = _parser(actions, "rm", "remove a bundle, or every bundle older than an age",
                 "Remove bundle NAME (of this environment, secret and namespace), or a key as\n"
                 "'coordinator bundle ls' lists it, or with --older-than every bundle in the store\n"
                 "(any environment) written longer ago than that.",
                 ["coordinator bundle rm redis://cache:6379/0 gpt-7b",
                  "coordinator bundle rm s3://my-bucket/compile --older-than 604800"])
    rm.add_argument("url", help="the store: " + _URL)
    rm.add_argument("name", nargs="?", default=None,
                    help="bundle name, or a key as `coordinator bundle ls` lists it")
    rm.add_argument("--older-than", type=float, default=None, metavar="SECONDS",
                    help="remove every bundle in the store (any environment) written longer ago than this")
    copy = _parser(actions, "copy", "publish every verified bundle of one store to another (and remove it there)",
                   "Publish every bundle of one store to another under the same key, each verified\n"
                   "first (a bundle that fails is left out, with a warning); the source copies are\n"
                   "removed unless --keep. The SLURM Epilog publishes a node's outbox this way.",
                   ["coordinator bundle copy outbox redis://cache:6379/0 --keep"])
    copy.add_argument("src", help="the store to copy from: " + _URL)
    copy.add_argument("dst", help="the store to copy to: " + _URL)
    copy.add_argument("--keep", action="store_true", help="leave the source copies")

    slurm = _parser(
        commands, "slurm", "SLURM node hooks: install a job's bundle before it, publish its bundle after",
        "SLURM's node hooks, run by slurmd through launch/slurm/prolog.sh and epilog.sh (see\n"
        "launch/slurm/README.md for installing them). They read the job's settings from the\n"
        "site's coordinator.env and the job's comment (sbatch --comment\n"
        "\"coordinator.bundle=NAME\"), do their work as the job's user, and always exit 0: an\n"
        "error is logged and the job compiles as usual.",
        ["coordinator slurm prolog    # as slurmd runs it, with SLURM_JOB_ID, SLURM_JOB_UID, ... set"])
    hooks = slurm.add_subparsers(dest="hook", required=True, title="hooks", metavar="HOOK")
    _parser(hooks, "prolog", "before a job's tasks start on a node: fetch, verify and install the bundle the job "
                             "names into the node's Inductor cache dir",
            "Before a job's tasks start on a node: fetch the bundle the job names\n"
            f"({variable('restore_bundle')}, {variable('bundle_name')}, or the job's comment),\n"
            "verify it and install it into the node's Inductor cache dir, so that the tasks load\n"
            "their graphs instead of compiling them.",
            ["Prolog=/etc/slurm/coordinator/prolog.sh    # slurm.conf; prolog.sh runs: coordinator slurm prolog"])
    _parser(hooks, "epilog", "when the job ends on a node: publish the bundles it left in the node's outbox, then "
                             "remove the node's cache dir if asked",
            "When the job's allocation ends on a node: publish the bundles the job left in the\n"
            f"node's outbox (COORDINATOR_SAVE_BUNDLE=outbox) to {variable('push_bundle')}, each verified\n"
            f"first, then remove the node's cache dir if {variable('slurm_clean')}=1.",
            ["Epilog=/etc/slurm/coordinator/epilog.sh    # slurm.conf; epilog.sh runs: coordinator slurm epilog"])

    report = _parser(
        commands, "report", "merge a traced job's rank traces: one timeline, a picture, a table",
        "Merge the rank traces a job wrote into DIR (coordinator-run --coordinator-trace DIR,\n"
        "COORDINATOR_TRACE=DIR, or compile_once(trace_dir=DIR)): print a table per rank (graphs\n"
        "compiled, received, found locally, waits, seconds waited and saved, bytes) with a\n"
        "legend, warn where ranks compiled different graphs, and write DIR/job.trace.json (for\n"
        "Perfetto) and, with matplotlib, DIR/job.png and .svg\n"
        '(pip install "torch-compile-coordinator[plot]").',
        ["COORDINATOR_TRACE=trace torchrun --standalone --nproc-per-node 4 train.py && coordinator report trace"])
    report.add_argument("dir", help="the job's --coordinator-trace directory")
    report.add_argument("--no-picture", action="store_true", help="write the trace and the table only")
    return parser


def _report_command(args: argparse.Namespace) -> int:
    from coordinator.observe.report import write_report

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
    for warning in report.warnings:
        print(f"warning: {warning}")
    for note in report.notes:
        print(f"note: {note}")
    for path in report.written:
        print(f"wrote {path}")
    return 0


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("url", "src", "dst"):
        if getattr(args, name, None):
            setattr(args, name, bundle_url(getattr(args, name)))
    if args.command == "slurm":
        import logging

        from coordinator.jobs import slurm

        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
        return slurm.prolog() if args.hook == "prolog" else slurm.epilog()
    if args.command == "report":
        return _report_command(args)
    try:
        return _bundle_command(args)
    except BrokenPipeError:
        raise
    except (CoordinatorError, FileNotFoundError, OSError) as exc:
        print(f"coordinator: {exc}", file=sys.stderr)
        return 1


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

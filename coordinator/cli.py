"""The ``coordinator`` command line: manage persisted bundles, report on a traced job.

    coordinator bundle save URL FILE [--name NAME] [--ttl S] [--max-bytes N]
    coordinator bundle load URL [--name NAME] [--out FILE]
    coordinator bundle inspect URL|FILE [--name NAME]
    coordinator bundle ls URL
    coordinator bundle rm URL NAME
    coordinator bundle copy SRC_URL DST_URL [--keep]
    coordinator slurm prolog|epilog
    coordinator report DIR [--no-picture]

``URL`` is a ``redis://``/``rediss://`` or ``file://`` store, or ``outbox``: this node's
outbox in Inductor's cache dir, which the SLURM Epilog publishes from. ``load`` fetches,
verifies and installs into this machine's Inductor cache dir (once per node), or with
``--out`` only downloads the verified bytes. The secret and namespace are the ``secret``
and ``namespace`` settings' (``coordinator.settings``). ``copy`` publishes every verified
bundle of one store to another.
Exit status: 0 on success, 1 on a refused, unreadable or missing bundle (``ls`` and ``copy``
list or publish the others first), 2 on bad usage.
``slurm prolog|epilog`` are SLURM's node hooks (see ``coordinator.jobs.slurm``); they always
exit 0. ``report`` merges the rank traces a job wrote with ``--coordinator-trace DIR`` into
one Chrome trace and a picture in ``DIR``, and prints a table per rank and any warnings
(see ``coordinator.observe.report``); exit status 1 when ``DIR`` holds no trace.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import timedelta

from coordinator.bundles.format import read_bundle
from coordinator.bundles.install import load_bundle
from coordinator.bundles.keys import bundle_key, bundle_url
from coordinator.bundles.transfer import copy_bundles, save_bundle
from coordinator.errors import ConfigError, CoordinatorError, IntegrityError
from coordinator.protocol.fingerprint import fingerprint
from coordinator.settings import Config, variable


def _read_source(source: str, name: str, config: Config) -> bytes:
    if "://" in source:
        from coordinator.protocol.stores import open_store

        blob = open_store(source).get(bundle_key(name, config=config))
        if blob is None:
            raise FileNotFoundError(f"no bundle {name!r} for environment {fingerprint()} in {source}")
        return blob
    with open(source, "rb") as f:
        return f.read()


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
        print(f"saved {size} bytes as {bundle_key(args.name, config=config)}")
    elif args.action == "load":
        if args.out:
            blob = _read_source(args.url, args.name, config)
            read_bundle(blob, secret=secret)
            with open(args.out, "wb") as f:
                f.write(blob)
            print(f"wrote {len(blob)} verified bytes to {args.out}")
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
        for key in store.list_keys("bundles/"):
            blob = store.get(key)
            if blob is None:  # removed meanwhile
                continue
            try:  # checksums and layout; a signature needs the bundle's secret, which `load` checks
                read_bundle(blob, check_environment=False)
            except IntegrityError as exc:
                print(f"coordinator: {key} is not a bundle: {exc}", file=sys.stderr)
                unreadable += 1
                continue
            print(f"{key}\t{len(blob)}")
            listed += 1
        if not listed:
            print(f"no bundles in {args.url}")
        return 1 if unreadable else 0
    elif args.action == "rm":
        from coordinator.protocol.stores import open_store

        open_store(args.url).delete(bundle_key(args.name, config=config))
        print(f"removed {bundle_key(args.name, config=config)}")
    elif args.action == "copy":
        refused: dict[str, str] = {}
        for key in copy_bundles(args.src, args.dst, move=not args.keep, config=config, refused=refused):
            print(f"published {key}")
        for key, reason in refused.items():
            print(f"coordinator: not published {key}: {reason}", file=sys.stderr)
        return 1 if refused else 0
    return 0


_URL = "redis://host:port/db, rediss://..., file:///dir, or outbox (this node's outbox)"
_NAME = (f"bundle name (default: default); the secret and namespace come from {variable('secret')}, "
         f"{variable('namespace')}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="coordinator", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    bundle = commands.add_parser("bundle", help="save, load, inspect, list and remove bundles")
    actions = bundle.add_subparsers(dest="action", required=True)
    save = actions.add_parser("save", help="publish a bundle file to a store",
                              description="Verify a bundle file (checksums, and the signature with "
                                          f"{variable('secret')}) and publish it to a store under a name.")
    save.add_argument("url", help="the store to publish to: " + _URL)
    save.add_argument("file", help="the bundle file (from `coordinator bundle load URL --out FILE`, or "
                                   "bytes of coordinator.bundles.format.pack_bundle())")
    save.add_argument("--name", default="default", help=_NAME)
    save.add_argument("--ttl", type=float, default=None, help="seconds until Redis expires it (default: never)")
    save.add_argument("--max-bytes", type=int, default=None, help="refuse a bundle larger than this (default: any)")
    load = actions.add_parser("load", help="fetch, verify and install a bundle (or --out FILE)")
    load.add_argument("url", help="the store to fetch from: " + _URL)
    load.add_argument("--name", default="default", help=_NAME)
    load.add_argument("--out", default=None, help="write the verified bundle to this file instead of installing it")
    inspect = actions.add_parser("inspect", help="print a bundle's fingerprint, sizes, kernels, signature")
    inspect.add_argument("source", help="store URL or bundle file")
    inspect.add_argument("--name", default="default", help=_NAME)
    ls = actions.add_parser("ls", help="list the bundles in a store")
    ls.add_argument("url", help="the store: " + _URL)
    rm = actions.add_parser("rm", help="remove a bundle")
    rm.add_argument("url", help="the store: " + _URL)
    rm.add_argument("name", help="bundle name")
    copy = actions.add_parser("copy",
                              help="publish every verified bundle of one store to another (and remove it there)")
    copy.add_argument("src", help="the store to copy from: " + _URL)
    copy.add_argument("dst", help="the store to copy to: " + _URL)
    copy.add_argument("--keep", action="store_true", help="leave the source copies")
    slurm = commands.add_parser("slurm", help="SLURM node hooks: restore before a job, push and clean after")
    slurm.add_argument("hook", choices=["prolog", "epilog"])
    report = commands.add_parser("report", help="merge a traced job's rank traces: one timeline, a picture, a table")
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
    for warning in report.warnings:
        print(f"warning: {warning}")
    for note in report.notes:
        print(f"note: {note}")
    for path in report.written:
        print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
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
    except (CoordinatorError, FileNotFoundError, OSError) as exc:
        print(f"coordinator: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

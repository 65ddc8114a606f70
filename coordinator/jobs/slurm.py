"""SLURM prolog and epilog: warm each node's Inductor cache before a job's tasks start.

slurmd runs the Prolog once per node of a job, as root, before the job's first step
there, and the Epilog once per node when the allocation ends. ``launch/slurm/prolog.sh``
and ``epilog.sh`` source the site settings beside them and call ``coordinator slurm
prolog|epilog``, which:

* reads the job's settings (``coordinator.settings.JobSettings``): the site file's
  variables, then a config file the job names in its comment (``--comment coordinator.config=/path``), then
  ``coordinator.<key>=<value>`` items of the comment itself. SLURM hands prologs the
  job's comment, not its environment. A secret comes only from a file: anyone can
  read a job's comment;
* drops to the job's user (uid, gid, no supplementary groups) for everything that
  touches files or unpickles: the node's cache dir is created by the user, with the
  user's permissions, and a path in a user's config cannot make root write or delete
  anything;
* Prolog: fetches, verifies and installs the persisted bundle into the node-local
  cache dir (by default ``/tmp/torchinductor_<user>``, Inductor's own default, so
  tasks find it with no setting);
* Epilog: publishes the bundles the job left in the node's outbox
  (``<cache dir>/coordinator-outbox``, a ``file://`` store the job's rank 0 saves to
  with the ``save_bundle`` setting ``outbox``) to the push store, verified first; then
  removes the cache dir when the ``slurm_clean`` setting is on.

Neither ever fails the job: a failing Prolog drains the node and requeues the job,
so every error (an unreachable store, a refused bundle, a timeout) is logged and the
exit status is 0. The job then compiles as usual.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pwd
import shutil
import subprocess
import sys
import time

from coordinator import _compat
from coordinator.bundles.keys import OUTBOX
from coordinator.protocol.stores import shown_url
from coordinator.settings import Config, JobSettings, variable

log = logging.getLogger(__name__)

#: Keys a job may set in its comment, and the variables they stand for. No secret:
#: a job's comment is visible to every user of the cluster.
COMMENT_KEYS = {
    "restore": variable("restore_bundle"),
    "bundle": variable("bundle_name"),
    "namespace": variable("namespace"),
    "push": variable("push_bundle"),
    "config": variable("job_config"),
}
#: Object stores' own variables that say where a store is and which profile or key file to use,
#: handed from the hook's environment (the site file) to the step run as the job's user. The
#: credentials themselves are not: that step finds its own (its home's profile, a key file
#: named here and readable by the user, the instance's role).
OBJECT_STORE_VARIABLES = (
    "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE",
    "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CA_BUNDLE",
    "GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT", "STORAGE_EMULATOR_HOST",
    "AZURE_STORAGE_ACCOUNT_NAME",
)
#: The job settings the hooks read from the site file, a job's config file and its comment.
_HOOK_SETTINGS = ("restore_bundle", "push_bundle", "bundle_name", "node_cache_dir", "slurm_clean", "slurm_timeout")
#: Variables a site file or a job's config file may set.
FILE_KEYS = set(COMMENT_KEYS.values()) - {variable("job_config")} | {
    variable(name) for name in ("secret", "node_cache_dir", "slurm_clean", "slurm_timeout")
}


@dataclasses.dataclass(frozen=True)
class SlurmJob:
    """What the prolog and epilog do for one job on one node."""

    job_id: str
    user: str
    uid: int
    gid: int
    cache_dir: str
    restore_url: str | None = None
    push_url: str | None = None
    bundle_name: str = "default"
    namespace: str = ""
    secret: str | None = None
    clean: bool = False
    timeout_s: float = 300.0

    @property
    def outbox_url(self) -> str:
        return "file://" + os.path.join(self.cache_dir, OUTBOX)

    def child_environment(self) -> dict[str, str]:
        """The environment of the step run as the job's user."""
        try:
            home = pwd.getpwuid(self.uid).pw_dir
        except KeyError:
            home = "/"
        env = {
            "PATH": os.environ.get("PATH") or "/usr/local/bin:/usr/bin:/bin",
            "HOME": home,
            "USER": self.user,
            "LOGNAME": self.user,
            "SLURM_JOB_ID": self.job_id,
            "TORCHINDUCTOR_CACHE_DIR": self.cache_dir,
            variable("bundle_name"): self.bundle_name,
            variable("namespace"): self.namespace,
            variable("slurm_as_user"): "1",
        }
        if os.environ.get("PYTHONPATH"):  # where an operator installed coordinator off the default path
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        env.update({name: os.environ[name] for name in OBJECT_STORE_VARIABLES if os.environ.get(name)})
        for name, value in (("restore_bundle", self.restore_url), ("push_bundle", self.push_url),
                            ("secret", self.secret), ("node_cache_dir", self.cache_dir),
                            ("slurm_clean", "1" if self.clean else "0")):
            if value:
                env[variable(name)] = value
        return env


def parse_comment(comment: str) -> dict[str, str]:
    """``coordinator.<key>=<value>`` items (separated by spaces or commas) of a job comment."""
    found: dict[str, str] = {}
    for item in comment.replace(",", " ").split():
        name, eq, value = item.partition("=")
        if not (eq and name.startswith("coordinator.")):
            continue
        key = name[len("coordinator."):]
        if key not in COMMENT_KEYS:
            log.warning("coordinator slurm: ignoring unknown comment key %r (known: %s)", key, ", ".join(COMMENT_KEYS))
            continue
        found[COMMENT_KEYS[key]] = value
    return found


def read_settings_file(path: str, *, owner_uid: int | None = None) -> dict[str, str]:
    """``KEY=VALUE`` lines of ``path`` (``#`` comments, optional quotes), our keys only.

    With ``owner_uid``, the file must belong to that user or root and be writable by
    no one else; otherwise it is ignored with a warning.
    """
    try:
        st = os.stat(path)
        if owner_uid is not None and (st.st_uid not in (owner_uid, 0) or st.st_mode & 0o022):
            log.warning("coordinator slurm: ignoring %s: not owned by the job's user, or writable by others", path)
            return {}
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as exc:
        log.warning("coordinator slurm: cannot read settings file %s: %s", path, exc)
        return {}
    found: dict[str, str] = {}
    for line in lines:
        line = line.strip()
        if line.startswith("export "):
            line = line[len("export "):].strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        name, _, value = line.partition("=")
        name, value = name.strip(), value.strip().strip("'\"")
        if name in FILE_KEYS:
            found[name] = value
    return found


def job_settings(environ: dict[str, str]) -> SlurmJob:
    """Resolve one job's settings: site variables < job config file < job comment."""
    uid = int(environ.get("SLURM_JOB_UID", os.getuid()))
    try:
        entry = pwd.getpwuid(uid)
        user, default_gid = entry.pw_name, entry.pw_gid
    except KeyError:
        user, default_gid = environ.get("SLURM_JOB_USER", str(uid)), os.getgid()
    gid = int(environ.get("SLURM_JOB_GID", default_gid))
    job_id = environ.get("SLURM_JOB_ID", "")

    merged = {name: value for name, value in environ.items() if name in FILE_KEYS and value}
    comment = parse_comment(environ.get("SLURM_JOB_COMMENT", ""))
    job_config = JobSettings.resolve(comment, names=("job_config",)).job_config
    comment.pop(variable("job_config"), None)
    if job_config:
        merged.update(read_settings_file(job_config, owner_uid=uid))
    merged.update(comment)

    job = JobSettings.resolve(merged, names=_HOOK_SETTINGS)
    template = job.node_cache_dir
    cache_dir = template.format(user=user, uid=uid, job=job_id) if template else _compat.default_cache_dir(user)
    # The bundle's settings as compile_once reads them (validated): the rest of merged is ours.
    config = Config.resolve(environ={name: merged[name] for name in (variable("secret"), variable("namespace"))
                                     if name in merged})
    return SlurmJob(
        job_id=job_id, user=user, uid=uid, gid=gid, cache_dir=cache_dir,
        restore_url=job.restore_bundle, push_url=job.push_bundle, bundle_name=job.bundle_name,
        namespace=config.namespace,
        secret=config.secret.decode() if config.secret else None,
        clean=job.slurm_clean, timeout_s=job.slurm_timeout,
    )


def _run_as_job_user(hook: str, settings: SlurmJob) -> None:
    """Run ``coordinator slurm <hook>`` again as the job's user, bounded by the timeout."""
    cmd = [sys.executable, "-m", "coordinator.cli", "slurm", hook]
    drop = {"user": settings.uid, "group": settings.gid, "extra_groups": []} if os.getuid() == 0 else {}
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, env=settings.child_environment(), cwd="/", timeout=settings.timeout_s,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **drop)
    except subprocess.TimeoutExpired:
        log.warning("coordinator slurm %s: job %s: gave up after %.0fs; the job compiles as usual",
                    hook, settings.job_id, settings.timeout_s)
        return
    for line in done.stdout.splitlines():
        log.warning("coordinator slurm %s: %s", hook, line)
    log.warning("coordinator slurm %s: job %s user %s: exit %d in %.1fs", hook, settings.job_id, settings.user,
                done.returncode, time.monotonic() - start)


def _as_job_user(environ: dict[str, str]) -> bool:
    return JobSettings.resolve(environ, names=("slurm_as_user",)).slurm_as_user


def prolog(environ: dict[str, str] | None = None) -> int:
    """The Prolog. Always returns 0."""
    environ = dict(os.environ if environ is None else environ)
    try:
        settings = job_settings(environ)
        if not settings.restore_url:
            log.warning("coordinator slurm prolog: job %s: no %s; nothing to restore",
                        settings.job_id, variable("restore_bundle"))
        elif _as_job_user(environ):
            _restore(settings)
        else:
            _run_as_job_user("prolog", settings)
    except Exception as exc:  # never fail a job: a failed prolog drains the node
        log.warning("coordinator slurm prolog: %s: %s", type(exc).__name__, exc)
    return 0


def epilog(environ: dict[str, str] | None = None) -> int:
    """The Epilog. Always returns 0."""
    environ = dict(os.environ if environ is None else environ)
    try:
        settings = job_settings(environ)
        if not (settings.push_url or settings.clean):
            return 0
        if _as_job_user(environ):
            _push_and_clean(settings)
        else:
            _run_as_job_user("epilog", settings)
    except Exception as exc:  # a failed epilog drains the node
        log.warning("coordinator slurm epilog: %s: %s", type(exc).__name__, exc)
    return 0


def _restore(settings: SlurmJob) -> None:
    os.makedirs(settings.cache_dir, mode=0o700, exist_ok=True)
    from coordinator.bundles import load_bundle

    try:
        result = load_bundle(settings.restore_url, name=settings.bundle_name, secret=settings.secret)
    except FileNotFoundError as exc:
        print(f"no bundle to restore yet: {exc}")
        return
    except Exception as exc:  # unreachable store, refused bundle: the job compiles as usual
        print(f"could not restore bundle {settings.bundle_name!r} from {shown_url(settings.restore_url)}: "
              f"{type(exc).__name__}: {exc}")
        return
    print(f"restored bundle {settings.bundle_name!r} into {settings.cache_dir}: {result}")


def _push_and_clean(settings: SlurmJob) -> None:
    if settings.push_url and os.path.isdir(os.path.join(settings.cache_dir, OUTBOX)):
        from coordinator.bundles.transfer import copy_bundles

        try:
            pushed = copy_bundles(settings.outbox_url, settings.push_url, secret=settings.secret)
            print(f"pushed {len(pushed)} bundle(s) to {shown_url(settings.push_url)}: {pushed}")
        except Exception as exc:
            print(f"could not push bundles to {shown_url(settings.push_url)}: {type(exc).__name__}: {exc}")
    if settings.clean:
        shutil.rmtree(settings.cache_dir, ignore_errors=True)
        print(f"removed {settings.cache_dir}")

"""Triton kernels tuned at their first launch: what a rank shares, and when.

Triton tuning runs only on a GPU; the GPU tier (``tests/gpu``) runs it for real. Here,
on CPU, the two pieces that are plain Python and files are checked against a real
store and real directories: the Triton cache entry that travels with an autotune
entry, and the hold-until-the-descent-ends protocol of ``_compat.triton_tuning_hooks``,
driven through ``CachingAutotuner``'s own method names by stand-ins that save as
Inductor's ``AutotuneCache.save`` does (the real methods need CUDA); and the routing of
kernels compiled in compile workers, through Inductor's real ``AutotuneCache``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from coordinator import Config, _compat
from coordinator.features.artifacts import (
    ShippedKernels,
    collect_triton_modules,
    emit_triton_kernels,
    read_triton_kernel,
)
from coordinator.features.kernel_tuning import KernelTuning
from coordinator.features.tuning_steps import TuningSteps
from coordinator.session import Session


def fake_triton_entry(triton_dir, name="ABCD1234", kernel="triton_red_fused_0"):
    """A Triton cache entry as Triton 3.x writes one: binaries plus JSON naming them by absolute path."""
    directory = triton_dir / name
    directory.mkdir(parents=True)
    (directory / f"{kernel}.cubin").write_bytes(b"\x7fELF cubin " + name.encode())
    (directory / f"{kernel}.json").write_text(json.dumps({"name": kernel, "num_warps": 4}))
    (directory / f"__grp__{kernel}.json").write_text(json.dumps({"child_paths": {
        f"{kernel}.cubin": str(directory / f"{kernel}.cubin"), f"{kernel}.json": str(directory / f"{kernel}.json")}}))
    return directory


def test_triton_entry_travels_and_lands_at_the_receivers_path(tmp_path, caplog):
    sent = read_triton_kernel(str(fake_triton_entry(tmp_path / "leader")))
    assert sorted(sent) == ["triton/ABCD1234/__grp__triton_red_fused_0.json",
                            "triton/ABCD1234/triton_red_fused_0.cubin", "triton/ABCD1234/triton_red_fused_0.json"]
    assert str(tmp_path / "leader").encode() not in b"".join(sent.values())  # no sender path travels

    receiver = tmp_path / "follower" / "triton"
    assert emit_triton_kernels(str(receiver), sent) == 1
    group = json.loads((receiver / "ABCD1234" / "__grp__triton_red_fused_0.json").read_text())
    for child in group["child_paths"].values():  # Triton opens these: they must be the receiver's own files
        assert child.startswith(str(receiver / "ABCD1234")) and os.path.exists(child)
    assert (receiver / "ABCD1234" / "triton_red_fused_0.cubin").read_bytes() == b"\x7fELF cubin ABCD1234"
    assert not [p for p in receiver.iterdir() if p.name.startswith("tmp.")]  # the temp dir was renamed, not left

    (receiver / "ABCD1234" / "triton_red_fused_0.cubin").write_bytes(b"local")
    assert emit_triton_kernels(str(receiver), sent) == 0  # an entry already there is kept
    assert (receiver / "ABCD1234" / "triton_red_fused_0.cubin").read_bytes() == b"local"

    with caplog.at_level(logging.WARNING, logger="coordinator"):
        assert emit_triton_kernels(str(receiver), {"triton/../../etc/x": b"", "triton/X/../../y": b""}) == 0
    assert caplog.text.count("unexpected Triton cache path") == 2
    assert read_triton_kernel(str(tmp_path / "missing")) == {}


class StandInTuner:
    """Saves as Inductor's CachingAutotuner does: a config search saves its pick; a
    coordinate descent compiles configs into the Triton cache and saves its winner."""

    def __init__(self, session: Session, name: str, triton_dir, coordesc: bool, descends: bool = True):
        self.session, self.name, self.triton_dir, self.descends = session, name, triton_dir, descends
        self.inductor_meta = {"coordinate_descent_tuning": coordesc, "kernel_name": name}
        self.triton_meta = {"device": 0}

    def save(self, config: dict, found_by_coordesc: bool) -> None:
        data = json.dumps({**config, "configs_hash": "h", "found_by_coordesc": found_by_coordesc, "time_taken_ms": 9})
        self.session.put("autotune", self.name, data.encode())

    def autotune_to_one_config(self):
        self.save({"XBLOCK": 64, "num_warps": 4}, found_by_coordesc=False)

    def coordinate_descent_tuning(self, launcher):
        if not self.descends:  # not eligible (a template kernel, say): no save
            return launcher
        fake_triton_entry(self.triton_dir, name=f"WIN{self.name[-1]}", kernel=self.name)
        self.save({"XBLOCK": 128, "num_warps": 8}, found_by_coordesc=True)
        return SimpleNamespace(cache_hash=f"WIN{self.name[-1]}")

    def first_launch(self) -> None:  # CachingAutotuner.run's order
        self.autotune_to_one_config()
        if self.inductor_meta["coordinate_descent_tuning"]:
            self.coordinate_descent_tuning(SimpleNamespace(cache_hash="SEARCH"))


@pytest.fixture
def tuning(tmp_path, monkeypatch):
    """A leader session with the tuning hooks around stand-in tuner methods, and a reader."""
    from torch._inductor.runtime import triton_heuristics as th

    triton_dir = tmp_path / "leader-triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(triton_dir))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "leader-node"))
    for name in ("autotune_to_one_config", "coordinate_descent_tuning"):
        monkeypatch.setattr(th.CachingAutotuner, name, getattr(StandInTuner, name))
    # No recheck backport: no CUDA here.
    monkeypatch.setattr(_compat.triton_tuning, "needs_fix", lambda bug: False)
    url = f"file://{tmp_path / 'store'}"
    leader = Session(Config(store=url))
    store = leader.flight().store

    def published(name: str) -> dict | None:
        from coordinator.protocol.integrity import open_sealed

        assert leader.flight().drain(timedelta(seconds=30))  # published behind the tuning
        blob = store.get(f"v/{leader.store_key('autotune', name)}")
        return None if blob is None else open_sealed(leader.store_key("autotune", name), blob)

    with _compat.triton_tuning_hooks(KernelTuning(leader.feature(TuningSteps).step)):
        yield SimpleNamespace(leader=leader, published=published, triton_dir=triton_dir, url=url,
                              tuner=lambda name, **kw: StandInTuner(leader, name, triton_dir, **kw),
                              call=lambda tuner, method, *a: getattr(th.CachingAutotuner, method)(tuner, *a))
    leader.close()


def test_an_fx_graphs_compile_ships_the_host_modules_triton_built_for_it(tmp_path):
    # The launcher of a kernel signature the static launcher cannot run, and the driver's
    # utilities, each a Triton cache entry of its own, written during the graph's compile;
    # not the kernels themselves (the FX entry bundles those), nor entries from before.
    import time

    leader = tmp_path / "leader" / "triton"
    old = fake_triton_entry(leader, name="OLDLAUNCHER")
    (old / "__triton_launcher.cpython-311-x86_64-linux-gnu.so").write_bytes(b"old")
    os.utime(old, (time.time() - 600, time.time() - 600))
    claimed = time.time()
    fake_triton_entry(leader, name="KERNEL")
    for name, module in (("LAUNCHER", "__triton_launcher"), ("UTILS", "cuda_utils")):
        (leader / name).mkdir()
        (leader / name / f"{module}.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\x7fELF " + name.encode())
    shipped = collect_triton_modules(str(leader), claimed)
    assert sorted(shipped) == ["triton/LAUNCHER/__triton_launcher.cpython-311-x86_64-linux-gnu.so",
                               "triton/UTILS/cuda_utils.cpython-311-x86_64-linux-gnu.so"]
    kernels = ShippedKernels(lambda: str(tmp_path / "leader" / "inductor"), lambda: str(leader), gpu=lambda: True)
    kernels.missed("key")
    assert kernels.built_for("key", claimed) == shipped
    receiver = ShippedKernels(lambda: str(tmp_path / "follower"), lambda: str(tmp_path / "follower" / "triton"))
    assert receiver.emit(shipped) == 2
    assert (tmp_path / "follower" / "triton" / "LAUNCHER" / "__triton_launcher.cpython-311-x86_64-linux-gnu.so"
            ).read_bytes() == b"\x7fELF LAUNCHER"


def test_a_library_still_being_built_never_travels_nor_lands(tmp_path, caplog):
    # Ranks of a node share a cache dir: a C++ kernel that another rank's compiler is still
    # writing (its section headers, written last, not there yet) must not go out with an
    # entry, and a cut-off one received must not be written (a loader fails on it: "file
    # too short"); Inductor builds those itself.
    import subprocess
    import time

    from coordinator.features.artifacts import collect_kernels, complete_library, emit_kernels, read_kernels

    (tmp_path / "k.c").write_text("int kernel(int x) { return x + 1; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp_path / "k.so"), str(tmp_path / "k.c")], check=True)
    whole = (tmp_path / "k.so").read_bytes()
    assert complete_library(whole) and not complete_library(whole[:-1]) and not complete_library(b"")
    cache = tmp_path / "cache"
    (cache / "ab").mkdir(parents=True)
    (cache / "ab" / "abdone.main.so").write_bytes(whole)
    (cache / "ab" / "abbusy.main.so").write_bytes(whole[: len(whole) // 2])
    assert sorted(collect_kernels(str(cache), time.time() - 5)) == ["ab/abdone.main.so"]
    assert sorted(read_kernels(str(cache), [str(p) for p in (cache / "ab").iterdir()])) == ["ab/abdone.main.so"]
    receiver = tmp_path / "receiver"
    with caplog.at_level(logging.WARNING, logger="coordinator"):
        assert emit_kernels(str(receiver), {"cd/cdcut.main.so": whole[:100], "cd/cdwhole.main.so": whole}) == 1
    assert not (receiver / "cd" / "cdcut.main.so").exists() and "cut-off kernel library" in caplog.text


def test_descent_result_is_shared_with_its_kernel_and_the_search_result_never(tuning, tmp_path, monkeypatch):
    tuner = tuning.tuner("triton_red_fused_0", coordesc=True)
    tuning.call(tuner, "autotune_to_one_config")
    assert tuning.published("triton_red_fused_0") is None  # the descent refines it next: held
    tuning.call(tuner, "coordinate_descent_tuning", SimpleNamespace(cache_hash="SEARCH"))
    sealed = tuning.published("triton_red_fused_0")
    assert json.loads(sealed.payload) == {"XBLOCK": 128, "num_warps": 8, "configs_hash": "h",
                                          "found_by_coordesc": True, "time_taken_ms": 9}
    assert sorted(sealed.files) == ["triton/WIN0/__grp__triton_red_fused_0.json",
                                    "triton/WIN0/triton_red_fused_0.cubin", "triton/WIN0/triton_red_fused_0.json"]

    # A follower gets the descent's config, and the winning kernel lands in its Triton cache.
    follower_triton = tmp_path / "follower-triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(follower_triton))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "follower-node"))
    follower = Session(Config(store=tuning.url))
    assert json.loads(follower.get("autotune", "triton_red_fused_0"))["found_by_coordesc"] is True
    assert (follower_triton / "WIN0" / "triton_red_fused_0.cubin").read_bytes() == b"\x7fELF cubin WIN0"
    assert follower.stats.as_dict()["kernels_received"] == 1
    follower.close()


def test_kernels_without_a_descent_publish_their_search_result(tuning):
    plain = tuning.tuner("triton_poi_fused_1", coordesc=False)
    tuning.call(plain, "autotune_to_one_config")
    assert json.loads(tuning.published("triton_poi_fused_1").payload)["XBLOCK"] == 64  # published at once

    ineligible = tuning.tuner("triton_tem_fused_2", coordesc=True, descends=False)
    tuning.call(ineligible, "autotune_to_one_config")
    assert tuning.published("triton_tem_fused_2") is None
    tuning.call(ineligible, "coordinate_descent_tuning", SimpleNamespace(cache_hash="SEARCH"))
    sealed = tuning.published("triton_tem_fused_2")  # the descent declined: the search's pick stands
    assert json.loads(sealed.payload)["XBLOCK"] == 64 and sealed.files == {}


#: A compile worker's part, run in a real subprocess: Inductor's own ``check_autotune_cache``
#: builds each kernel's ``AutotuneCache`` from its ``inductor_meta`` (remote cache switched
#: on, as routing bakes in) and the worker pickles the save hook back, as ``cached_autotune``
#: hands it to ``CachingAutotuner``. No coordinator backend is installed there.
WORKER = r"""
import pickle, sys
from types import SimpleNamespace
from torch._inductor.runtime import autotune_cache
from torch._inductor.runtime.triton_heuristics import check_autotune_cache

def config(kwargs, num_warps, num_stages, **_):  # triton.Config, which a CPU-only host lacks
    return SimpleNamespace(kwargs=kwargs, num_warps=num_warps, num_stages=num_stages)

autotune_cache.Config = config
kernels = {}
for name, filename, meta in pickle.loads(sys.stdin.buffer.read()):
    configs = [config({"XBLOCK": x}, 4, 1) for x in (64, 128)]
    kept, cache, info = check_autotune_cache(configs, filename, meta)
    kernels[name] = (cache.remote_cache is None, cache.save, kept, info)
sys.stdout.buffer.write(pickle.dumps(kernels))
"""


class KernelFromWorker:
    """A Triton kernel as it arrives from one of Inductor's compile workers (or is unpickled
    from an FX entry that such a kernel went into): what ``CachingAutotuner`` holds of its
    autotune cache is the save hook the worker built, without a remote cache."""

    def __init__(self, tmp_path, name: str, save_cache_hook, configs: list, info: dict, coordesc: bool = False,
                 node: str = "leader-node"):
        self.filename = str(tmp_path / node / "ab" / f"c{name}.py")
        self.inductor_meta = inductor_meta(name, coordesc)
        self.save_cache_hook = save_cache_hook
        self.fn = SimpleNamespace()  # what restore_after_unpickle touches
        self.configs, self.autotune_cache_info = configs, info  # after the worker's cache check
        self.compile_results = [SimpleNamespace(config=config) for config in configs]
        self.launchers = [SimpleNamespace(config=config) for config in configs]  # after precompile
        self.lock = threading.Lock()
        self._could_rblock_scale = False  # what recheck_autotune_cache reads since 2.14

    def is_statically_launchable(self) -> bool:  # what recheck_autotune_cache asserts
        return True

    def store_key(self, session: Session) -> str:
        """The session's key for this kernel's config: Inductor's Redis-style key, hashed."""
        remote, key = _compat.kernel_autotune_cache(self).remote_cache
        return session.store_key("autotune", remote._get_key(key))

    def first_launch(self) -> None:  # the config search saves its pick, as CachingAutotuner does
        config = SimpleNamespace(kwargs={"XBLOCK": 64}, num_warps=4, num_stages=1)
        self.save_cache_hook(config, 7_000_000)


def inductor_meta(name: str, coordesc: bool = False) -> dict:
    return {"autotune_local_cache": True, "autotune_remote_cache": True, "backend_hash": "b" * 64,
            "kernel_name": name, "coordinate_descent_tuning": coordesc}


def kernels_from_a_worker(tmp_path, names: list[str], coordesc: bool = False,
                          node: str = "leader-node") -> dict[str, KernelFromWorker]:
    """Build the kernels' autotune caches in a compile-worker process started now (with
    this process's environment, as Inductor starts its workers, and the Redis URL each
    compile job carries inside a session: ``test_api``'s compile-jobs test) and unpickle
    them here. The worker checks this rank's local autotune cache, as Inductor's do."""
    import os
    import pickle
    import subprocess
    import sys

    asked = [(name, str(tmp_path / node / "ab" / f"c{name}.py"), inductor_meta(name, coordesc))
             for name in names]
    env = dict(os.environ, TORCHINDUCTOR_REDIS_URL=_compat.NO_REDIS_URL)
    done = subprocess.run([sys.executable, "-c", WORKER], input=pickle.dumps(asked), capture_output=True,
                          check=True, timeout=120, env=env)
    kernels = {}
    for name, (no_remote_in_worker, hook, kept, info) in pickle.loads(done.stdout).items():
        assert no_remote_in_worker  # the worker had no remote cache: the case routed here
        kernels[name] = KernelFromWorker(tmp_path, name, hook, kept, info, coordesc, node)
        assert _compat.kernel_autotune_cache(kernels[name]).remote_cache is None
    return kernels


def test_a_kernel_is_tuned_once_and_the_next_rank_runs_its_config(tmp_path, monkeypatch):
    """A kernel compiled in a compile worker arrives without a remote autotune cache; it is
    routed through the coordinator, without a claim (a claim at load would last until the
    kernel's first launch). At its first launch its tuning step claims the key, tunes and
    publishes; a rank that loads the same kernel later adopts that config at its own first
    launch instead of searching. Seen on the GPU host without the routing: every follower
    tuned such kernels itself (7-25 of them at N=8)."""
    from torch._inductor.runtime import autotune_cache
    from torch._inductor.runtime import triton_heuristics as th

    import coordinator

    def config(kwargs, num_warps, num_stages, **_):  # triton.Config, which a CPU-only host lacks
        return SimpleNamespace(kwargs=kwargs, num_warps=num_warps, num_stages=num_stages)

    searched = []

    def search(self, *args, **kwargs):  # CachingAutotuner.autotune_to_one_config's effect, without a GPU
        searched.append(self.inductor_meta["kernel_name"])
        self.launchers = [self.launchers[1]]  # XBLOCK 128 wins
        self.save_cache_hook(self.launchers[0].config, 7_000_000)

    monkeypatch.setattr(autotune_cache, "Config", config)
    monkeypatch.setattr(th.CachingAutotuner, "autotune_to_one_config", search)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "leader-node"))
    monkeypatch.delenv("TORCHINDUCTOR_REDIS_URL", raising=False)
    monkeypatch.setattr(_compat, "routable_kinds", lambda kinds: list(kinds))  # route autotune without a GPU
    with coordinator.compile_once(f"file://{tmp_path / 'store'}") as session:
        torch.compile(lambda x: x)  # the sign of a compile: the session's hooks are in from here
        (kernel,) = kernels_from_a_worker(tmp_path, ["triton_poi_fused_0"]).values()
        th.CachingAutotuner.restore_after_unpickle(kernel, None)  # as async_compile does for a worker's kernel
        assert _compat.kernel_autotune_cache(kernel).remote_cache is not None
        assert not session.flight().holds_claims()  # routed, not claimed
        key = kernel.store_key(session)

        th.CachingAutotuner.autotune_to_one_config(kernel)  # its first launch here: tuned and published
        assert searched == ["triton_poi_fused_0"] and not session.flight().holds_claims()
        from coordinator.protocol.integrity import open_sealed

        assert session.flight().drain(timedelta(seconds=30))  # published behind the tuning
        best = json.loads(open_sealed(key, session.flight().store.get(f"v/{key}")).payload)
        assert best["XBLOCK"] == 128 and best["num_warps"] == 4

        # A rank on another node loads the same kernel (its worker finds no local config)...
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "follower-node"))
        (loaded,) = kernels_from_a_worker(tmp_path, ["triton_poi_fused_0"], node="follower-node").values()
        assert loaded.autotune_cache_info["autotune_cache_state"] == "miss" and len(loaded.launchers) == 2
        th.CachingAutotuner.restore_after_unpickle(loaded, None)
        th.CachingAutotuner.autotune_to_one_config(loaded)  # ... and at its first launch adopts the config
        assert searched == ["triton_poi_fused_0"]  # not searched again
        assert [launcher.config.kwargs for launcher in loaded.launchers] == [{"XBLOCK": 128}]

        # A static autotuner from an FX entry: Inductor's recheck reads its config through a
        # cache of its own, while the kernel saves through the one in the entry: that one is
        # routed too, or this rank's tuned config would never reach the store.
        (static,) = kernels_from_a_worker(tmp_path, ["triton_poi_fused_2"]).values()
        th.CachingAutotuner.recheck_autotune_cache(static, lambda: None)
        assert _compat.kernel_autotune_cache(static).remote_cache is not None
        assert not session.flight().holds_claims()  # a read at load, not a claim
        th.CachingAutotuner.autotune_to_one_config(static)
        assert session.flight().drain(timedelta(seconds=30))
        assert session.flight().store.get(f"v/{static.store_key(session)}") is not None


def test_a_config_found_in_this_ranks_cache_is_shared_under_the_key_a_loader_looks_up(tmp_path, monkeypatch):
    """A kernel this rank tuned in one graph comes back in a later graph (a transformer's
    first layer differs from the others, but its kernels do not): the compile worker finds
    the config in this rank's local cache and keeps it alone, and so does the FX entry. A
    rank loading the entry looks the config up under the hash of that one-config list; seen
    on the GPU host (12-layer GPT, max-autotune), it missed and descended 10 kernels again,
    and the leader itself descended again too (torch 2.11's worker dropped the flag)."""
    from torch._inductor.runtime import autotune_cache
    from torch._inductor.runtime import triton_heuristics as th
    from torch._inductor.runtime.autotune_cache import AutotuneCache

    import coordinator

    def config(kwargs, num_warps, num_stages, **_):  # triton.Config, which a CPU-only host lacks
        return SimpleNamespace(kwargs=kwargs, num_warps=num_warps, num_stages=num_stages)

    monkeypatch.setattr(autotune_cache, "Config", config)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "leader-node"))
    monkeypatch.delenv("TORCHINDUCTOR_REDIS_URL", raising=False)
    monkeypatch.setattr(_compat, "routable_kinds", lambda kinds: list(kinds))  # route autotune without a GPU
    with coordinator.compile_once(f"file://{tmp_path / 'store'}") as leader:
        torch.compile(lambda x: x)  # the sign of a compile: the session's hooks are in from here
        assert leader.flight().lookup(leader.store_key("fx_graph", "graph-1"), blocking=True).outcome == "claimed"
        (first,) = kernels_from_a_worker(tmp_path, ["triton_red_fused_0"], coordesc=True).values()
        th.CachingAutotuner.restore_after_unpickle(first, None)
        assert first.autotune_cache_info["autotune_cache_state"] == "miss" and len(first.configs) == 2
        first.save_cache_hook(config({"XBLOCK": 64}, 4, 1), 7_000_000, found_by_coordesc=True)  # its descent's pick

        # The next graph: the same kernel, compiled again in a worker, which finds its config here.
        leader.flight().lookup(leader.store_key("fx_graph", "graph-2"), blocking=True)
        (again,) = kernels_from_a_worker(tmp_path, ["triton_red_fused_0"], coordesc=True).values()
        assert again.autotune_cache_info["autotune_cache_state"] == "hit" and len(again.configs) == 1
        again.configs[0].found_by_coordesc = False  # as torch 2.11's read_best returns a config among the kernel's own
        th.CachingAutotuner.restore_after_unpickle(again, None)
        assert again.configs[0].found_by_coordesc is True  # so this rank does not descend again at its first launch

        kept_hash = th.hash_configs(again.configs)
        alias = AutotuneCache(kept_hash)
        alias._setup_remote_autotune_cache(again.inductor_meta, AutotuneCache._prepare_key(again.filename))
        remote, key = alias.remote_cache
        alias_key = leader.store_key("autotune", remote._get_key(key))
        assert alias_key != first.store_key(leader)
        from coordinator.protocol.integrity import open_sealed

        assert leader.flight().drain(timedelta(seconds=30))
        blob = leader.flight().store.get(f"v/{alias_key}")
        assert blob is not None  # published under the key of the one-config list too
        shared = json.loads(open_sealed(alias_key, blob).payload)
        assert shared["configs_hash"] == kept_hash and shared["found_by_coordesc"] is True and shared["XBLOCK"] == 64

        # A rank loading the FX entry (its own cache dir) rechecks the one-config static autotuner:
        # it finds the config, claims nothing, and does not descend.
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "follower-node"))
        loaded = KernelFromWorker(tmp_path, "triton_red_fused_0", again.save_cache_hook,
                                  [config({"XBLOCK": 64}, 4, 1)], again.autotune_cache_info, coordesc=True)
        th.CachingAutotuner.recheck_autotune_cache(loaded, lambda: None)
        assert leader.flight().claim_started(alias_key) is None
        assert loaded.autotune_cache_info["autotune_cache_state"] == "hit"
        assert loaded.compile_results[0].config.found_by_coordesc is True

"""Every use of a torch-private API in the coordinator lives in this package.

Inductor exposes what we need only through private names. Keeping them here means one place
to check when torch moves; the rest of the library imports only the names re-exported below.

Torch versions, where each ran:

=========  ===========  ==========================================================
torch      where        notes
=========  ===========  ==========================================================
2.13.0     CPU (x86)    dev and CI machines; the full test suite; every hook below
                        read from its source
2.14.1     CPU (x86)    a CUDA build run on the CPU; CI's second leg, the full suite
2.11.0     H200, H100   device machines; the GPU tier (``tests/gpu``) and the GPU
                        benchmarks of ``benchmarks/RESULTS.md``
=========  ===========  ==========================================================

One module per hook, with the private names it uses and where it ran beyond 2.13.0 (CPU):

* ``caches``: routing Inductor's remote caches (``routed_remote_caches``):
  ``remote_cache.Remote*Cache.backend_override_cls``, the ``*_remote_cache`` switches,
  ``bundle_triton_into_fx_graph_cache``, ``AOTAutogradCache.get_remote_cache``; keeping
  compile workers' jobs off Redis (``compile_workers``); compile-start and compile-end
  callbacks (``callback_handler``'s ``register_start_callback``/``start_callbacks``, which
  start a session's compile part inside Dynamo's first compile: ran on 2.13.0 and 2.14.1,
  CPU tests); cache dirs (``inductor_cache_dir`` names the dir as
  ``cache_dir_utils.cache_dir``/``default_cache_dir`` do, without importing Inductor:
  compared with torch's own on both CI legs, ``tests/test_first_compile.py``); whether
  AOTAutograd entries hold their graphs (``autograd_cache.should_bundle_autograd_cache``),
  and so whether a hit of one saves its recorded compile time (``hit_saves_compile``:
  AOTAutograd's ``time_taken_ms`` spans from its lookup to the end of its compiles, read
  from 2.13.0's ``graph_compile``); Mega-Cache installs and the FX keys they write
  (``load_cache_artifacts``: ``CacheInfo.inductor_artifacts``, 2.13.0). GPU tier on 2.11.0.
* ``fx_graph``: FX-graph lookups (``fx_graph_lookups``): ``FxGraphCache._lookup_graph``,
  ``_write_to_local_cache``, ``_get_tmp_dir_for_key``, ``codecache._worker_compile_cpp``,
  ``RedisRemoteCache._get_key`` and the FX remote value format of ``_save_graph``
  (``{"data": <base64>, ...}``); the compile time a hit's entry records
  (``CompiledFxGraph._time_taken_ns``, the one Inductor's own ``time_saved_ns`` reads).
  2.11.0 does not keep remote hits in its local cache itself;
  keeping them ran in the GPU tier on 2.11.0. Whether a lookup loads an AOTAutograd entry's
  graph (``in_aot_entry_load``): ``_lookup_graph``'s ``evaluate_guards``, which only
  ``FxGraphCacheLoadable.load`` passes (2.13.0; without the parameter, never). Entries that
  bundle only the Triton kernels their code launches (``bundles_of_final_kernels``): ``FxGraphCache._save_graph``,
  ``CompiledFxGraph._triton_bundle``/``source_code``, ``TritonBundle.kernel_artifacts``
  (a dataclass), ``TritonKernelArtifact.filename``. The C++ kernels a graph resolves
  (``cpu_kernels_resolved``): ``CppCodeCache.load_async``, ``codecache.write`` and its
  ``main.cpp`` naming; read from 2.11.0's and 2.14.1's sources, ran on 2.13.0 and 2.14.1
  (CPU tests). 2.13 already drops the losing configs
  of kernels it tuned (``TritonBundler.put_winner``), not untuned template choices. Ran in
  the GPU tier and the max-autotune benchmark on 2.11.0.
* ``versions``: the one torch version helper (``torch_version``, ``torch_before``) and
  the one support table (``CHECKED_ON``: feature -> the versions it was checked on; ``FIXED_IN``:
  the torch bugs worked around, with the version that fixed each).
* ``triton_tuning``: the patches around a kernel's first-launch tuning, calling back the
  autotune-hold protocol's tuner (``triton_tuning_hooks``, ``route_autotune_cache``,
  ``share_config_kept_from_cache``):
  ``CachingAutotuner.autotune_to_one_config``, ``coordinate_descent_tuning``,
  ``recheck_autotune_cache``, ``restore_after_unpickle``, ``precompile``, ``save_cache_hook``,
  ``configs``/``compile_results``, ``filename``, ``inductor_meta``, ``triton_meta["device"]``;
  ``AutotuneCache._prepare_key``, ``_setup_remote_autotune_cache``, ``remote_cache``,
  ``configs_hash``, ``_read``, ``read_best``; ``hash_configs``, ``check_autotune_cache``. Read
  from 2.11.0's source too; the ``read_best``/``recheck_autotune_cache`` backports
  (pytorch#172819) apply before 2.12. GPU tier on 2.11.0 (all four cases). 2.14 adds
  ``CachingAutotuner._could_rblock_scale``, read by ``recheck_autotune_cache``.
* ``guards``: reads of the rank (``rank_reads``: ``torch.distributed.get_rank``,
  ``ProcessGroup.rank``; the reads of ``fx_passes/bucketing.py``, ``decomp_comms``,
  ``ddp_fusion``, ``select_algorithm``, ``_logging/_internal.py``, whose log formatter
  reads the rank for each record, found by the GPU tier's max-autotune case on 2.11.0, and
  ``_dynamo/repro/after_aot.py``, whose repro script of each graph records ranks) and
  in-compile collectives (``collective_switches_off``: ``distributed_max_autotune_gemm``,
  ``distributed_runtime_autotune``, ``aten_distributed_optimizations.spmd_check``).
* ``imports``: hooks on modules a job may never import, run once they are (``AfterImport``,
  ``once_imported``): Python's import system, no torch name.
* ``select_algorithm``: each GEMM choice compiled once (``precompile_choices_in_process``,
  patched once Inductor imports ``select_algorithm``:
  ``AlgorithmSelectorCache.make_precompile_fn``, ``AsyncCompile.use_process_pool``, a
  classmethod, asked inside it; ran on 2.11.0 on an H100: the recompile probe and the
  max-autotune benchmark).
* ``backward``: AOTAutograd's deferred backward compiles, run early by a rank that
  waits (``deferred_backwards``): ``graph_compile._aot_stage2b_bw_compile``, the fields of
  ``AutogradLazyBackwardCompileInfo``, ``TracingContext.fw_metadata``/``output_strides``,
  ``logging_utils.graph_being_compiled``. Read from 2.11.0's, 2.13.0's and 2.14.1's
  sources; ran on 2.13.0 and 2.14.1 (CPU tests) and on 2.11.0 on an H100 (the max-autotune
  benchmark, the GPU tier). ``is_restart``: ``torch._dynamo.exc.RestartAnalysis`` (AOTAutograd
  raises its subclass ``TensorifyScalarRestartAnalysis``); ran on 2.13.0 and 2.14.1.
* ``split_graphs`` (with ``fake_outputs``, which describes and rebuilds fake tensors):
  AOTAutograd's cache for DDPOptimizer's split graphs (``cached_split_graphs``;
  ``SPLIT_GRAPH_VERSIONS``, ``CHECKED_ON["split_graphs"]``, lists where it is on):
  ``autograd_cache.check_cacheable``, ``AOTAutogradCache.save``, ``FXGraphCacheMiss``,
  ``FakifiedOutWrapper``, ``GenericAOTAutogradResult.wrap_post_compile``,
  ``CompiledFxGraph.output_strides``, ``TracingContext.fakify_first_call``/``fw_metadata``/
  ``ddp_optimizer_ctx``, ``ShapeEnv.deserialize_symexpr``. Read from the sources of
  2.11.0, 2.13.0 and 2.14.1; the tests (``tests/test_split_graphs.py``) ran on all three
  on CPU; on 2.11.0 on an H100 (the restart benchmark, the GPU tier).
* ``split_frames``: DDPOptimizer's split frames, their submodules compiled out of order
  (``split_frames``, ``SplitFrame``, ``chain_position``, ``capture_backward``):
  ``SubmodCompiler.run``/``compile_submod``, ``deepcopy_to_fake_tensor``, a copied
  ``TracingContext``, ``graph_compile._cache_autograd_info``; the module's docstring lists
  each, and the shape environment's put-back. Read from the sources of 2.11.0, 2.13.0 and
  2.14.1; the tests (``tests/test_split_shares.py``) ran on 2.13.0 and 2.14.1 on CPU (both CI
  legs), on 2.11.0 on CPU before the put-back (its own test ran there too); on 2.11.0 on 4
  H100s over NCCL (the N=4 cold-start benchmark). The caches the put-back keeps aside ran on
  2.11.0 on 2 H200s (the split-cold benchmark); its replacement counter moving on
  (``_replacements_version_counter``, in the sources of 2.13.0 and 2.14.1) ran on 2.13.0 and
  2.14.1 only (its test, both CI legs). ``SplitFrame.has_symbolic_floats`` reads each
  submodule node's ``meta["val"]``/``["example_value"]``; ran on 2.13.0 and 2.14.1
  (``tests/test_models.py``, Llama dynamic on 3 ranks), not yet on 2.11.0.
* ``precompile``: Dynamo's precompiled functions (``precompiled_functions``,
  ``complete_package``; ``PRECOMPILE_VERSIONS``, ``CHECKED_ON["precompile"]``, lists where it is
  offered):
  ``torch._dynamo.config.caching_precompile``, ``DynamoCache.load``/``record_package``,
  ``CompilePackage`` (``install``, ``uninstall``, ``cache_entry``, ``source_id_from_fn``,
  ``add_import_source``, ``_codes``, ``_innermost_fn``, ``_current_entry``),
  ``PrecompileCacheEntry``, ``PrecompileContext``, ``package.load_guards_state``,
  ``bytecode_transformation._unique_id_counter``, ``guards.GuardsStatePickler``
  (``reducer_override`` and two unpicklers), ``guards.CheckFunctionManager``,
  ``OutputGraph.install_global_unsafe``, FSDP2's class map and ``FSDPModule.__new__`` (the
  module's docstring lists each). Read from the sources of 2.11.0, 2.13.0 and 2.14.1; the
  tests (``tests/test_precompiled.py``, with ``tests/precompile_mends.py``) ran on 2.13.0 and
  2.14.1 on CPU; on 2.11.0 on an H200 (the restart benchmark, HF Llama).
* ``counters``: for the tests and benchmarks only (``coordinator.testing``; ran on 2.13.0 and
  2.14.1 in the CPU suite, on 2.11.0 in the GPU tier on an H100 and an H200): cubins Triton
  compiles (``FileCacheManager.put``) and Inductor's counters (``torch._dynamo.utils.counters``).
* ``structured_trace``: the coordinator's events in torch's structured trace, for tlparse
  (``emit_structured``, ``structured_trace_on``, ``current_compile_id``):
  ``torch._logging.trace_structured`` (``chromium_event`` and ``artifact`` records),
  ``_logging._internal.trace_log``, ``CompileContext.current_compile_id``. Ran on 2.13.0 and
  2.14.1 (CPU tests, with tlparse 0.4.3); ``current_compile_id`` and ``trace_log`` also on
  2.11.0 on an H200 (a traced job without ``TORCH_TRACE``).
* ``triton_driver``: Triton's CUDA driver utilities built in the background when a session
  starts (``warm_driver_utilities``): ``triton.backends.nvidia.driver.CudaUtils``. Triton 3.6
  with 2.11.0 on an H100 (the restart benchmark); read from Triton 3.8's source (2.14.1).
* ``triton_cache``: Triton's own cache outside Inductor (``coordinator.features.triton_kernels``):
  ``knobs.cache.manager_class`` (set to a class for the session), ``FileCacheManager``'s
  ``get_group``/``put_group``/``get_file``/``put`` as ``triton.compile``,
  ``compile_module_from_src`` and ``Autotuner.check_disk_cache`` call them; ``Autotuner.run``,
  ``check_disk_cache``, ``cache_results``, ``base_fn``, ``fn``; ``JITFunction.run(warmup=True)``;
  ``runtime._async_compile.AsyncCompileMode``. Not torch's: Triton's, read from 3.6.0's and
  3.8.0's sources; ran on 3.8.0 (torch 2.14.1's build, CPU tests: real ``sm_90`` compiles,
  a driver that launches nothing) and 3.6.0 (torch 2.11, one H200: flash-linear-attention
  and liger-kernel). Off where Triton lacks any of them (``triton_cache_unsupported``).
* ``cpu_isa``: the libraries Inductor's probes of the CPU's vector instructions leave in the
  cache dir, which travel with CPU FX entries (``isa_probe_libraries``:
  ``cpu_vec_isa.valid_vec_isa_list``, ``VecISA._avx_code``, ``_get_isa_dry_compile_fingerprint``,
  ``codecache.get_hash``, ``get_path``). Read from the sources of 2.11.0, 2.13.0 and 2.14.1; ran
  on 2.13.0 and 2.14.1.
* ``compile_workers``: Inductor's compile workers: every Triton compile job kept off Inductor's
  Redis while autotune caches are routed, in a pool started before the session or after
  (``compile_jobs_without_redis``: ``SubprocPool.submit``, ``TrackedProcessPoolExecutor.submit``,
  ``_worker_compile_triton``'s ``extra_env``); a rank's part of the host's cores as its
  ``compile_threads`` (``size_compile_pool``: ``config.compile_threads``,
  ``AsyncCompile.process_pool``'s cache); the pool started when a session's compile part starts, on a GPU
  (``warm_compile_pool``: ``async_compile.maybe_warm_pool``); the pool held back, with
  ``compile_threads`` at 1, until a restart's first miss (``hold_compile_pool``:
  ``get_compile_threads``' readers). Read from the sources of 2.11.0,
  2.13.0 and 2.14.1; the jobs' environment ran on 2.13.0 and 2.14.1 (CPU tests, Inductor's
  own pool); all three on 2.11.0 (H200s).
* ``compile_context``: what this thread compiles, in words (``compiling_now``: the graph,
  its frame's function, the split frame's part, Dynamo's compile id), for the claims a
  waiting rank names: ``CompileContext.current_compile_id``, ``TracingContext.traced_code``,
  ``logging_utils.graph_being_compiled``. Read from 2.13.0's source; ran on 2.13.0 (CPU tests).
* ``inductor_setup``: Inductor's one-time set-up ahead of a process's first compile
  (``set_up_inductor``: ``compile_fx`` imported, ``codecache.torch_key``, Triton codegen's
  modules on a GPU). Read from 2.13.0's source; ran on 2.13.0 and 2.14.1 (CPU tests).
* ``distributed``: NCCL timeouts (``extend_nccl_timeouts``, ``has_nccl_process_group``) and
  the default store (``default_c10d_store``). 2.11.0 on GPUs.
"""

from coordinator._compat.backward import DeferredBackward, SkipCompile, deferred_backwards, is_restart, is_skip
from coordinator._compat.caches import (
    CACHE_KINDS,
    KINDS,
    CacheKind,
    WaitRule,
    default_cache_dir,
    hit_saves_compile,
    inductor_cache_dir,
    load_cache_artifacts,
    on_compile_end,
    on_compile_start,
    process_compile_seconds,
    remote_cache_backend_base,
    routable_kinds,
    routed_remote_caches,
    ships_kernels,
)
from coordinator._compat.compile_context import compiling_now
from coordinator._compat.compile_workers import (
    NO_REDIS_URL,
    compile_jobs_without_redis,
    compile_pool_size,
    hold_compile_pool,
    host_cpus,
    pool_started,
    size_compile_pool,
    warm_compile_pool,
)
from coordinator._compat.counters import count_triton_compiles, frames_traced, inductor_counters
from coordinator._compat.cpu_isa import isa_probe_libraries
from coordinator._compat.distributed import default_c10d_store, extend_nccl_timeouts, has_nccl_process_group
from coordinator._compat.fx_graph import (
    bundles_of_final_kernels,
    cpu_kernels_resolved,
    fx_graph_lookups,
    fx_graph_remote_value,
    in_aot_entry_load,
)
from coordinator._compat.guards import (
    COLLECTIVE_SWITCHES,
    RANK_READS_FOR_LOGGING,
    RANK_READS_IGNORED_MODULES,
    collective_switches_off,
    rank_reads,
)
from coordinator._compat.inductor_setup import set_up as set_up_inductor
from coordinator._compat.precompile import (
    PRECOMPILE_VERSIONS,
    complete_package,
    precompile_unsupported,
    precompiled_functions,
)
from coordinator._compat.select_algorithm import device_name, precompile_choices_in_process
from coordinator._compat.split_frames import (
    SplitFrame,
    capture_backward,
    chain_position,
    compile_settings_digest,
    split_frames,
)
from coordinator._compat.split_graphs import (
    SPLIT_GRAPH_VERSIONS,
    aot_autograd_cache_hits,
    cached_split_graphs,
    split_graphs_unsupported,
)
from coordinator._compat.structured_trace import current_compile_id, emit_structured, structured_trace_on
from coordinator._compat.triton_cache import (
    AUTOTUNE_SUFFIX,
    HOST_MODULE_SUFFIX,
    autotuner_hooks,
    compile_configs,
    compile_scopes,
    device_kind,
    file_cache_manager,
    install_group,
    installed_module,
    loader_files,
    routed_triton_cache,
    triton_cache_unsupported,
    triton_home_cache_dir,
    tuning_now,
    users_cache_manager,
    users_manager_class,
)
from coordinator._compat.triton_driver import warm_driver_utilities
from coordinator._compat.triton_tuning import (
    TunedKernel,
    adopt_config,
    defer_autotune_save,
    kernel_autotune_cache,
    route_autotune_cache,
    share_config_kept_from_cache,
    triton_cache_dir,
    triton_tuning_hooks,
)
from coordinator._compat.versions import CHECKED_ON, FIXED_IN, torch_before, torch_version

__all__ = [
    "AUTOTUNE_SUFFIX",
    "HOST_MODULE_SUFFIX",
    "autotuner_hooks",
    "compile_configs",
    "compile_scopes",
    "device_kind",
    "file_cache_manager",
    "compile_settings_digest",
    "install_group",
    "installed_module",
    "loader_files",
    "routed_triton_cache",
    "triton_cache_unsupported",
    "triton_home_cache_dir",
    "tuning_now",
    "users_cache_manager",
    "users_manager_class",
    "CHECKED_ON",
    "COLLECTIVE_SWITCHES",
    "DeferredBackward",
    "FIXED_IN",
    "CACHE_KINDS",
    "KINDS",
    "CacheKind",
    "NO_REDIS_URL",
    "PRECOMPILE_VERSIONS",
    "RANK_READS_FOR_LOGGING",
    "RANK_READS_IGNORED_MODULES",
    "SPLIT_GRAPH_VERSIONS",
    "SkipCompile",
    "SplitFrame",
    "TunedKernel",
    "WaitRule",
    "adopt_config",
    "aot_autograd_cache_hits",
    "bundles_of_final_kernels",
    "cached_split_graphs",
    "capture_backward",
    "chain_position",
    "collective_switches_off",
    "complete_package",
    "compile_jobs_without_redis",
    "hold_compile_pool",
    "isa_probe_libraries",
    "compile_pool_size",
    "host_cpus",
    "compiling_now",
    "count_triton_compiles",
    "cpu_kernels_resolved",
    "current_compile_id",
    "default_c10d_store",
    "default_cache_dir",
    "deferred_backwards",
    "device_name",
    "emit_structured",
    "defer_autotune_save",
    "extend_nccl_timeouts",
    "frames_traced",
    "fx_graph_lookups",
    "in_aot_entry_load",
    "fx_graph_remote_value",
    "has_nccl_process_group",
    "hit_saves_compile",
    "inductor_cache_dir",
    "inductor_counters",
    "is_restart",
    "is_skip",
    "kernel_autotune_cache",
    "load_cache_artifacts",
    "on_compile_end",
    "on_compile_start",
    "pool_started",
    "precompile_unsupported",
    "precompiled_functions",
    "process_compile_seconds",
    "precompile_choices_in_process",
    "rank_reads",
    "remote_cache_backend_base",
    "routable_kinds",
    "route_autotune_cache",
    "routed_remote_caches",
    "share_config_kept_from_cache",
    "set_up_inductor",
    "size_compile_pool",
    "ships_kernels",
    "split_frames",
    "split_graphs_unsupported",
    "structured_trace_on",
    "torch_before",
    "torch_version",
    "triton_cache_dir",
    "triton_tuning_hooks",
    "warm_compile_pool",
    "warm_driver_utilities",
]

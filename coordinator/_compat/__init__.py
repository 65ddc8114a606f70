"""Every use of a torch- or Triton-private API in the coordinator lives in this package.

Inductor exposes what we need only through private names. Keeping them here means one place
to check when torch moves; the rest of the library imports only the names re-exported below.

Torch versions, where each ran:

=========  ===========  ==========================================================
torch      where        notes
=========  ===========  ==========================================================
2.13.0     CPU (x86)    dev and CI machines; the full test suite; every hook below
                        read from its source
2.14.1     CPU (x86)    a CUDA build run on the CPU; CI's second leg (all but the protocol's)
2.11.0     H200, H100   device machines; the GPU tier (``tests/gpu``) and the GPU
                        benchmarks of ``benchmarks/RESULTS.md``
=========  ===========  ==========================================================

One module per hook. Each module's docstring names the private names it uses and the
torch (or Triton) versions, and machines, it was read from and ran on beyond the table's
first row. ``versions.CHECKED_ON`` is the one support
table: it gates the features that stand in for torch's own work (``versions.unchecked``:
DDPOptimizer's split graphs, Dynamo's precompiled functions), and ``versions.FIXED_IN``
names the torch bugs worked around, with the version that fixed each.
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

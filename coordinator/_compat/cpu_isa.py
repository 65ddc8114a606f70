"""Inductor's probes of the CPU's vector instructions: the libraries they leave.

Before a process's Inductor generates or loads its first C++ kernel, it checks each vector
instruction set the CPU reports (``cpu_vec_isa.valid_vec_isa_list``: AVX2, AVX-512 and its
extensions on x86) by building a tiny library with that set's flags and loading it in a
child process; AVX-512 and AMX build more probes for the extensions they check (BF16,
VNNI, FP16), each with its own source and flags. A library is written to
``<cache dir>/<2 chars>/<key>.so``, its key a hash of the probe's source and of the
compiler's version, the flags and torch's version (``_get_isa_dry_compile_fingerprint``);
a later process skips the build where the file exists, and only the child's load runs. On
an empty cache dir each probe costs a g++ run (about 5 s on 2 cores).
:func:`isa_probe_libraries` names the libraries this process's probes left; they travel
with each CPU FX entry (``ShippedKernels.built_for``). A receiver whose compiler, flags or
torch differ looks for another key, and builds its own.

Private names: ``cpu_vec_isa.valid_vec_isa_list`` (its ``functools.cache``: whether this
process probed), ``supported_vec_isa_list``, the probes' sources (``VecISA._avx_code``,
``VecAVX512._avx512_bf16_code``, ``VecAVX512VNNI._avx512_vnni_code``, ``VecAMX._amx_code``,
``_amx_fp16_code``) and the flags their checks add, ``build_arch_flags`` (``_arch_flags`` before it),
``_get_isa_dry_compile_fingerprint``; ``codecache.get_hash`` and ``get_path`` (the key and
path ``codecache.write`` gives the probe's source; the library lies beside it). The base
probe read from the sources of 2.11.0, 2.13.0 and 2.14.1, the extensions' probes from
2.13.0's and 2.14.1's; ran on 2.13.0 and 2.14.1 (CPU tests, an AVX-512 CPU with BF16, VNNI
and AMX).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


#: The sources the probes build, by their names on the vector-ISA classes: every set's
#: base probe, and the extra probes of AVX-512 (BF16, VNNI) and AMX (BF16, FP16).
_PROBE_SOURCES = ("_avx_code", "_avx512_bf16_code", "_avx512_vnni_code", "_amx_code", "_amx_fp16_code")
#: Flags a probe adds to its set's own for an extension it checks (``VecAVX512.__bool__``,
#: ``VecAMX.__bool__``).
_PROBE_EXTRA_FLAGS = ("", " -mavx512bf16", " -mamx-fp16")


def isa_probe_libraries() -> list[str]:
    """The paths of the probe libraries this process's Inductor built or found for the
    vector instruction sets the CPU reports, usable or not (a set the build refuses is
    probed again wherever its library is missing); none before it probed."""
    try:
        from torch._inductor import codecache, cpu_vec_isa

        if cpu_vec_isa.valid_vec_isa_list.cache_info().currsize == 0:
            return []  # not probed in this process: asking now would run the probes
        paths: dict[str, None] = {}
        for isa in getattr(cpu_vec_isa, "supported_vec_isa_list", cpu_vec_isa.valid_vec_isa_list()):
            base = isa._arch_flags
            built = isa.build_arch_flags() if hasattr(isa, "build_arch_flags") else base
            sources = {getattr(type(isa), name) for name in _PROBE_SOURCES if hasattr(type(isa), name)}
            for flags in {built, *(base + extra for extra in _PROBE_EXTRA_FLAGS)}:
                extra = cpu_vec_isa._get_isa_dry_compile_fingerprint(flags)
                for code in sources:
                    key = codecache.get_hash(code.strip(), extra, "code")
                    _, _, source = codecache.get_path(key, "cpp")
                    path = os.path.join(os.path.dirname(source), key + ".so")
                    if os.path.exists(path):
                        paths.setdefault(path)
        return list(paths)
    except Exception as exc:  # another layout: the probes run again where an entry lands
        log.debug("could not name the CPU probe libraries: %s", exc)
        return []

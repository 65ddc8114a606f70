"""Inductor's probes of the CPU's vector instructions: the libraries they leave.

Before a process's Inductor generates or loads its first C++ kernel, it checks each vector
instruction set the CPU reports (``cpu_vec_isa.valid_vec_isa_list``: AVX2, AVX-512 and its
extensions on x86) by building a tiny library with that set's flags and loading it in a
child process. The library is written to ``<cache dir>/<2 chars>/<key>.so``, its key a hash
of the probe's source and of the compiler's version, the set's flags and torch's version
(``_get_isa_dry_compile_fingerprint``); a later process skips the build where the file
exists, and only the child's load runs. On an empty cache dir each set costs a g++ run
(about 5 s on 2 cores). :func:`isa_probe_libraries` names the libraries of the sets this
process probed; they travel with each CPU FX entry (``ShippedKernels.built_for``). A
receiver whose compiler, flags or torch differ looks for another key, and builds its own.

Private names: ``cpu_vec_isa.valid_vec_isa_list`` (its ``functools.cache``: whether this
process probed), ``VecISA._avx_code``, ``build_arch_flags`` (``_arch_flags`` before it),
``_get_isa_dry_compile_fingerprint``; ``codecache.get_hash`` and ``get_path`` (the key and
path ``codecache.write`` gives the probe's source; the library lies beside it). Read from
the sources of 2.11.0, 2.13.0 and 2.14.1; ran on 2.13.0 and 2.14.1 (CPU tests).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def isa_probe_libraries() -> list[str]:
    """The paths of the probe libraries of the vector instruction sets this process's
    Inductor found usable; none before it probed."""
    try:
        from torch._inductor import codecache, cpu_vec_isa

        if cpu_vec_isa.valid_vec_isa_list.cache_info().currsize == 0:
            return []  # not probed in this process: asking now would run the probes
        paths = []
        for isa in cpu_vec_isa.valid_vec_isa_list():
            flags = isa.build_arch_flags() if hasattr(isa, "build_arch_flags") else isa._arch_flags
            extra = cpu_vec_isa._get_isa_dry_compile_fingerprint(flags)
            key = codecache.get_hash(cpu_vec_isa.VecISA._avx_code.strip(), extra, "code")
            _, _, source = codecache.get_path(key, "cpp")
            paths.append(os.path.join(os.path.dirname(source), key + ".so"))
        return paths
    except Exception as exc:  # another layout: the probes run again where an entry lands
        log.debug("could not name the CPU probe libraries: %s", exc)
        return []

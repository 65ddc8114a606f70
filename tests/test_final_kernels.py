"""FX entries bundle only the Triton kernels their code launches
(``_compat.fx_graph._final_kernel_artifacts``), on Inductor's own bundle types."""

from __future__ import annotations

from torch._inductor.triton_bundler import TritonBundle, TritonKernelArtifact, TritonKernelArtifacts

from coordinator._compat.fx_graph import _final_kernel_artifacts

SOURCE = """
triton_poi_fused_gelu_0 = async_compile.triton('triton_poi_fused_gelu_0', '''
...
''', device_str='cuda')
triton_tem_fused_mm_1 = async_compile.triton('triton_tem_fused_mm_1', '''...''')
"""


def kernel(kernel_hash: str, name: str, binary: str = ".cubin") -> TritonKernelArtifacts:
    files = [f"{name}{binary}", f"{name}.json", f"{name}.ptx", f"__grp__{name}.json"]
    return TritonKernelArtifacts(kernel_hash, 0, [TritonKernelArtifact(f, b"x" * 10) for f in files])


def test_only_the_kernels_the_code_launches_are_kept_with_all_their_configs():
    final = [kernel("a1", "triton_poi_fused_gelu_0"), kernel("a2", "triton_poi_fused_gelu_0"),
             kernel("b", "triton_tem_fused_mm_1")]
    losers = [kernel(f"l{i}", "triton_mm") for i in range(5)]
    bundle = TritonBundle(final[:2] + losers + final[2:], [])
    kept = _final_kernel_artifacts(bundle, SOURCE)
    assert [k.kernel_hash for k in kept] == ["a1", "a2", "b"]


def test_a_bundle_with_nothing_to_drop_or_no_source_is_left_alone():
    bundle = TritonBundle([kernel("a", "triton_poi_fused_gelu_0")], [])
    assert _final_kernel_artifacts(bundle, SOURCE) is None
    assert _final_kernel_artifacts(TritonBundle([kernel("l", "triton_mm")], []), None) is None
    assert _final_kernel_artifacts(None, SOURCE) is None
    # A kernel without a binary among its files is kept: its name is unknown.
    odd = TritonKernelArtifacts("o", 0, [TritonKernelArtifact("something.bin", b"")])
    kept = _final_kernel_artifacts(TritonBundle([odd, kernel("l", "triton_mm")], []), SOURCE)
    assert [k.kernel_hash for k in kept] == ["o"]

"""World size 1's cluster layout sums a row's squares over the cluster without a GPU-wide fence.

A cluster-wide release barrier compiles to MEMBAR.ALL.GPU, which waits for the block's global stores
(residual_out) before the sum can go on; the layout sends its warp sums with st.async on mbarriers
instead (kernels/block_sum.cuh). Compiled with NVRTC for sm_90a, read with nvdisasm: no GPU needed.
"""
import re

import pytest

from dispatch import registry, shape_constants


def _functions(name: str, prefix: str, target: str) -> dict:
    """The SASS text of each function of a program, by symbol."""
    pytest.importorskip("cupy")
    from moe_ar_common import cuda_env
    from moe_ar_tools import sass_diff
    try:
        cuda_env.load_nvrtc()
        tools = sass_diff.find_tools()
    except Exception as e:  # noqa: BLE001 - NVRTC, cuobjdump and nvdisasm come with the test extra
        pytest.skip(str(e))
    ps = registry.program_set()
    cubin, _ = registry.compile_cubin(prefix + registry._manifest.source_for(ps.manifest, ps.dir, name), name, target)
    parts = re.split(r"\n\s*Function : ", sass_diff.disassemble(cubin, tools))[1:]
    return {p.split()[0]: p for p in parts}


@pytest.mark.parametrize("profile", ["plain", "nvfp4", "fp8_group128", "fp8_tensor"])
@pytest.mark.parametrize("build", [False, True])
def test_the_cluster_sum_waits_for_no_global_store(profile, build):
    name = f"moe_ar_local_bf16_ws1_{profile}"
    entry = registry.program_set().by_name[name]
    prefix = shape_constants.defines(7168, 8, 1, 2, 448) if build else ""
    sass = _functions(name, prefix, "sm_90a")
    cluster = sass[entry["cluster_symbol"]]
    assert "MEMBAR" not in cluster, "the cluster entry fences global memory"
    assert "STAS" in cluster and "SYNCS.PHASECHK" in cluster  # st.async sends, an mbarrier wait
    assert "UCGABAR_ARV" in cluster  # the start barrier: every block's mbarrier initialized

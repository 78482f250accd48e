"""Every generated program compiles with NVRTC for every target, spills within the budget.

No GPU needed (CuPy's low-level NVRTC bindings only load libnvrtc). Slow: runs
`gen-programs compile` on the committed generated/ tree, all cores.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from generator import nvrtc_build

ROOT = pathlib.Path(__file__).resolve().parent.parent

LOG = """ptxas info    : 20 bytes gmem
ptxas info    : Compiling entry function 'moe_ar_twoshot_bf16_ws4_plain' for 'sm_90a'
ptxas info    : Function properties for moe_ar_twoshot_bf16_ws4_plain
ptxas         .     88 bytes stack frame, 84 bytes spill stores, 96 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 88 bytes cumulative stack size, 132 bytes smem
ptxas info    : Compile time = 412.897 ms
ptxas info    : Function properties for _ZN6moe_ar14record_timeoutEPjii
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
"""


def test_ptxas_log_parsing():
    (entry,) = nvrtc_build.parse_ptxas_log(LOG)
    assert entry == nvrtc_build.EntryStats("moe_ar_twoshot_bf16_ws4_plain", 64, 88, 84, 96)
    result = nvrtc_build.CompileResult("moe_ar_twoshot_bf16_ws4_plain", "sm_90a", True, LOG, 0.4, 1000, (entry,))
    assert any("spills 84 bytes" in p for p in nvrtc_build.problems(result, "moe_ar_twoshot_bf16_ws4_plain"))
    assert any("not an entry function" in p for p in nvrtc_build.problems(result, "other_symbol"))
    small = nvrtc_build.CompileResult("k", "sm_90a", True, LOG, 0.4, 1000,
                                      (nvrtc_build.EntryStats("moe_ar_twoshot_bf16_ws4_plain", 64, 8, 8, 16),))
    assert nvrtc_build.problems(small, "moe_ar_twoshot_bf16_ws4_plain") == []
    assert any("within the" in w for w in nvrtc_build.warnings(small))
    # a program under a register cap has the wider budget: 84 bytes pass there, 300 do not
    capped = nvrtc_build.spill_budget(72)
    assert nvrtc_build.problems(result, "moe_ar_twoshot_bf16_ws4_plain", capped) == []
    big = nvrtc_build.CompileResult("k", "sm_90a", True, LOG, 0.4, 1000,
                                    (nvrtc_build.EntryStats("moe_ar_twoshot_bf16_ws4_plain", 72, 300, 300, 300),))
    assert any("over the 256-byte budget" in p for p in nvrtc_build.problems(big, "moe_ar_twoshot_bf16_ws4_plain", capped))


@pytest.mark.compile
def test_every_program_compiles_for_every_target():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "generator.cli", "compile"], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    print(r.stdout)
    assert r.returncode == 0, r.stdout[-6000:] + "\n" + r.stderr[-20000:]
    assert "sm_90a" in r.stdout and "sm_100a" in r.stdout

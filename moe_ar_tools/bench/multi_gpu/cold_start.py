"""Cold start: the seconds to get one program ready at its first use, compiled into an empty cache
and loaded from the warm one, each in a fresh process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from moe_ar_tools.provenance import REPO_ROOT


_COLD_START_SNIPPET = """
import json, sys, time
t0 = time.perf_counter()
import torch, dispatch
torch.cuda.init()
t1 = time.perf_counter()
info = dispatch.warmup([sys.argv[1]], device_index=0)
print("RESULT " + json.dumps({"import_s": t1 - t0, "warmup": info}))
"""


def measure_cold_start(program: str) -> dict:
    """Seconds to get `program` ready at first use: compiled with NVRTC into an empty temporary
    MOE_AR_CACHE_DIR (fresh process), then loaded from that warm cache (another fresh process)."""
    out = {"program": program}
    with tempfile.TemporaryDirectory(prefix="moe_ar_cold_") as cache:
        env = dict(os.environ, MOE_AR_CACHE_DIR=cache,
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
        for phase in ("cold", "warm"):
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-c", _COLD_START_SNIPPET, program], env=env,
                                  cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
            wall = time.perf_counter() - t0
            line = next((text for text in proc.stdout.splitlines() if text.startswith("RESULT ")), None)
            if proc.returncode != 0 or line is None:
                out[phase] = {"error": (proc.stderr or proc.stdout)[-2000:], "process_s": wall}
                continue
            got = json.loads(line[len("RESULT "):])
            info = got["warmup"][0]
            out[phase] = {"source": info.get("source"), "seconds": info.get("seconds"),
                          "total_seconds": info.get("total_seconds"), "import_s": got["import_s"],
                          "process_s": wall}
    return out

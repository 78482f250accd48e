"""The soak's result: the machine it ran on, the JSON written, and its one-line summary."""
from __future__ import annotations

import json
import pathlib
import platform
import socket

import torch


def machine_info() -> dict:
    info = {"hostname": socket.gethostname(), "python": platform.python_version(), "torch": torch.__version__}
    try:
        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            info.update(gpu=torch.cuda.get_device_name(0), gpus=n,
                        gpu_names=[torch.cuda.get_device_name(i) for i in range(n)], cuda=torch.version.cuda)
        else:
            info.update(gpu=None, gpus=0)
    except Exception as e:  # noqa: BLE001 - the record must not break the run
        info["gpu_error"] = str(e)
    return info


def write_result(result: dict, out) -> None:
    text = json.dumps(result, indent=1, sort_keys=True, default=str)
    if out:
        path = pathlib.Path(out)
        if path.parent and not path.parent.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    else:
        print(text)


def summary_line(r: dict) -> str:
    """One line of the result r."""
    return (f"soak ws{r['world_size']} {r['dtype']} devices={r['devices']}: {r['calls']} calls "
            f"({r['eager_calls']} eager, {r['graph_calls']} graph, {r['pdl_calls']} PDL) in {r['seconds']:.1f} s, "
            f"regimes {r['regimes']}, wrong elements {r['wrong_elements']}, full checks {r['full_checks']} "
            f"({r['full_check_failures']} failed), timeouts {r['timeouts']}, hangs {r['hangs']}: "
            f"{'PASS' if r['passed'] else 'FAIL'}")

"""Where a result came from: the repository root and the commit, shared by the bench and the soak."""
from __future__ import annotations

import os
import pathlib
import subprocess

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def git_commit() -> str:
    """MOE_AR_COMMIT when set (the device machine's copy may carry a stale .git), else git's HEAD,
    else "unknown"."""
    if os.environ.get("MOE_AR_COMMIT"):
        return os.environ["MOE_AR_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"

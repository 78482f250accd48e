"""Emulated worlds kept alive across consecutive GPU tests, and a result record around a test's body.
Shared by the GPU test modules (the `worlds` and `full_checks` fixtures are in conftest.py)."""
from __future__ import annotations

import contextlib
import time

import pytest

# Worlds whose tests force every program at every T keep a one-shot capacity for any T they test
# (the default is the tables' one-shot boundary, and a forced one-shot above it is refused).
FORCED_ONESHOT_CAP = 1024


class Worlds:
    """Keeps the last emulated world alive for consecutive tests with the same key."""

    def __init__(self):
        self.key = None
        self.world = None

    def get(self, ws, max_tokens, hidden, dtype, devices=None):
        key = (ws, max_tokens, hidden, dtype, tuple(devices) if devices else None)
        if key != self.key:
            import dispatch
            self.close()
            self.world = dispatch.EmulatedWorld(ws, max_tokens, hidden, dtype, devices=devices, timeout_s=10.0,
                                                oneshot_max_tokens=min(max_tokens, FORCED_ONESHOT_CAP))
            self.key = key
        return self.world

    def close(self):
        if self.world is not None:
            w, self.world, self.key = self.world, None, None
            w.close()


@contextlib.contextmanager
def recording(record_result, **fields):
    """Yields `fields` as a dict the test fills in (counts such as `cases` or `calls` start at the
    values given); when the body ends, passed or failed, one record of it through `record_result`
    with `passed`, the seconds taken and, on a failure, outcome "FAILED" and the error. A skip
    records nothing. moe_ar_tools/reliability_summary.py reads these records."""
    info = dict(fields)
    t0 = time.time()
    try:
        yield info
    except pytest.skip.Exception:
        raise
    except BaseException as e:
        record = dict(info)
        record.update(passed=False, outcome="FAILED", error=f"{type(e).__name__}: {e}"[:2000],
                      seconds=round(time.time() - t0, 2))
        record_result(**record)
        raise
    record = dict(info)
    record.update(passed=True, seconds=round(time.time() - t0, 2))
    record_result(**record)

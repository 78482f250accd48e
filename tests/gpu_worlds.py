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
    """Yields a dict of fields (with `cases`) that is recorded, with the outcome and the seconds taken,
    when the body ends; a skip records nothing."""
    info = dict(fields, cases=0)
    t0 = time.time()
    try:
        yield info
    except pytest.skip.Exception:
        raise
    except BaseException as e:
        record_result(**info, passed=False, error=str(e)[:2000], seconds=round(time.time() - t0, 2))
        raise
    record_result(**info, passed=True, seconds=round(time.time() - t0, 2))

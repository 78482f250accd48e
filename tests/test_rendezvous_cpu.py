"""The workspace rendezvous and lifetimes, on the CPU (no GPU): ranks that disagree, ranks whose local
step fails, constructor arguments, and the weak bookkeeping of live workspaces.

Multi-rank cases run in 2 or 3 spawned processes joined by torch.distributed's gloo backend over
127.0.0.1 (loopback only). Each spawned world runs many cases one after the other and writes what every
rank saw (the exception type and message, or what it returned) to rank<N>.json; a module-scoped fixture
spawns each world once and the tests below assert case by case. A world still running after its
deadline (a hang) is killed and fails the tests (tests/multiproc.py).

CUDA is replaced by fakes (fake_cuda below) where a case runs the real Workspace constructor through
allocation and CUDA IPC: the constructor's control flow (what is exchanged, what is freed, what is
raised on which rank) is what these tests check; tests/test_gpu_two_process.py runs it on two GPUs.
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import json
import math
import os
import pathlib
import socket
import time
import warnings
import weakref

import pytest
import torch

import multiproc

WORLD_DEADLINE_S = 90.0   # a spawned world still running past this is a hang
STATUS_BOUND_S = 5.0      # a rank learns of a peer's failure within this (no barrier wait)
INIT_TIMEOUT_S = 30       # gloo's own collective timeout in the children (longer than STATUS_BOUND_S)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_world(tmp_path_factory, worker: str, nprocs: int) -> dict:
    """Spawn `worker` in nprocs processes; returns {case: {rank: outcome}}. A child killed by a signal
    (gloo's C++ aborting, "terminate called without an active exception", seen once in a loaded CI
    run, never reproduced alone) gets the world spawned once more on a fresh port; a second death, a
    child that raises, or a hang fails the test."""
    import torch.multiprocessing as mp
    for attempt in (1, 2):
        out = tmp_path_factory.mktemp(worker)
        try:
            multiproc.spawn("test_rendezvous_cpu", worker, nprocs, (nprocs, _free_port(), str(out)),
                            WORLD_DEADLINE_S)
            break
        except mp.ProcessExitedException as e:
            if attempt == 2 or e.signal_name is None:
                raise
            warnings.warn(f"{worker}: a child died ({e}); the world is spawned once more")
    results = {}
    for p in sorted(out.glob("rank*.json")):
        rank = int(p.stem[4:])
        for case, outcome in json.loads(p.read_text()).items():
            results.setdefault(case, {})[rank] = outcome
    return results


# ---- child side ---------------------------------------------------------------------------------

def _init_gloo(rank, world_size, port):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # these children never use a GPU
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=INIT_TIMEOUT_S))
    return dist


def _descriptor(rank, **changes):
    from dispatch.rendezvous import RankDescriptor
    d = dict(world_size=2, program_set="a" * 64, dtype="torch.bfloat16", hidden=7168, max_tokens=512,
             oneshot_max_tokens=256, vec_per_thread=None, timeout_ns=10 * 10**9, buffer_bytes=3 * 2 * 7168 * 768 * 2,
             host="node-a boot 1111", gpu=f"GPU-uuid-{rank}")
    d.update(changes)
    return RankDescriptor(**d)


def _attempt(fn) -> dict:
    """What fn() did: {"ok": repr of the result} or {"raised": type name, "message": str, "seconds": ...}."""
    t0 = time.monotonic()
    try:
        r = fn()
    except Exception as e:
        return {"raised": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t0}
    return {"ok": repr(r), "seconds": time.monotonic() - t0}


# Rank 1 (the second argument) differs from every other rank in one field.
FIELD_CASES = {
    "dtype": ({"dtype": "torch.bfloat16"}, {"dtype": "torch.float16"}),
    "hidden": ({"hidden": 7168}, {"hidden": 4096}),
    "max_tokens": ({"max_tokens": 512}, {"max_tokens": 1024}),
    "oneshot_max_tokens": ({"oneshot_max_tokens": 256}, {"oneshot_max_tokens": 128}),
    "vec_per_thread": ({"vec_per_thread": None}, {"vec_per_thread": 2}),
    "vec_per_thread_fixed": ({"vec_per_thread": 4}, {"vec_per_thread": 2}),
    "timeout_s": ({"timeout_ns": 10 * 10**9}, {"timeout_ns": 5 * 10**9}),
    "timeout_s_disabled": ({"timeout_ns": 10 * 10**9}, {"timeout_ns": 0}),
    "buffer_bytes": ({"buffer_bytes": 1 << 30}, {"buffer_bytes": 1 << 29}),
    "program_set": ({"program_set": "a" * 64}, {"program_set": "b" * 64}),
    "world_size": ({"world_size": 2}, {"world_size": 4}),
    "host": ({"host": "node-a boot 1111"}, {"host": "node-b boot 2222"}),
    "host_boot": ({"host": "node-a boot 1111"}, {"host": "node-a boot 3333"}),
}


def _two_rank_cases(rank, group) -> dict:
    """Group ranks 0 and 1 of `group` (a two-rank group)."""
    from dispatch import rendezvous as rdv
    from dispatch import workspace as wsm
    res = {}
    res["agree"] = _attempt(lambda: [d.hidden for d in rdv.rendezvous(group, _descriptor(rank))])
    for case, (others, rank1) in FIELD_CASES.items():
        res[case] = _attempt(lambda: rdv.rendezvous(group, _descriptor(rank, **(rank1 if rank == 1 else others))))
    res["same_gpu"] = _attempt(lambda: rdv.rendezvous(group, _descriptor(rank, gpu="GPU-same")))
    # a rank whose local step failed: every rank raises, naming it
    res["local_value_error"] = _attempt(lambda: rdv.rendezvous(
        group, None if rank == 1 else _descriptor(rank),
        error=ValueError("hidden: True is a bool, expected an int") if rank == 1 else None))
    res["status_error"] = _attempt(lambda: rdv.exchange_status(
        group, "allocating the buffers", error=MemoryError("out of memory") if rank == 1 else None))
    res["status_both_fail"] = _attempt(lambda: rdv.exchange_status(
        group, "opening the peers' buffers", error=RuntimeError(f"boom on {rank}")))
    res["status_ok"] = _attempt(lambda: rdv.exchange_status(group, "a step", payload=rank * 10))
    # constructor arguments: a bad one on rank 1 only (rank 0 goes on, and cannot reach a GPU here)
    # or on every rank; every rank raises ValueError naming it, before allocating anything
    import dispatch
    live0 = len(wsm._live_workspaces)
    good = dict(max_tokens=64, hidden=2048, dtype=torch.bfloat16)
    for case, bad in ARG_CASES.items():
        name, value, where = bad
        kw = dict(good)
        if rank == 1 or where == "all":
            kw[name] = value
        args = {k: kw.pop(k) for k in ("max_tokens", "hidden", "dtype")}
        res[f"arg_{case}"] = _attempt(lambda: dispatch.Workspace(group, args["max_tokens"], args["hidden"],
                                                                  args["dtype"], **kw))
    res["live_after_args"] = {"ok": repr(len(wsm._live_workspaces) - live0)}
    res["check_after_args"] = _attempt(dispatch.check)
    # the whole constructor over fake CUDA: success, then a failure at each fallible local step
    with fake_cuda(rank) as fake:
        ws = None
        def build():
            nonlocal ws
            ws = dispatch.Workspace(group, 64, 2048, torch.bfloat16)
            return (ws.rank, ws.world_size, len(ws._opened), ws in wsm._live_workspaces)
        res["fake_build"] = _attempt(build)
        res["fake_close"] = _attempt(lambda: (ws.close(), ws in wsm._live_workspaces, fake.balance())[1:])
        for step in ("malloc_state", "hostAlloc", "ipcGetMemHandle", "ipcOpenMemHandle"):
            fake.fail_on = step if rank == 1 else None
            res[f"fake_fail_{step}"] = _attempt(lambda: dispatch.Workspace(group, 64, 2048, torch.bfloat16))
            res[f"fake_fail_{step}_balance"] = {"ok": repr(fake.balance())}
        fake.fail_on = None
        # disagreements and a shared GPU through the real constructor: refused before any allocation
        for field, (kw0, kw1) in WS_DISAGREE.items():
            kw = dict(max_tokens=64, hidden=2048, dtype=torch.bfloat16)
            kw.update(kw1 if rank == 1 else kw0)
            res[f"fake_disagree_{field}"] = _attempt(lambda: dispatch.Workspace(
                group, kw.pop("max_tokens"), kw.pop("hidden"), kw.pop("dtype"), **kw))
            res[f"fake_disagree_{field}_balance"] = {"ok": repr(fake.balance())}
        fake.uuid = "GPU-fake-shared"
        res["fake_same_gpu"] = _attempt(lambda: dispatch.Workspace(group, 64, 2048, torch.bfloat16))
        fake.uuid = f"GPU-fake-{rank}"
        res["fake_live_after_failures"] = {"ok": repr(len(wsm._live_workspaces) - live0)}
        res["fake_check_after_failures"] = _attempt(dispatch.check)
        res["fake_build_again"] = _attempt(build)  # the group is still in step after the failures
        res["fake_reset"] = _attempt(lambda: ws.reset())
        fake.fail_on = "synchronize" if rank == 1 else None
        res["fake_reset_sync_fails"] = _attempt(lambda: ws.reset())
        res["fake_close_sync_fails"] = _attempt(lambda: ws.close())
        fake.fail_on = None
        res["fake_close_again"] = _attempt(lambda: (ws.close(), ws._moe_ar_state.closed, fake.balance())[1:])
        # a rank that cannot close its mapping of a peer's buffer: no rank frees what a peer still maps
        res["fake_build_last"] = _attempt(build)
        fake.fail_on = "ipcCloseMemHandle" if rank == 1 else None
        res["fake_close_unmap_fails"] = _attempt(lambda: ws.close())
        res["fake_close_unmap_fails_balance"] = {"ok": repr(fake.balance())}
        fake.fail_on = None
    return res


WS_DISAGREE = {  # field: (every other rank's arguments, rank 1's), as tests/test_gpu_two_process.py
    "dtype": (dict(dtype=torch.bfloat16), dict(dtype=torch.float16)),
    "hidden": (dict(hidden=2048), dict(hidden=4096)),
    "max_tokens": (dict(max_tokens=64), dict(max_tokens=128)),
    "oneshot_max_tokens": (dict(oneshot_max_tokens=32), dict(oneshot_max_tokens=16)),
    "vec_per_thread": (dict(vec_per_thread=None), dict(vec_per_thread=2)),
    "timeout_s": (dict(timeout_s=10.0), dict(timeout_s=0.0)),
    # the selection boundaries (here pinned on one rank only): ranks must run the same regime for every T
    "tables": (dict(), dict(boundaries={"oneshot_max_tokens": 8})),
}

ARG_CASES = {  # case: (argument, value, "rank1" or "all")
    "hidden_bool": ("hidden", True, "rank1"),
    "hidden_float": ("hidden", 2048.0, "all"),
    "hidden_not_16": ("hidden", 2040, "rank1"),
    "max_tokens_bool": ("max_tokens", True, "all"),
    "max_tokens_zero": ("max_tokens", 0, "rank1"),
    "max_tokens_float": ("max_tokens", 64.0, "rank1"),
    "dtype_float32": ("dtype", torch.float32, "rank1"),
    "dtype_str": ("dtype", "bf16", "all"),
    "timeout_nan": ("timeout_s", math.nan, "rank1"),
    "timeout_inf": ("timeout_s", math.inf, "all"),
    "timeout_negative": ("timeout_s", -1.0, "rank1"),
    "timeout_bool": ("timeout_s", True, "rank1"),
    "timeout_str": ("timeout_s", "10", "all"),
    "timeout_past_a_day": ("timeout_s", 86400.5, "rank1"),
    "oneshot_zero": ("oneshot_max_tokens", 0, "rank1"),
    "oneshot_past_max_tokens": ("oneshot_max_tokens", 65, "all"),
    "boundaries_unknown_field": ("boundaries", {"twoshot_max_bytes": 8}, "rank1"),
    "boundaries_decreasing": ("boundaries", {"oneshot_max_tokens": 64, "early_max_tokens": 8}, "all"),
    "tables_no_file": ("tables", "/nonexistent/moe_ar_tables.json", "rank1"),
    "oneshot_bool": ("oneshot_max_tokens", True, "rank1"),
    "oneshot_float": ("oneshot_max_tokens", 32.0, "rank1"),
    "vec_per_thread_bool": ("vec_per_thread", True, "rank1"),
    "vec_per_thread_zero": ("vec_per_thread", 0, "all"),
}


def _worker(rank, world_size, port, out_dir):
    """Three ranks: cases on the default group, then two-rank cases on the group of global ranks 0
    and 1 and on that of 1 and 2 (the rank left out waits at the final barrier, so an exchange on the
    default group in place of the given one would wait for it until gloo's timeout)."""
    dist = _init_gloo(rank, world_size, port)
    from dispatch import rendezvous as rdv
    world = dist.group.WORLD
    pair = dist.new_group([0, 1])
    sub = dist.new_group([1, 2])
    res = {}
    d3 = dict(world_size=3)
    res["agree3"] = _attempt(lambda: len(rdv.rendezvous(world, _descriptor(rank, **d3))))
    res["hidden_rank2"] = _attempt(lambda: rdv.rendezvous(
        world, _descriptor(rank, **d3, hidden=4096 if rank == 2 else 7168)))
    res["same_gpu_1_2"] = _attempt(lambda: rdv.rendezvous(
        world, _descriptor(rank, **d3, gpu="GPU-shared" if rank else "GPU-zero")))
    res["status_rank2"] = _attempt(lambda: rdv.exchange_status(
        world, "allocating the buffers", error=RuntimeError("no memory") if rank == 2 else None))
    if rank in (0, 1):
        res.update(_two_rank_cases(rank, pair))
    if rank in (1, 2):
        res["subgroup_mismatch"] = _attempt(lambda: rdv.rendezvous(
            sub, _descriptor(rank - 1, hidden=4096 if rank == 2 else 7168)))
        res["subgroup_agree"] = _attempt(lambda: [d.gpu for d in rdv.rendezvous(sub, _descriptor(rank - 1))])
    pathlib.Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


class _FakeCuda:
    """Counts what the fakes allocate and free; `fail_on` names the call that raises next."""

    def __init__(self, rank):
        self.rank = rank
        self.fail_on = None
        self.live = {}  # pointer -> kind
        self.next_ptr = 0x1000 * (rank + 1) << 20
        self.mapped = {}  # pointer -> handle
        self.uuid = f"GPU-fake-{rank}"

    def _maybe_fail(self, what):
        if self.fail_on == what:
            raise RuntimeError(f"fake {what} failed (injected)")

    def balance(self):
        """What is still allocated or mapped: [] after every rank freed everything."""
        return sorted(self.live.values()) + ["ipc"] * len(self.mapped)


@contextlib.contextmanager
def fake_cuda(rank):
    """CUDA calls of the workspace (dispatch.workspace, dispatch.rank_memory) replaced by host-side fakes
    (the children have no GPU)."""
    import cupy
    from cupy.cuda import runtime
    fake = _FakeCuda(rank)
    mallocs = [0]

    def malloc(n):
        mallocs[0] += 1
        fake._maybe_fail("malloc_state" if mallocs[0] % 2 == 0 else "malloc_buffers")
        fake.next_ptr += max(n, 256)
        fake.live[fake.next_ptr] = "device"
        return fake.next_ptr

    def host_alloc(n, flags):
        fake._maybe_fail("hostAlloc")
        ptr = ctypes_buffer(n)
        fake.live[ptr] = "host"
        return ptr

    def free(ptr):
        assert fake.live.pop(ptr) == "device"

    def free_host(ptr):
        assert fake.live.pop(ptr) == "host"

    def ipc_get(ptr):
        fake._maybe_fail("ipcGetMemHandle")
        return ptr.to_bytes(64, "little")

    def ipc_open(handle, flags):
        fake._maybe_fail("ipcOpenMemHandle")
        ptr = int.from_bytes(handle, "little") + 7
        fake.mapped[ptr] = handle
        return ptr

    def ipc_close(ptr):
        fake._maybe_fail("ipcCloseMemHandle")
        del fake.mapped[ptr]

    def synchronize(*a):
        fake._maybe_fail("synchronize")

    class Device:
        def __init__(self, i=None):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    class Props:
        @property
        def uuid(self):
            return fake.uuid

    def memory_reset(self):
        fake._maybe_fail("reset")
        self.error[:] = 0

    from dispatch import rank_memory
    patches = [(runtime, "malloc", malloc), (runtime, "hostAlloc", host_alloc), (runtime, "free", free),
               (runtime, "freeHost", free_host), (runtime, "ipcGetMemHandle", ipc_get),
               (runtime, "ipcOpenMemHandle", ipc_open), (runtime, "ipcCloseMemHandle", ipc_close),
               (runtime, "deviceSynchronize", synchronize), (cupy.cuda, "Device", Device),
               (torch.cuda, "current_device", lambda: 0), (torch.cuda, "synchronize", synchronize),
               (torch.cuda, "get_device_properties", lambda d=None: Props()),
               (torch.cuda, "device", lambda d: contextlib.nullcontext()),
               (rank_memory.RankMemory, "reset", memory_reset)]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, value in patches:
        setattr(obj, name, value)
    try:
        yield fake
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


_host_buffers = []


def ctypes_buffer(n) -> int:
    import ctypes
    buf = (ctypes.c_char * n)()
    _host_buffers.append(buf)
    return ctypes.addressof(buf)


# ---- parent side: multi-rank cases ----------------------------------------------------------------

@pytest.fixture(scope="module")
def three(tmp_path_factory):
    """Every multi-rank case, from one spawned world of three ranks (starting processes is the slow part)."""
    return _run_world(tmp_path_factory, "_worker", 3)


@pytest.fixture(scope="module")
def two(three):
    """The cases run by global ranks 0 and 1 on their two-rank group."""
    return {case: outcomes for case, outcomes in three.items() if sorted(outcomes) == [0, 1]}


def _every_rank_raises(outcomes: dict, nranks: int, exc: str, *, starts: str = "", contains=()) -> str:
    assert sorted(outcomes) == list(range(nranks)), outcomes
    messages = set()
    for rank, o in sorted(outcomes.items()):
        assert o.get("raised") == exc, f"rank {rank}: expected {exc}, got {o}"
        assert o["message"].startswith(starts), f"rank {rank}: {o['message']!r} does not start with {starts!r}"
        for c in contains:
            assert c in o["message"], f"rank {rank}: {o['message']!r} does not name {c!r}"
        assert o["seconds"] < STATUS_BOUND_S, f"rank {rank} took {o['seconds']:.1f} s to raise"
        messages.add(o["message"])
    assert len(messages) == 1, f"the ranks raised different errors: {messages}"
    return messages.pop()


def test_agreeing_ranks_get_every_descriptor(two, three):
    assert all(o == {"ok": "[7168, 7168]", "seconds": o["seconds"]} for o in two["agree"].values()), two["agree"]
    assert all(o.get("ok") == "3" for o in three["agree3"].values()), three["agree3"]


@pytest.mark.parametrize("case", sorted(FIELD_CASES))
def test_a_field_that_differs_is_named_on_every_rank(two, case):
    field = case.replace("_fixed", "").replace("_disabled", "").replace("_boot", "")
    msg = _every_rank_raises(two[case], 2, "ValueError", starts=f"{field}:", contains=("rank 1", "rank 0"))
    if field == "hidden":
        assert msg.startswith("hidden: rank 1 has 4096, rank 0 has 7168"), msg
    if case == "timeout_s_disabled":
        assert "no deadline" in msg, msg
    if field == "host":
        assert "one host" in msg, msg


def test_two_ranks_on_one_gpu_are_refused(two, three):
    msg = _every_rank_raises(two["same_gpu"], 2, "ValueError", starts="device: ranks 0 and 1 are on the same GPU")
    assert "GPU-same" in msg and "one process per GPU" in msg and "EmulatedWorld" in msg, msg
    _every_rank_raises(three["same_gpu_1_2"], 3, "ValueError", starts="device: ranks 1 and 2 are on the same GPU")


def test_three_ranks_name_the_rank_that_differs(three):
    _every_rank_raises(three["hidden_rank2"], 3, "ValueError", starts="hidden: rank 2 has 4096, rank 0 has 7168")
    _every_rank_raises(three["status_rank2"], 3, "RuntimeError", contains=("allocating the buffers", "rank 2",
                                                                           "no memory"))


def test_the_exchange_uses_the_given_group(three):
    assert set(three["subgroup_mismatch"]) == {1, 2}
    _every_rank_raises({r - 1: o for r, o in three["subgroup_mismatch"].items()}, 2, "ValueError",
                       starts="hidden: rank 1 has 4096, rank 0 has 7168")
    assert [o.get("ok") for _, o in sorted(three["subgroup_agree"].items())] == ["['GPU-uuid-0', 'GPU-uuid-1']"] * 2


def test_a_local_failure_on_one_rank_raises_on_every_rank_without_waiting(two):
    _every_rank_raises(two["local_value_error"], 2, "ValueError", starts="hidden: True is a bool",
                       contains=("rank 1",))
    _every_rank_raises(two["status_error"], 2, "RuntimeError",
                       contains=("allocating the buffers", "rank 1", "MemoryError", "out of memory"))
    msg = _every_rank_raises(two["status_both_fail"], 2, "RuntimeError", contains=("opening the peers' buffers",
                                                                                   "rank 0", "boom on 0"))
    assert "rank 1" in msg, msg  # the other failing rank is mentioned too
    assert [o.get("ok") for _, o in sorted(two["status_ok"].items())] == ["[0, 10]"] * 2


@pytest.mark.parametrize("case", sorted(ARG_CASES))
def test_a_bad_constructor_argument_on_any_rank_is_named_on_every_rank(two, case):
    name, value, where = ARG_CASES[case]
    msg = _every_rank_raises(two[f"arg_{case}"], 2, "ValueError", starts=f"{name}:")
    if where == "rank1":
        assert "rank 1" in msg, msg


def test_failed_constructors_leave_nothing_registered(two):
    for rank in (0, 1):
        assert two["live_after_args"][rank]["ok"] == "0"
        assert "ok" in two["check_after_args"][rank], two["check_after_args"][rank]
        assert two["fake_live_after_failures"][rank]["ok"] == "0"
        assert "ok" in two["fake_check_after_failures"][rank], two["fake_check_after_failures"][rank]


def test_constructor_over_fake_cuda_builds_registers_and_closes(two):
    for rank in (0, 1):
        assert two["fake_build"][rank].get("ok") == f"({rank}, 2, 1, True)", two["fake_build"][rank]
        assert two["fake_close"][rank].get("ok") == "(False, [])", two["fake_close"][rank]
        assert two["fake_build_again"][rank].get("ok") == f"({rank}, 2, 1, True)", two["fake_build_again"][rank]
        assert "ok" in two["fake_reset"][rank], two["fake_reset"][rank]


@pytest.mark.parametrize("step,what", [("malloc_state", "allocating"), ("hostAlloc", "allocating"),
                                       ("ipcGetMemHandle", "allocating"), ("ipcOpenMemHandle", "opening the peers")])
def test_a_constructor_step_failing_on_one_rank_frees_everything_on_every_rank(two, step, what):
    _every_rank_raises(two[f"fake_fail_{step}"], 2, "RuntimeError", contains=(what, "rank 1", "injected"))
    for rank in (0, 1):
        assert two[f"fake_fail_{step}_balance"][rank]["ok"] == "[]", (rank, two[f"fake_fail_{step}_balance"][rank])


@pytest.mark.parametrize("field", sorted(WS_DISAGREE))
def test_the_constructor_refuses_a_disagreement_before_allocating(two, field):
    _every_rank_raises(two[f"fake_disagree_{field}"], 2, "ValueError", starts=f"{field}: rank 1 has",
                       contains=("rank 0",))
    for rank in (0, 1):
        assert two[f"fake_disagree_{field}_balance"][rank]["ok"] == "[]"


def test_the_constructor_refuses_two_ranks_on_one_gpu(two):
    _every_rank_raises(two["fake_same_gpu"], 2, "ValueError",
                       starts="device: ranks 0 and 1 are on the same GPU GPU-fake-shared; one process per GPU")


def test_reset_and_close_report_a_failing_rank_on_every_rank(two):
    _every_rank_raises(two["fake_reset_sync_fails"], 2, "RuntimeError", contains=("reset", "rank 1", "injected"))
    _every_rank_raises(two["fake_close_sync_fails"], 2, "RuntimeError", contains=("close", "rank 1", "injected"))
    for rank in (0, 1):  # the failed close kept the workspace; a second close released it
        assert two["fake_close_again"][rank].get("ok") == "(True, [])", two["fake_close_again"][rank]


def test_no_rank_frees_what_a_peer_still_maps(two):
    """Rank 1 cannot close its mapping of rank 0's buffers: both raise, and neither frees its memory
    (freeing exported memory that another process still maps is undefined)."""
    for rank in (0, 1):
        assert "ok" in two["fake_build_last"][rank], two["fake_build_last"][rank]
    _every_rank_raises(two["fake_close_unmap_fails"], 2, "RuntimeError",
                       contains=("close: closing the peers' mappings", "rank 1", "injected"))
    assert two["fake_close_unmap_fails_balance"][0]["ok"] == "['device', 'device', 'host']"
    assert two["fake_close_unmap_fails_balance"][1]["ok"] == "['device', 'device', 'host', 'ipc']"


# ---- in-process cases ---------------------------------------------------------------------------------

@pytest.fixture
def no_cuda(monkeypatch):
    """Any CUDA call of the constructors fails the test: argument checks must come first."""
    import cupy
    from cupy.cuda import runtime

    def touched(*a, **k):
        raise AssertionError("touched CUDA before checking the arguments")

    for obj, name in ((torch.cuda, "current_device"), (torch.cuda, "get_device_properties"),
                      (torch.cuda, "synchronize"), (torch.cuda, "Stream"), (runtime, "malloc"),
                      (runtime, "hostAlloc"), (runtime, "deviceCanAccessPeer"), (cupy.cuda, "Device")):
        monkeypatch.setattr(obj, name, touched)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


GOOD = dict(world_size=2, max_tokens=64, hidden=2048, dtype=torch.bfloat16)


@pytest.mark.parametrize("name,value", [
    ("world_size", True), ("world_size", 2.0), ("world_size", "2"), ("world_size", 3), ("world_size", 0),
    ("max_tokens", True), ("max_tokens", 64.0), ("max_tokens", -1), ("max_tokens", None),
    ("hidden", True), ("hidden", 2048.0), ("hidden", 0), ("hidden", 2050), ("hidden", 1 << 20),
    ("dtype", torch.float32), ("dtype", "bfloat16"), ("dtype", [torch.bfloat16]),
    ("timeout_s", math.nan), ("timeout_s", math.inf), ("timeout_s", -math.inf), ("timeout_s", -0.5),
    ("timeout_s", True), ("timeout_s", None), ("timeout_s", "1"), ("timeout_s", 1e30), ("timeout_s", 86401),
    ("oneshot_max_tokens", 0), ("oneshot_max_tokens", 65), ("oneshot_max_tokens", False),
    ("oneshot_max_tokens", 8.0), ("vec_per_thread", True), ("vec_per_thread", 5), ("vec_per_thread", 2.0),
    ("devices", [True, 0]), ("devices", [0.0, 1]), ("devices", ["cpu", "cpu"]), ("devices", [-1, 0]),
    ("devices", [0, 2]), ("devices", [0]), ("devices", 0), ("devices", "cuda:0"), ("devices", [None, 0]),
])
def test_emulated_world_arguments_are_checked_before_any_cuda_call(no_cuda, name, value):
    import dispatch
    kw = dict(GOOD)
    kw[name] = value
    pos = [kw.pop(k) for k in ("world_size", "max_tokens", "hidden", "dtype")]
    with pytest.raises(ValueError, match=f"^{name}: "):
        dispatch.EmulatedWorld(*pos, **kw)


def test_workspace_group_is_checked_first(no_cuda):
    import dispatch
    with pytest.raises(ValueError, match="^group: "):
        dispatch.Workspace(None, 64, True, torch.bfloat16)
    with pytest.raises(ValueError, match="^group: "):
        dispatch.Workspace(object(), 64, 2048, torch.bfloat16)


def test_timeout_limits():
    from dispatch.workspace_arguments import MAX_TIMEOUT_S, timeout_ns_from
    assert MAX_TIMEOUT_S == 86400
    assert timeout_ns_from(0) == 0 and timeout_ns_from(0.0) == 0
    assert timeout_ns_from(1e-12) == 1  # a positive deadline never rounds to 0, which means "none"
    assert timeout_ns_from(2.5) == 2_500_000_000
    assert timeout_ns_from(MAX_TIMEOUT_S) == MAX_TIMEOUT_S * 10**9
    # the deadline is %globaltimer (ns since 1970 on current drivers) + timeout_ns as a uint64
    assert time.time_ns() * 2 + timeout_ns_from(MAX_TIMEOUT_S) < 2**64


def test_program_set_hash_is_computed_once_and_covers_the_manifest(monkeypatch):
    from dispatch import registry
    from dispatch import rendezvous as rdv
    h = rdv.program_set_sha256()
    assert len(h) == 64 and int(h, 16) >= 0
    calls = []
    monkeypatch.setattr(registry, "program_set", lambda: calls.append(1))
    assert rdv.program_set_sha256() == h and not calls  # cached: no second pass over the manifest


def test_host_identity_names_the_host_and_boot():
    from dispatch.rendezvous import host_identity
    h = host_identity()
    assert socket.gethostname() in h
    try:
        boot = pathlib.Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = None
    if boot:
        assert boot in h


class _Fake:
    def __init__(self, fail=False):
        self.fail, self.checked = fail, 0

    def check(self):
        self.checked += 1
        if self.fail:
            raise RuntimeError("fake timed out")


def test_live_workspaces_are_held_weakly_and_checked():
    import dispatch
    from dispatch import workspace as wsm
    n0 = len(wsm._live_workspaces)
    a, b = _Fake(), _Fake()
    wsm.register_workspace(a)
    wsm.register_workspace(b)
    assert len(wsm._live_workspaces) == n0 + 2
    dispatch.check()
    assert a.checked == b.checked == 1
    ref = weakref.ref(a)
    del a
    gc.collect()
    assert ref() is None, "the bookkeeping kept a dropped workspace alive"
    assert len(wsm._live_workspaces) == n0 + 1
    bad = _Fake(fail=True)
    wsm.register_workspace(bad)
    with pytest.raises(RuntimeError, match="fake timed out"):
        dispatch.check()
    wsm._live_workspaces.discard(bad)
    wsm._live_workspaces.discard(b)
    dispatch.check()
    assert len(wsm._live_workspaces) == n0


def test_rank_memory_frees_what_it_took_when_a_step_fails(monkeypatch):
    """RankMemory: an allocation failing part-way frees the allocations before it."""
    import cupy
    from cupy.cuda import runtime
    from dispatch import rank_memory
    for fail_at in ("malloc2", "hostAlloc", "reset"):
        live, count = {}, [0]

        def malloc(n):
            count[0] += 1
            if fail_at == f"malloc{count[0]}":
                raise MemoryError("fake out of memory")
            live[1000 + count[0]] = "device"
            return 1000 + count[0]

        def host_alloc(n, flags):
            if fail_at == "hostAlloc":
                raise MemoryError("fake out of pinned memory")
            p = ctypes_buffer(n)
            live[p] = "host"
            return p

        def reset(self):
            raise RuntimeError("fake fill failed")

        monkeypatch.setattr(runtime, "malloc", malloc)
        monkeypatch.setattr(runtime, "hostAlloc", host_alloc)
        monkeypatch.setattr(runtime, "free", lambda p: live.pop(p))
        monkeypatch.setattr(runtime, "freeHost", lambda p: live.pop(p))
        monkeypatch.setattr(runtime, "deviceSynchronize", lambda: None)
        monkeypatch.setattr(cupy.cuda, "Device", lambda i: contextlib.nullcontext())
        monkeypatch.setattr(rank_memory.RankMemory, "reset", reset)
        with pytest.raises((MemoryError, RuntimeError)):
            rank_memory.RankMemory(0, 1024, 2)
        assert live == {}, (fail_at, live)


def test_emulated_world_frees_every_rank_when_one_rank_fails(monkeypatch):
    import dispatch
    from dispatch import emulated_world
    from dispatch import workspace as wsm
    made, freed = [], []

    class FakeMemory:
        def __init__(self, device_index, buffer_elems, elem_size):
            if len(made) == 2:
                raise MemoryError("fake out of memory")
            made.append(self)
            self.buffers = 0x1000 * len(made)

        def free(self, quiet=False):
            freed.append(self)

    monkeypatch.setattr(emulated_world, "RankMemory", FakeMemory)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    n0 = len(wsm._live_workspaces)
    with pytest.raises(RuntimeError, match="rank 2") as e:
        dispatch.EmulatedWorld(4, 64, 2048, torch.bfloat16)
    assert "MemoryError" in str(e.value) and "freed" in str(e.value)
    assert len(made) == 2 and freed == made
    assert len(wsm._live_workspaces) == n0
    dispatch.check()

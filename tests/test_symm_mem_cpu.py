"""The workspace's backends on the CPU (no GPU): the `backend` argument, the choice "auto" makes, the
descriptor comparison (a `backend` mismatch, symmetric memory missing on a rank, groups spanning
hosts), the multicast switch, and the whole symmetric-memory constructor over fakes.

Multi-rank cases run in a spawned world of three processes joined by gloo over 127.0.0.1: global rank
0 only waits at the final barrier while global ranks 1 and 2 build workspaces on their own two-rank
group, so an exchange (or a fake rendezvous) on the default group in place of the given one would wait
for rank 0 until gloo's timeout and fail the world (tests/multiproc.py kills a hang). CUDA is replaced
by test_rendezvous_cpu's fakes, torch symmetric memory by the fakes below (fake_symm): an allocation
that records the multicast variable, and a rendezvous that all-gathers the blocks' pointers over the
group it is given. tests/test_gpu_two_process.py runs the real thing on two GPUs.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import pathlib
import types
import warnings
import weakref

import pytest
import torch

import multiproc
import test_rendezvous_cpu as trc

WORLD_DEADLINE_S = 120.0
PEER_MAP_OFFSET = 0x100000  # where the fake rendezvous maps a peer's block, past its owner's address


# ---- fakes ----------------------------------------------------------------------------------------

class _FakeTensor:
    def __init__(self, ptr, nbytes):
        self.ptr, self.nbytes = ptr, nbytes

    def data_ptr(self):
        return self.ptr


class _FakeHandle:
    def __init__(self, buffer_ptrs, rank, world_size, buffer_size):
        self.buffer_ptrs, self.rank, self.world_size, self.buffer_size = buffer_ptrs, rank, world_size, buffer_size


class FakeSymm:
    """What a rank's fake torch symmetric memory and driver report; reset() between cases."""

    def __init__(self, fake):
        self.fake = fake  # test_rendezvous_cpu._FakeCuda: pointers and the balance of what is live
        self.env_at_alloc = []
        self.reset()

    def reset(self):
        self.import_fails = False
        self.backend_name = "CUDA"
        self.attrs = {}  # CUdevice_attribute -> value (default 1)
        self.fabric = (bytes(range(1, 17)), 7, 3, 0)  # NVML: cluster uuid, clique, state (3: completed), status
        self.host = "node-a boot 1111"
        self.fail_on = None  # "empty" or "rendezvous"
        self.null_peer = False

    def module(self):
        if self.import_fails:
            raise ImportError("No module named 'torch.distributed._symmetric_memory' (fake)")
        return types.SimpleNamespace(_SymmetricMemory=types.SimpleNamespace(empty_strided_p2p=self.empty_strided_p2p),
                                     rendezvous=self.rendezvous, get_backend=lambda device: self.backend_name)

    def empty_strided_p2p(self, size, stride, dtype, device):
        from dispatch import rank_memory
        self.env_at_alloc.append(os.environ.get(rank_memory.MULTICAST_ENV))
        if self.fail_on == "empty":
            raise RuntimeError("fake symmetric allocation failed (injected)")
        assert stride == (1,) and dtype == torch.uint8 and device.type == "cuda", (stride, dtype, device)
        self.fake.next_ptr += max(size[0], 1 << 21)
        t = _FakeTensor(self.fake.next_ptr, size[0])
        self.fake.live[t.ptr] = "symm"
        weakref.finalize(t, self.fake.live.pop, t.ptr, None)
        return t

    def rendezvous(self, tensor, group):
        """Collective over the group given: every rank's block pointer, a peer's mapped elsewhere."""
        import torch.distributed as dist
        me = dist.get_rank(group)
        ptrs = [None] * dist.get_world_size(group)
        dist.all_gather_object(ptrs, tensor.ptr, group=group)
        if self.fail_on == "rendezvous":  # after the exchange, as torch's import of a peer's block
            raise RuntimeError("fake import of a peer's block failed (injected)")
        mapped = [p if r == me else p + PEER_MAP_OFFSET for r, p in enumerate(ptrs)]
        if self.null_peer:
            mapped[1 - me] = 0
        h = _FakeHandle(mapped, me, len(ptrs), tensor.nbytes)
        key = ("peers", id(h))
        self.fake.live[key] = "symm-peers"
        weakref.finalize(h, self.fake.live.pop, key, None)
        return h

    def nvml(self, gpu):
        if self.fabric is None:
            raise RuntimeError("nvmlInit_v2 returned 9 (fake: no driver)")
        return self.fabric


@contextlib.contextmanager
def fake_symm(fake):
    from dispatch import backend_facts, workspace
    symm = FakeSymm(fake)
    patches = [(backend_facts, "symm_mem_module", symm.module),
               (backend_facts, "_cu_device_attribute", lambda device_index, attribute: symm.attrs.get(attribute, 1)),
               (backend_facts, "_nvml_fabric", symm.nvml), (workspace, "host_identity", lambda: symm.host)]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, value in patches:
        setattr(obj, name, value)
    try:
        yield symm
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


# ---- child side -------------------------------------------------------------------------------------

BACKEND_ARGS = {  # case: (value, "rank1" or "all")
    "nccl": ("nccl", "all"),
    "upper": ("IPC", "rank1"),
    "none": (None, "rank1"),
    "int": (1, "all"),
    "list": (["ipc"], "rank1"),
}


def _cases(rank, group) -> dict:
    """Group ranks 0 and 1 of a two-rank `group`."""
    import dispatch
    from dispatch import backend_facts, rank_memory
    from dispatch import workspace as wsm
    res = {}
    live0 = len(wsm._live_workspaces)
    for case, (value, where) in BACKEND_ARGS.items():
        kw = {"backend": value} if where == "all" or rank == 1 else {}
        res[f"arg_{case}"] = trc._attempt(lambda: dispatch.Workspace(group, 64, 2048, torch.bfloat16, **kw))

    with trc.fake_cuda(rank) as fake, fake_symm(fake) as symm:
        ws = None

        def build(backend, **kw):
            nonlocal ws
            ws = dispatch.Workspace(group, 64, 2048, torch.bfloat16, backend=backend, **kw)
            return dict(backend=ws.backend, reason=ws.backend_reason, rank=ws.rank, peers=ws.peer_buffer_ptrs,
                        own=ws._moe_ar_state.memory.buffers, opened=len(ws._opened), live=ws in wsm._live_workspaces)

        def case(name, fn, setup=None):
            """Run fn with `setup` applied to this rank's fakes (a dict per rank: {rank: {...}})."""
            for k, v in (setup or {}).get(rank, {}).items():
                setattr(symm, k, v)
            backend_facts._proven_domains.clear()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                res[name] = trc._attempt(fn)
            res[name]["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
            gc.collect()  # a failed constructor's traceback holds frames (and the fakes' objects) in cycles
            res[f"{name}_balance"] = {"ok": repr(fake.balance())}
            symm.reset()

        def build_close(backend):
            out = build(backend)
            ws.close()
            out["closed"] = ws._moe_ar_state.closed
            return out

        both = lambda **kw: {0: kw, 1: kw}  # noqa: E731
        rank1 = lambda **kw: {1: kw}  # noqa: E731
        case("symm_build", lambda: build("symm_mem"))
        case("symm_reset", lambda: ws.reset())
        case("symm_close", lambda: (ws.close(), ws._moe_ar_state.closed, ws in wsm._live_workspaces)[1:])
        case("symm_close_again", lambda: ws.close())
        # a `backend` disagreement, and symmetric memory missing on one rank
        case("mismatch", lambda: build("symm_mem" if rank == 1 else "ipc"))
        case("mismatch_auto", lambda: build("auto" if rank == 1 else "symm_mem"))
        case("unavailable", lambda: build("symm_mem"), rank1(import_fails=True))
        case("unavailable_nvshmem", lambda: build("symm_mem"), rank1(backend_name="NVSHMEM"))
        case("unavailable_both", lambda: build("symm_mem"), both(attrs={102: 0}))
        case("auto_falls_back", lambda: build_close("auto"), rank1(import_fails=True))
        case("auto_falls_back_nvshmem", lambda: build_close("auto"), {0: dict(backend_name="NVSHMEM")})
        case("auto_symm", lambda: build_close("auto"))
        case("ipc", lambda: build_close("ipc"), both(import_fails=True))  # never looks at symmetric memory
        # the multicast switch: set before the allocation unless the caller set it
        os.environ.pop(rank_memory.MULTICAST_ENV, None)
        case("env_unset", lambda: (build_close("symm_mem")["backend"], symm.env_at_alloc[-1],
                                   os.environ.get(rank_memory.MULTICAST_ENV)))
        os.environ[rank_memory.MULTICAST_ENV] = "0"  # the caller's own choice (a fake: nothing is mapped here)
        case("env_caller", lambda: (build_close("symm_mem")["backend"], symm.env_at_alloc[-1],
                                    os.environ.get(rank_memory.MULTICAST_ENV)))
        os.environ[rank_memory.MULTICAST_ENV] = "1"
        # hosts: one host always; several only with symmetric memory and one proven NVLink domain
        hosts = {0: dict(host="node-a boot 1111"), 1: dict(host="node-b boot 2222")}
        with_hosts = lambda **kw: {r: dict(hosts[r], **kw) for r in (0, 1)}  # noqa: E731
        case("hosts_ipc", lambda: build("ipc"), hosts)
        case("hosts_no_fabric", lambda: build("symm_mem"), with_hosts(attrs={128: 0}))
        case("hosts_no_fabric_rank1", lambda: build("symm_mem"), {0: hosts[0], 1: dict(hosts[1], attrs={128: 0})})
        case("hosts_nvml_fails", lambda: build("symm_mem"), with_hosts(fabric=None))
        case("hosts_incomplete", lambda: build("symm_mem"), with_hosts(fabric=(bytes(range(16)), 7, 2, 0)))
        case("hosts_no_cluster", lambda: build("symm_mem"), with_hosts(fabric=(bytes(16), 7, 3, 0)))
        case("hosts_other_domain", lambda: build("symm_mem"),
             {r: dict(hosts[r], fabric=(bytes(range(1, 17)), 7 + r, 3, 0)) for r in (0, 1)})
        case("hosts_one_domain", lambda: build_close("symm_mem"), hosts)
        case("hosts_auto_one_domain", lambda: build_close("auto"), hosts)
        case("hosts_auto_unavailable", lambda: build("auto"),
             {0: hosts[0], 1: dict(hosts[1], import_fails=True)})
        case("one_host_no_fabric", lambda: build_close("symm_mem"), both(attrs={128: 0}))
        # a local step failing on rank 1
        case("fail_empty", lambda: build("symm_mem"), rank1(fail_on="empty"))
        case("fail_rendezvous", lambda: build("symm_mem"), rank1(fail_on="rendezvous"))
        case("null_peer", lambda: build("symm_mem"), rank1(null_peer=True))
        res["live_after_failures"] = {"ok": repr(len(wsm._live_workspaces) - live0)}
        res["check_after_failures"] = trc._attempt(dispatch.check)
        # close: a rank that cannot finish its kernels keeps every rank's workspace
        case("build_last", lambda: build("symm_mem"))
        fake.fail_on = "synchronize" if rank == 1 else None
        case("close_sync_fails", lambda: ws.close())
        fake.fail_on = None
        case("close_after_sync_fails", lambda: (ws.close(), ws._moe_ar_state.closed)[1])
    return res


def _worker(rank, world_size, port, out_dir):
    dist = trc._init_gloo(rank, world_size, port)
    sub = dist.new_group([1, 2])
    res = _cases(rank - 1, sub) if rank in (1, 2) else {}
    pathlib.Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))
    dist.barrier()  # rank 0 waits here: the default group is busy while ranks 1 and 2 work
    dist.destroy_process_group()


# ---- parent side ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """{case: {group rank: outcome}} of global ranks 1 and 2 (group ranks 0 and 1)."""
    out = tmp_path_factory.mktemp("symm")
    multiproc.spawn("test_symm_mem_cpu", "_worker", 3, (3, trc._free_port(), str(out)), WORLD_DEADLINE_S)
    results = {}
    for p in sorted(out.glob("rank*.json")):
        rank = int(p.stem[4:])
        for case, outcome in json.loads(p.read_text()).items():
            results.setdefault(case, {})[rank - 1] = outcome
    assert results and all(sorted(v) == [0, 1] for v in results.values()), results
    return results


def _ok(two, case) -> list:
    for r in (0, 1):
        assert "ok" in two[case][r], (case, r, two[case][r])
    return [eval(two[case][r]["ok"]) for r in (0, 1)]  # noqa: S307 - reprs of our own literals


def _nothing_left(two, case):
    for r in (0, 1):
        assert two[f"{case}_balance"][r]["ok"] == "[]", (case, r, two[f"{case}_balance"][r])


@pytest.mark.parametrize("case", sorted(BACKEND_ARGS))
def test_a_bad_backend_on_any_rank_is_named_on_every_rank(two, case):
    value, where = BACKEND_ARGS[case]
    msg = trc._every_rank_raises(two[f"arg_{case}"], 2, "ValueError", starts="backend: ",
                                 contains=("'ipc', 'symm_mem' or 'auto'",))
    if where == "rank1":
        assert "rank 1" in msg, msg


def test_symm_mem_builds_maps_every_peer_resets_and_closes(two):
    built = _ok(two, "symm_build")
    for r, b in enumerate(built):
        assert b["backend"] == "symm_mem" and b["rank"] == r and b["opened"] == 0 and b["live"], b
        assert b["peers"][r] == b["own"] and b["peers"][2:] == [0] * (len(b["peers"]) - 2), b
        assert b["peers"][1 - r] == built[1 - r]["own"] + PEER_MAP_OFFSET, (b, built[1 - r])
        assert "usable on every rank" in b["reason"], b
        assert not two["symm_build"][r]["warnings"]
    _ok(two, "symm_reset")
    assert _ok(two, "symm_close") == [(True, False)] * 2
    _ok(two, "symm_close_again")  # a second close is a no-op
    _nothing_left(two, "symm_close")


@pytest.mark.parametrize("case,rank1,rank0", [("mismatch", "symm_mem", "ipc"), ("mismatch_auto", "auto", "symm_mem")])
def test_a_backend_mismatch_is_refused_on_every_rank_before_allocating(two, case, rank1, rank0):
    trc._every_rank_raises(two[case], 2, "ValueError", starts=f"backend: rank 1 has {rank1}, rank 0 has {rank0}")
    _nothing_left(two, case)


@pytest.mark.parametrize("case,rank,why", [("unavailable", 1, "cannot import torch.distributed._symmetric_memory"),
                                           ("unavailable_nvshmem", 1, "backend for cuda:0 is 'NVSHMEM'"),
                                           ("unavailable_both", 0, "does not support CUDA virtual memory")])
def test_symm_mem_asked_where_a_rank_lacks_it_is_refused_naming_backend(two, case, rank, why):
    msg = trc._every_rank_raises(two[case], 2, "ValueError", starts=f"backend: 'symm_mem' is not available on "
                                                                     f"rank {rank}: ", contains=(why,))
    if case == "unavailable_both":
        assert "not on rank 1 either" in msg, msg
    _nothing_left(two, case)


@pytest.mark.parametrize("case,why", [("auto_falls_back", "rank 1: torch"),
                                      ("auto_falls_back_nvshmem", "rank 0: torch's symmetric-memory backend")])
def test_auto_chooses_ipc_on_every_rank_when_one_rank_cannot_use_symm_mem(two, case, why):
    for r, b in enumerate(_ok(two, case)):
        assert b["backend"] == "ipc" and b["opened"] == 1 and b["closed"], b
        assert b["reason"].startswith("backend 'auto' chose 'ipc': torch symmetric memory is not usable on") and \
            why in b["reason"], b
        assert two[case][r]["warnings"] == [f"Workspace: {b['reason']}"], two[case][r]
    _nothing_left(two, case)


def test_auto_chooses_symm_mem_where_every_rank_can(two):
    for r, b in enumerate(_ok(two, "auto_symm")):
        assert b["backend"] == "symm_mem" and b["opened"] == 0 and b["reason"].startswith("backend 'auto'"), b
        assert not two["auto_symm"][r]["warnings"]
    _nothing_left(two, "auto_symm")


def test_ipc_never_touches_symmetric_memory(two):
    for b in _ok(two, "ipc"):
        assert b["backend"] == "ipc" and b["reason"] == "backend 'ipc' was asked for" and b["opened"] == 1, b
    _nothing_left(two, "ipc")


def test_multicast_is_switched_off_before_allocating_unless_the_caller_chose(two):
    assert _ok(two, "env_unset") == [("symm_mem", "1", "1")] * 2
    assert _ok(two, "env_caller") == [("symm_mem", "0", "0")] * 2  # the caller's value is kept


def test_ranks_on_two_hosts_with_ipc_are_refused(two):
    msg = trc._every_rank_raises(two["hosts_ipc"], 2, "ValueError", starts="host: rank 1 is on node-b boot 2222, "
                                 "rank 0 on node-a boot 1111", contains=("one host", "backend='symm_mem'"))
    assert "auto" not in msg
    _nothing_left(two, "hosts_ipc")


@pytest.mark.parametrize("case,rank,why", [
    ("hosts_no_fabric", 0, "does not export fabric handles"),
    ("hosts_no_fabric_rank1", 1, "does not export fabric handles"),
    ("hosts_nvml_fails", 0, "could not be read (RuntimeError: nvmlInit_v2 returned 9"),
    ("hosts_incomplete", 0, "registration is not complete (NVML fabric state 2)"),
    ("hosts_no_cluster", 0, "no NVLink fabric cluster"),
])
def test_symm_mem_across_hosts_without_a_proven_domain_is_refused_naming_group(two, case, rank, why):
    msg = trc._every_rank_raises(two[case], 2, "ValueError", starts="group: its ranks span 2 hosts (rank 0 on "
                                 "node-a boot 1111, rank 1 on node-b boot 2222) and no common NVLink domain is "
                                 f"proven: rank {rank}: ", contains=(why, "docs/nvlink-domains.md"))
    assert "one host" in msg
    _nothing_left(two, case)


def test_symm_mem_across_hosts_in_different_domains_is_refused(two):
    trc._every_rank_raises(two["hosts_other_domain"], 2, "ValueError", starts="group: its ranks span 2 hosts",
                           contains=("different NVLink domains", "rank 1 is in fabric cluster "
                                     "0102030405060708090a0b0c0d0e0f10 clique 8", "clique 7"))
    _nothing_left(two, "hosts_other_domain")


def test_symm_mem_across_hosts_in_one_proven_domain_builds(two):
    for case in ("hosts_one_domain", "hosts_auto_one_domain"):
        assert [b["backend"] for b in _ok(two, case)] == ["symm_mem"] * 2, two[case]
        _nothing_left(two, case)
    assert [b["backend"] for b in _ok(two, "one_host_no_fabric")] == ["symm_mem"] * 2  # one host needs no fabric


def test_auto_across_hosts_falling_back_to_ipc_is_refused_saying_why(two):
    trc._every_rank_raises(two["hosts_auto_unavailable"], 2, "ValueError", starts="host: rank 1 is on node-b",
                           contains=("backend 'auto' chose 'ipc'", "rank 1: torch"))
    _nothing_left(two, "hosts_auto_unavailable")


@pytest.mark.parametrize("case,step,what", [
    ("fail_empty", "allocating the buffers (torch symmetric memory)", "injected"),
    ("fail_rendezvous", "mapping the peers' buffers (torch symmetric memory rendezvous)", "injected"),
    ("null_peer", "mapping the peers' buffers (torch symmetric memory rendezvous)", "mapped no buffers of rank 0"),
])
def test_a_symm_mem_step_failing_on_one_rank_raises_on_every_rank_and_frees(two, case, step, what):
    trc._every_rank_raises(two[case], 2, "RuntimeError", starts=f"workspace: {step} failed on rank 1 of 2",
                           contains=(what,))
    _nothing_left(two, case)


def test_failed_symm_mem_constructors_leave_nothing_registered(two):
    for r in (0, 1):
        assert two["live_after_failures"][r]["ok"] == "0"
        assert "ok" in two["check_after_failures"][r], two["check_after_failures"][r]


def test_a_failed_close_keeps_every_rank_s_symmetric_memory_until_closed_again(two):
    _ok(two, "build_last")
    trc._every_rank_raises(two["close_sync_fails"], 2, "RuntimeError", contains=("close", "rank 1", "injected"))
    for r in (0, 1):  # the buffers and the peers' mappings are still there
        assert two["close_sync_fails_balance"][r]["ok"] == "['device', 'host', 'symm', 'symm-peers']", two
    assert _ok(two, "close_after_sync_fails") == [True, True]
    _nothing_left(two, "close_after_sync_fails")


# ---- in-process: the pure parts -----------------------------------------------------------------------

def _d(rank=0, **kw):
    from dispatch.rendezvous import RankDescriptor
    d = dict(world_size=2, program_set="a" * 64, dtype="torch.bfloat16", hidden=7168, max_tokens=512,
             oneshot_max_tokens=256, vec_per_thread=None, timeout_ns=10 ** 10, buffer_bytes=1 << 20,
             host="node-a boot 1", gpu=f"GPU-{rank}", backend="symm_mem")
    d.update(kw)
    return RankDescriptor(**d)


def test_the_default_backend_is_ipc_and_auto_is_offered():
    import inspect

    import dispatch
    from dispatch import workspace_arguments
    assert inspect.signature(dispatch.Workspace).parameters["backend"].default == "ipc"
    assert workspace_arguments.BACKENDS == ("ipc", "symm_mem", "auto")
    assert inspect.signature(dispatch.EmulatedWorld).parameters["backend"].default is None


def test_choose_backend():
    from dispatch.rendezvous import choose_backend
    assert choose_backend([_d(0, backend="ipc", symm_mem_unavailable="x")] * 2)[0] == "ipc"
    assert choose_backend([_d(0), _d(1)])[0] == "symm_mem"
    assert choose_backend([_d(0, backend="auto"), _d(1, backend="auto")])[0] == "symm_mem"
    b, why = choose_backend([_d(0, backend="auto"), _d(1, backend="auto", symm_mem_unavailable="no module")])
    assert (b, why) == ("ipc", "backend 'auto' chose 'ipc': torch symmetric memory is not usable on rank 1: no module")
    with pytest.raises(ValueError, match=r"^backend: 'symm_mem' is not available on rank 1: no module; not on "
                                         r"ranks 2, 3 either"):
        choose_backend([_d(0)] + [_d(r, symm_mem_unavailable="no module") for r in (1, 2, 3)])


def test_compare_descriptors_backend_and_hosts():
    from dispatch.rendezvous import compare_descriptors
    with pytest.raises(ValueError, match="^backend: rank 1 has ipc, rank 0 has symm_mem; every rank"):
        compare_descriptors([_d(0), _d(1, backend="ipc")])
    # the first differing field is named before the backend is chosen
    with pytest.raises(ValueError, match="^hidden: "):
        compare_descriptors([_d(0), _d(1, hidden=4096, symm_mem_unavailable="x")])
    dom = "fabric cluster 01 clique 7"
    two_hosts = [_d(0, nvlink_domain=dom), _d(1, host="node-b boot 2", nvlink_domain=dom)]
    assert compare_descriptors(two_hosts)[0] == "symm_mem"
    with pytest.raises(ValueError, match=r"^group: its ranks span 2 hosts .* rank 1: no NVLink domain is known"):
        compare_descriptors([_d(0, nvlink_domain=dom), _d(1, host="node-b boot 2")])
    with pytest.raises(ValueError, match=r"^group: its ranks span 3 hosts .* different NVLink domains: rank 2"):
        compare_descriptors(two_hosts + [_d(2, host="node-c boot 3", nvlink_domain="fabric cluster 02 clique 7")])
    with pytest.raises(ValueError, match="^host: rank 1 is on node-b boot 2, rank 0 on node-a boot 1; the CUDA IPC"):
        compare_descriptors([_d(0, backend="ipc"), _d(1, backend="ipc", host="node-b boot 2")])
    # a GPU named by its PCI bus id (older torch) on two hosts is two GPUs; on one host, one
    pci = [_d(0, gpu="PCI 0000:18:00.0", nvlink_domain=dom), _d(1, host="node-b boot 2", gpu="PCI 0000:18:00.0",
                                                                   nvlink_domain=dom)]
    assert compare_descriptors(pci)[0] == "symm_mem"
    with pytest.raises(ValueError, match="^device: ranks 0 and 1 are on the same GPU PCI 0000:18:00.0"):
        compare_descriptors([_d(0, gpu="PCI 0000:18:00.0"), _d(1, gpu="PCI 0000:18:00.0")])


def _module(**over):
    def rendezvous(tensor, group):
        raise AssertionError("not collective-free: rendezvous called")
    m = dict(_SymmetricMemory=types.SimpleNamespace(empty_strided_p2p=lambda *a: None), rendezvous=rendezvous,
             get_backend=lambda device: "CUDA")
    m.update(over)
    return types.SimpleNamespace(**m)


GROUP = types.SimpleNamespace(group_name="7")


@pytest.mark.parametrize("name,module,attrs,group,why", [
    ("ok", _module(), {}, GROUP, ""),
    ("no_module", ImportError("No module named torch.distributed._symmetric_memory"), {}, GROUP,
     "cannot import torch.distributed._symmetric_memory (ImportError: No module"),
    ("old_rendezvous", _module(rendezvous=lambda tensor: None), {}, GROUP, "has no rendezvous(tensor, group)"),
    ("no_p2p", _module(_SymmetricMemory=types.SimpleNamespace()), {}, GROUP, "lacks empty_strided_p2p"),
    ("no_allocator", _module(get_backend=lambda device: None), {}, GROUP, "no symmetric-memory allocator for CUDA"),
    ("nvshmem", _module(get_backend=lambda device: "NVSHMEM"), {}, GROUP, "set TORCH_SYMMMEM=CUDA"),
    ("no_group_name", _module(), {}, types.SimpleNamespace(), "the group has no group_name"),
    ("no_vmm", _module(), {102: 0}, GROUP, "does not support CUDA virtual memory management"),
    ("no_export", _module(), {103: 0, 128: 0}, GROUP, "neither as a POSIX file descriptor nor as a fabric handle"),
    ("fabric_only", _module(), {103: 0}, GROUP, ""),
    ("driver_error", _module(), {102: RuntimeError("cuInit returned CUDA driver error 100")}, GROUP,
     "checking torch symmetric memory failed (RuntimeError: cuInit returned"),
])
def test_symm_mem_availability_is_local_and_says_why(monkeypatch, name, module, attrs, group, why):
    from dispatch import backend_facts as facts

    def mod():
        if isinstance(module, Exception):
            raise module
        return module

    def attr(device_index, attribute):
        v = attrs.get(attribute, 1)
        if isinstance(v, Exception):
            raise v
        return v
    monkeypatch.setattr(facts, "symm_mem_module", mod)
    monkeypatch.setattr(facts, "_cu_device_attribute", attr)
    got = facts.symm_mem_unavailable(group, 0)
    assert (got == "") if not why else (why in got), got


def test_symm_mem_availability_with_this_torch():
    """The installed torch, unpatched: available or not, the answer is a string and nothing raises
    (a CPU build of torch has no CUDA allocator for symmetric memory)."""
    from dispatch import backend_facts as facts
    got = facts.symm_mem_unavailable(GROUP, 0)
    assert isinstance(got, str)
    if torch.version.cuda is None:
        assert got, "a CPU build of torch reported symmetric memory as usable"


def test_nvlink_domain_is_proven_only_by_a_completed_fabric(monkeypatch):
    from dispatch import backend_facts as facts
    fabric, reads = {"attr": 1, "info": (bytes(range(16)), 3, 3, 0)}, []

    def nvml(gpu):
        reads.append(gpu)
        if isinstance(fabric["info"], Exception):
            raise fabric["info"]
        return fabric["info"]
    monkeypatch.setattr(facts, "_cu_device_attribute", lambda d, a: fabric["attr"] if a == 128 else 1)
    monkeypatch.setattr(facts, "_nvml_fabric", nvml)
    monkeypatch.setattr(facts, "_proven_domains", {})
    fabric["attr"] = 0
    assert facts.nvlink_domain(0, "GPU-a") == ("", "its GPU does not export fabric handles "
                                                 "(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED is 0)")
    assert not reads
    fabric["attr"] = 1
    for info, why in (((bytes(range(16)), 3, 1, 0), "not complete (NVML fabric state 1)"),
                      ((bytes(range(16)), 3, 3, 5), "NVLink fabric status 5"),
                      ((bytes(16), 3, 3, 0), "no NVLink fabric cluster"),
                      (OSError("libnvidia-ml.so.1: cannot open shared object file"), "could not be read (OSError")):
        fabric["info"] = info
        domain, note = facts.nvlink_domain(0, "GPU-a")
        assert domain == "" and why in note, (info, note)
    fabric["info"] = (bytes(range(16)), 3, 3, 0)
    assert facts.nvlink_domain(0, "GPU-a") == ("fabric cluster 000102030405060708090a0b0c0d0e0f clique 3", "")
    n = len(reads)
    assert facts.nvlink_domain(0, "GPU-a")[0].endswith("clique 3") and len(reads) == n  # proven once, remembered


def test_nvml_fabric_structures_match_nvml_h():
    import ctypes

    from dispatch import backend_facts as facts
    assert ctypes.sizeof(facts._NvmlFabricInfoV2) == 36  # nvmlGpuFabricInfo_v2 = 0x02000024
    assert ctypes.sizeof(facts._NvmlFabricInfoV2) | (2 << 24) == 0x02000024
    assert facts._NvmlFabricInfoV2.state.offset == 28 and facts._NvmlFabricInfoV2.health_mask.offset == 32
    assert facts._NvmlFabricInfo.clique_id.offset == 20 and facts._NvmlFabricInfo.state.offset == 24


@pytest.mark.parametrize("preset,expected", [(None, "1"), ("0", "0"), ("1", "1")])
def test_the_multicast_variable_is_set_before_the_first_allocation(monkeypatch, preset, expected):
    from dispatch import backend_facts, rank_memory
    seen = []

    def p2p(size, stride, dtype, device):
        seen.append(os.environ.get(rank_memory.MULTICAST_ENV))
        return _FakeTensor(0x7000, size[0])
    monkeypatch.setattr(backend_facts, "symm_mem_module", lambda: _module(
        _SymmetricMemory=types.SimpleNamespace(empty_strided_p2p=p2p)))
    if preset is None:
        monkeypatch.delenv(rank_memory.MULTICAST_ENV, raising=False)
    else:
        monkeypatch.setenv(rank_memory.MULTICAST_ENV, preset)
    block = rank_memory.SymmMemBuffers(0, 4096)
    assert seen == [expected] and os.environ[rank_memory.MULTICAST_ENV] == expected and block.ptr == 0x7000
    block.release()
    assert block.ptr == 0 and block.tensor is None and block.handle is None


def test_a_misaligned_symmetric_buffer_is_refused(monkeypatch):
    from dispatch import backend_facts, rank_memory
    monkeypatch.setattr(backend_facts, "symm_mem_module", lambda: _module(
        _SymmetricMemory=types.SimpleNamespace(empty_strided_p2p=lambda size, *a: _FakeTensor(0x7008, size[0]))))
    with pytest.raises(RuntimeError, match="not 16-byte aligned"):
        rank_memory.SymmMemBuffers(0, 4096)


def test_backend_cost_arguments_and_table():
    from moe_ar_tools import backend_cost as bc
    a = bc.parse_args(["--out", "x.json", "--tokens", "16,1,16"])
    assert a.tokens == [1, 16] and (a.calls, a.replays, a.constructions) == (10, 50, 5)
    assert bc.parse_args(["--out", "x.json"]).tokens == [1, 16, 128, 1024, 8192]
    with pytest.raises(SystemExit):
        bc.parse_args(["--out", "x.json", "--replays", "0"])
    ok = dict(error=None, construct_first_s=0.5, construct_median_s=0.012, buffer_bytes=704e6,
              device_bytes_median=706e6)
    calls = [dict(tokens=1, median_us={"ipc": 6.4, "symm_mem": 6.5}, ratio_symm_mem_over_ipc=1.016,
                  identical_outputs=True)]
    t = bc.table({"backends": {"ipc": ok, "symm_mem": ok}, "calls": calls})
    assert "| ipc | 500.0 / 12.0 | 704.0 | 706.0 | 6.4 |" in t and "| symm_mem / ipc | | | | 1.016 |" in t, t
    t = bc.table({"backends": {"ipc": ok, "symm_mem": dict(error="ValueError: backend: ...")},
                  "calls": [dict(tokens=1, median_us={"ipc": 6.4}, identical_outputs=True)]})
    assert "| symm_mem | unavailable: ValueError: backend: ... |" in t and "symm_mem / ipc" not in t, t


def test_symm_mem_rendezvous_checks_what_torch_returns(monkeypatch):
    from dispatch import backend_facts, rank_memory
    handles = []
    monkeypatch.setattr(backend_facts, "symm_mem_module", lambda: _module(
        _SymmetricMemory=types.SimpleNamespace(empty_strided_p2p=lambda size, *a: _FakeTensor(0x9000, size[0])),
        rendezvous=lambda tensor, group: handles.pop(0)))
    block = rank_memory.SymmMemBuffers(0, 4096)
    handles.append(_FakeHandle([0x9000, 0x5000], 0, 2, 4096))
    assert block.rendezvous(GROUP, 0, 2) == 0 and block.peer_pointers([0, 0x40]) == [0x9000, 0x5040]
    for h, what in ((None, "returned no handle"), (_FakeHandle([0x9000, 0], 0, 2, 4096), "mapped no buffers of rank 1"),
                    (_FakeHandle([0x9000], 0, 1, 4096), "expected rank 0 of 2"),
                    (_FakeHandle([0x9000, 0x5000], 1, 2, 4096), "expected rank 0 of 2"),
                    (_FakeHandle([0x8000, 0x5000], 0, 2, 4096), "not inside torch's block")):
        handles.append(h)
        with pytest.raises(RuntimeError, match=what):
            block.rendezvous(GROUP, 0, 2)


@pytest.mark.parametrize("backend", ["symm_mem", "auto", 1, "IPC"])
def test_emulated_world_takes_no_backend_but_ipc(no_cuda, backend):
    import dispatch
    with pytest.raises(ValueError, match=r"^backend: .*EmulatedWorld keeps every rank in this process"):
        dispatch.EmulatedWorld(2, 64, 2048, torch.bfloat16, backend=backend)


@pytest.mark.parametrize("backend", [None, "ipc"])
def test_emulated_world_accepts_none_or_ipc(no_cuda, backend):
    import dispatch
    with pytest.raises(AssertionError, match="touched CUDA"):  # past the argument checks, at the first CUDA call
        dispatch.EmulatedWorld(2, 64, 2048, torch.bfloat16, backend=backend)


no_cuda = trc.no_cuda

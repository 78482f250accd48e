"""Real process groups: one process per GPU, peers over CUDA IPC or torch symmetric memory, the
workspace's two backends (needs 2 GPUs). Tests taking `backend` run once for each.

* every world-size-2 program, forced, on random cases: each rank checks its own outputs against
  the float64 reference (both processes build the same inputs from one seed, on the CPU), and
  all outputs are compared bit for bit across the processes with all_gather;
* automatic selection across every regime boundary, both ways, eager, then CUDA graphs of a call
  in each regime, with and without PDL, replayed with fresh inputs;
* the workspace rendezvous uses the group it is given: a 3-process world with a gloo default
  group, where only global ranks 1 and 2 (group ranks 0 and 1) build the workspace;
* a lost peer: one rank skips a call, the other times out with an error naming its rank and
  phase, and a collective reset brings correct results back;
* the rendezvous: rank 1 passing another dtype, hidden, max_tokens, oneshot_max_tokens,
  vec_per_thread, timeout_s (or, with symmetric memory, backend) makes both ranks raise the same
  ValueError naming the field, before anything is allocated; rank 1's constructor failing (pinned
  allocation, CUDA IPC open, or a real out-of-memory on its GPU; CUDA IPC only) makes both raise
  RuntimeError naming the step and rank 1 within 20 s, with every allocation freed; after each, a
  matching workspace builds and computes correct results.

Failures in a child propagate: a child raises (torch.multiprocessing reports its traceback) and
the parent kills the children that are left if the deadline passes.
"""
from __future__ import annotations

import json
import os
import pathlib
import random
import time

import pytest
import torch

import multiproc
from moe_ar_tools import reference as ref
from generator import policy
from generator import spec as gspec

pytestmark = pytest.mark.gpu

ENV = multiproc.ENV
HIDDENS = (2048, 2880, 4096, 5120, 7168, 8192)
MAX_TOKENS = 384
CASES_PER_PROGRAM = 4
BACKENDS = ("ipc", "symm_mem")
REGIME_MAX_TOKENS = 1536
REGIME_HIDDEN = 2048
REGIME_RANDOM_CALLS = 48   # eager calls beyond the ones placed on each side of every boundary
REGIME_GRAPH_REPLAYS = 8   # replays of each captured graph (one graph per regime and PDL setting)
WS2_PROGRAMS = sorted(s.name for s in gspec.all_cells() if policy.is_supported(s) and s.world_size == 2)


@pytest.fixture(autouse=True)
def _two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")


# ---- parent side ------------------------------------------------------------------------------

def _run_ranks(worker, nprocs, tmp_path, base_seed, record_result, timeout_s, *extra):
    """Run `worker` in nprocs processes (arguments: init file, output folder, base seed, *extra);
    every rank's result rows are recorded (also when the run fails) and returned."""
    out = tmp_path / "out"
    out.mkdir()
    try:
        multiproc.spawn("test_gpu_two_process", worker, nprocs,
                        (str(tmp_path / "init"), str(out), base_seed, *extra), timeout_s)
    finally:
        rows = multiproc.read_rank_rows(out)
        for r in rows:
            record_result(**r)
    return rows


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_world_size_2_programs_two_processes(tmp_path, base_seed, record_result, backend):
    rows = _run_ranks("_worker_sweep", 2, tmp_path, base_seed, record_result, 570, backend)
    ran = {r["program"] for r in rows if r["rank"] == 0}
    assert ran == set(WS2_PROGRAMS), sorted(set(WS2_PROGRAMS) - ran)
    assert all(r["passed"] and r["cases"] == CASES_PER_PROGRAM and r["backend"] == backend for r in rows), rows


@pytest.mark.parametrize("backend", BACKENDS)
def test_regime_boundaries_eager_and_in_graphs_two_processes(tmp_path, base_seed, record_result, backend):
    rows = _run_ranks("_worker_regimes", 2, tmp_path, base_seed, record_result, 570, backend)
    assert len(rows) == 4 and all(r["passed"] and r["cases"] > 0 and r["backend"] == backend for r in rows), rows


@pytest.mark.parametrize("backend", BACKENDS)
def test_workspace_uses_the_given_group(tmp_path, base_seed, record_result, backend):
    rows = _run_ranks("_worker_subgroup", 3, tmp_path, base_seed, record_result, 300, backend)
    assert len(rows) == 2 and all(r["passed"] and r["cases"] > 0 for r in rows), rows


@pytest.mark.parametrize("backend", BACKENDS)
def test_lost_peer_times_out_and_reset_recovers(tmp_path, base_seed, record_result, backend):
    rows = _run_ranks("_worker_lost_peer", 2, tmp_path, base_seed, record_result, 300, backend)
    assert len(rows) == 2 and all(r["passed"] and r["backend"] == backend for r in rows), rows


# ---- child side -------------------------------------------------------------------------------

def _child_setup(rank, world_size, init_file, backend, device_index):
    os.environ.update(ENV)
    import torch.distributed as dist
    if device_index is not None:
        torch.cuda.set_device(device_index)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    return dist


def _plan(rnd, i, T_max):
    T = [1, rnd.randint(2, 64), rnd.randint(129, T_max), T_max][i % 4]
    return dict(T=T, K=rnd.randint(1, 8), scale_kind=(None, "fp32", "dtype")[i % 3], shared=i % 2 == 0,
                weight_bias=(i // 2) % 2, rsf=1.0 if i % 3 == 1 else ref.f32(rnd.uniform(0.3, 2.5)),
                padded_rows=rnd.choice([0, 13]), drop_frac=rnd.choice([0.0, 0.2]),
                gs_factor=(1.0, rnd.uniform(0.05, 0.9), 3.0, 3e-6)[i % 4], pdl=rnd.random() < 0.5)


def _one_call(dist, ws, rank, dev, case, quant, gs_factor, pdl, program, data_group, label, fp8_case=0):
    """This rank's call, its full check, and the cross-process bit comparison. Returns failures.
    fp8_case picks the fp8_group128 options: scale layout row/column, power-of-two scales or not."""
    import dispatch
    W = len(case)
    r0 = ref.reference_for(case)
    fp8 = dict(fp8_scale_layout=("row", "column")[fp8_case % 2], fp8_pow2_scales=(fp8_case // 2) % 2 == 1)
    provided = ref.alloc_outputs(case, quant, extra_scale_bytes=16, fp8_scale_layout=fp8["fp8_scale_layout"])[rank]
    kw = dict(case[rank])
    kw.update(provided, quant=quant, program=program, launch_with_pdl=pdl)
    if quant == "fp8_group128":
        kw.update(fp8)
    gs_val = None
    if quant in ("nvfp4", "fp8_tensor"):
        amax = float(r0["norm_out"].abs().max())
        box = [ref.f32(ref.typical_global_scale(r0["norm_out"]) * gs_factor) if quant == "nvfp4"
               else ref.f32(max(amax, 1e-3) / ref.E4M3_MAX / gs_factor)]
        dist.broadcast_object_list(box, src=dist.get_global_rank(data_group, 0), group=data_group)
        gs_val = box[0]
        kw["global_scale" if quant == "nvfp4" else "fp8_scale"] = torch.tensor([gs_val], dtype=torch.float32,
                                                                                device=dev)
    # both processes must hold the same inputs (drawn on the CPU from one seed)
    fp = torch.stack([c["allreduce_in"].view(torch.int16).long().sum() for c in case]
                     + [case[0]["residual_in"].view(torch.int16).long().sum()]).to(dev)
    fps = [torch.empty_like(fp) for _ in range(W)]
    dist.all_gather(fps, fp, group=data_group)
    assert all(torch.equal(f, fps[0]) for f in fps), f"{label}: the processes built different inputs"
    out = dispatch.moe_finalize_allreduce(ws, **kw)
    torch.cuda.synchronize()
    dispatch.check()
    return _verify(dist, rank, case, r0, out, provided, quant, gs_val, fp8, data_group, label)


def _verify(dist, rank, case, r0, out, provided, quant, gs_val, fp8, data_group, label):
    """This rank's outputs against the reference r0, and bit for bit against the other ranks'
    (collective on data_group). Returns failures."""
    W = len(case)
    fails = []
    try:
        ref.check_outputs(case, {rank: out}, {rank: provided}, quant=quant, global_scale=gs_val, ref=r0,
                          label=label, **fp8)
    except AssertionError as e:
        fails.append(str(e))
    mine = [("residual_out", provided["residual_out"]), ("norm_out", provided["norm_out"])]
    if quant == "nvfp4":
        mine += [("quant_out", provided["quant_out"]),
                 ("scale_out", provided["scale_out"][: ref.scale_out_bytes(*provided["norm_out"].shape)])]
    elif quant is not None:
        mine += [("quant_out", provided["quant_out"])] + ([("scale_out", provided["scale_out"])]
                                                          if quant == "fp8_group128" else [])
    for name, t in mine:
        b = t.contiguous().view(torch.uint8).reshape(-1)
        allb = [torch.empty_like(b) for _ in range(W)]
        dist.all_gather(allb, b, group=data_group)
        for r in range(W):
            if not torch.equal(allb[r], allb[0]):
                fails.append(f"{label}: {name} of rank {r} differs from rank 0 in "
                             f"{int((allb[r] != allb[0]).sum())} bytes")
    return fails


def _write(out_dir, rank, rows):
    pathlib.Path(out_dir, f"rank{rank}.json").write_text(json.dumps(rows, default=str))


def _worker_sweep(rank, init_file, out_dir, base_seed, backend="ipc"):
    dist = _child_setup(rank, 2, init_file, "nccl", rank)
    import dispatch
    dev = torch.device("cuda", rank)
    rows, failures = [], []
    try:
        group = dist.new_group([0, 1])  # not the default group: the workspace must use this one
        for dname in gspec.DTYPES:
            dtype = ref.NAME_TO_DTYPE[dname]
            rnd = random.Random(f"{base_seed}:{dname}")  # the same plan in both processes
            hidden = rnd.choice([h for h in HIDDENS if h % 128 == 0])  # every profile, fp8_group128 too
            ws = dispatch.Workspace(group, MAX_TOKENS, hidden, dtype, timeout_s=10.0, backend=backend)
            assert ws.rank == rank and ws.world_size == 2 and ws.backend == backend, (ws.rank, ws.backend)
            try:
                for name in (n for n in WS2_PROGRAMS if gspec.parse(n).dtype == dname):
                    quant = gspec.PROFILE_QUANT[gspec.parse(name).profile]
                    row = dict(rank=rank, program=name, hidden=hidden, cases=0, seeds=[], mode="two processes",
                               backend=backend)
                    mine = []
                    for i in range(CASES_PER_PROGRAM):
                        p = _plan(rnd, i, MAX_TOKENS)
                        seed = rnd.getrandbits(62)
                        row["seeds"].append(seed)
                        case = ref.make_case(2, p["T"], hidden, p["K"], dtype, seed=seed, device=dev, gen_device="cpu",
                                             scale_kind=p["scale_kind"], shared=p["shared"], rsf=p["rsf"],
                                             weight_bias=p["weight_bias"], padded_rows=p["padded_rows"],
                                             drop_frac=p["drop_frac"])
                        mine += _one_call(dist, ws, rank, dev, case, quant, p["gs_factor"], p["pdl"], name, group,
                                          f"{name} rank {rank} case {i}", fp8_case=i)
                        row["cases"] += 1
                    row["passed"] = not mine
                    row["failures"] = mine[:5]
                    failures += mine
                    rows.append(row)
            finally:
                ws.close()
    finally:
        _write(out_dir, rank, rows)
    dist.barrier()
    dist.destroy_process_group()
    if failures:
        raise AssertionError(f"rank {rank}: {len(failures)} failures:\n" + "\n".join(failures[:10]))


def _worker_subgroup(rank, init_file, out_dir, base_seed, backend="ipc"):
    # global rank 0 takes no part in the workspace and never touches a GPU
    dist = _child_setup(rank, 3, init_file, "gloo", None if rank == 0 else rank - 1)
    group = dist.new_group([1, 2], backend="nccl")
    data_group = dist.new_group([1, 2], backend="nccl")
    rows, failures = [], []
    if rank != 0:
        import dispatch
        dev = torch.device("cuda", rank - 1)
        grank = rank - 1
        try:
            rnd = random.Random(f"{base_seed}:subgroup")
            dname = rnd.choice(gspec.DTYPES)
            dtype = ref.NAME_TO_DTYPE[dname]
            hidden = rnd.choice([h for h in HIDDENS if h % 128 == 0])  # every profile, fp8_group128 too
            ws = dispatch.Workspace(group, MAX_TOKENS, hidden, dtype, timeout_s=10.0, backend=backend)
            assert ws.rank == grank and ws.world_size == 2 and ws.backend == backend, (ws.rank, ws.backend)
            row = dict(rank=rank, program=f"auto ws2 {dname} on a subgroup ({backend})", hidden=hidden, cases=0,
                       backend=backend)
            try:
                for i in range(8):
                    p = _plan(rnd, i, MAX_TOKENS)
                    case = ref.make_case(2, p["T"], hidden, p["K"], dtype, seed=rnd.getrandbits(62), device=dev,
                                         gen_device="cpu", scale_kind=p["scale_kind"], shared=p["shared"],
                                         rsf=p["rsf"], weight_bias=p["weight_bias"])
                    failures += _one_call(dist, ws, grank, dev, case, rnd.choice(list(gspec.PROFILE_QUANT.values())),
                                          p["gs_factor"], p["pdl"], None, data_group, f"subgroup rank {rank} call {i}",
                                          fp8_case=i)
                    row["cases"] += 1
            finally:
                ws.close()
            row["passed"] = not failures
            row["failures"] = failures[:5]
            rows.append(row)
        finally:
            _write(out_dir, rank, rows)
    dist.barrier()  # the gloo default group, all three ranks
    dist.destroy_process_group()
    if failures:
        raise AssertionError(f"rank {rank}: " + "\n".join(failures[:10]))


def _worker_lost_peer(rank, init_file, out_dir, base_seed, backend="ipc"):
    dist = _child_setup(rank, 2, init_file, "nccl", rank)
    import dispatch
    dev = torch.device("cuda", rank)
    group = dist.new_group([0, 1])
    rnd = random.Random(f"{base_seed}:lost")
    dtype = torch.bfloat16
    hidden = 2048
    ws = dispatch.Workspace(group, 256, hidden, dtype, timeout_s=1.0, backend=backend)
    assert ws.backend == backend, ws.backend
    row = dict(rank=rank, program=f"lost peer ws2 ({backend})", cases=0, backend=backend)
    failures = []
    try:
        for T in (rnd.randint(1, 64), rnd.randint(65, 256)):  # one-shot and two-shot regimes
            case = ref.make_case(2, T, hidden, 4, dtype, seed=rnd.getrandbits(62), device=dev, gen_device="cpu")
            failures += _one_call(dist, ws, rank, dev, case, None, 1.0, False, None, group, f"before, T={T}")
            if rank == 0:  # rank 1 skips this call
                t0 = time.monotonic()
                dispatch.moe_finalize_allreduce(ws, **case[0])
                torch.cuda.synchronize()
                waited = time.monotonic() - t0
                try:
                    dispatch.check()
                    failures.append(f"T={T}: no timeout reported after rank 1 skipped a call")
                except RuntimeError as e:
                    if "rank 0" not in str(e) or "phase" not in str(e):
                        failures.append(f"T={T}: timeout error does not name rank 0 and the phase: {e}")
                if waited > 8.0:
                    failures.append(f"T={T}: rank 0 waited {waited:.1f} s on a 1 s deadline")
            ws.reset()  # collective
            case = ref.make_case(2, T, hidden, 4, dtype, seed=rnd.getrandbits(62), device=dev, gen_device="cpu")
            failures += _one_call(dist, ws, rank, dev, case, "nvfp4", 1.0, True, None, group, f"after reset, T={T}")
            row["cases"] += 3
    finally:
        row["passed"] = not failures
        row["failures"] = failures[:5]
        _write(out_dir, rank, [row])
        ws.close()
    dist.barrier()
    dist.destroy_process_group()
    if failures:
        raise AssertionError(f"rank {rank}: " + "\n".join(failures))


# ---- automatic selection across every regime boundary, eager and in CUDA graphs ------------------------

def _regime_sequence(bounds, rnd):
    """Token counts crossing every boundary b both ways (b - 1 -> b -> b - 1 and beyond), then random
    calls, most of them next to a boundary."""
    from test_gpu_correctness import crossing_sequence
    seq = []
    for b in bounds:
        seq += [b - 1, b, b - 1, min(REGIME_MAX_TOKENS, b + rnd.randint(0, 2)), max(1, b - 1 - rnd.randint(0, 2))]
    return seq + crossing_sequence(bounds, REGIME_MAX_TOKENS, REGIME_RANDOM_CALLS, rnd, 2)


def _gs_value(dist, group, r0, quant, factor):
    """The NVFP4 global scale of a call, rank 0's on both ranks (or None)."""
    if quant != "nvfp4":
        return None
    box = [ref.f32(ref.typical_global_scale(r0["norm_out"]) * factor)]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def _refresh(case, seed, dev):
    """Fresh random values (same shapes and options) copied into the case's tensors in place."""
    m = case.meta
    fresh = ref.make_case(2, m["tokens"], m["hidden"], m["top_k"], m["dtype"], seed=seed, device=dev,
                          gen_device="cpu", shared=m["shared"], scale_kind=m["scale_kind"], rsf=m["rsf"],
                          weight_bias=m["weight_bias"], padded_rows=m["padded_rows"], drop_frac=m["drop_frac"])
    for dst, src in zip(case, fresh):
        for k, v in dst.items():
            if isinstance(v, torch.Tensor):
                v.copy_(src[k])


def _worker_regimes(rank, init_file, out_dir, base_seed, backend):
    """Automatic selection: eager calls crossing every regime boundary of the workspace's tables both
    ways; then one CUDA graph per regime and PDL setting, captured after an eager warm-up call and
    replayed (interleaved, the same order on both ranks) with fresh inputs copied into its static
    tensors. Every output checked against the float64 reference and across the ranks."""
    dist = _child_setup(rank, 2, init_file, "nccl", rank)
    import dispatch
    from test_gpu_correctness import regime_boundaries
    dev = torch.device("cuda", rank)
    group = dist.new_group([0, 1])
    rnd = random.Random(f"{base_seed}:regimes:{backend}")  # the same plan in both processes
    dname = rnd.choice(gspec.DTYPES)
    dtype = ref.NAME_TO_DTYPE[dname]
    H = REGIME_HIDDEN
    # every program loaded before the first call: a rank compiling while its peer waits would time out
    dispatch.warmup([n for n in WS2_PROGRAMS if gspec.parse(n).dtype == dname], device_index=rank)
    ws = dispatch.Workspace(group, REGIME_MAX_TOKENS, H, dtype, timeout_s=10.0, backend=backend)
    eager = dict(rank=rank, program=f"auto ws2 {dname} across regimes, eager ({backend})", cases=0, backend=backend)
    graphs_row = dict(rank=rank, program=f"auto ws2 {dname} across regimes, CUDA graphs ({backend})", cases=0,
                      backend=backend)
    rows, failures = [eager, graphs_row], []
    try:
        assert ws.backend == backend, ws.backend
        bounds, _ = regime_boundaries(dispatch, ws, REGIME_MAX_TOKENS)
        assert bounds, "automatic selection never changes program over 1..max_tokens"
        seq = _regime_sequence(bounds, rnd)
        eager["boundaries"] = bounds
        for i, T in enumerate(seq):
            quant = rnd.choice(list(gspec.PROFILE_QUANT.values()))
            case = ref.make_case(2, T, H, rnd.randint(1, 8), dtype, seed=rnd.getrandbits(62), device=dev,
                                 gen_device="cpu", shared=rnd.random() < 0.7,
                                 scale_kind=rnd.choice([None, "fp32", "dtype"]), drop_frac=rnd.choice([0.0, 0.2]))
            gs_factor = (1.0, rnd.uniform(0.05, 0.9), 3.0, 3e-6)[i % 4]
            failures += _one_call(dist, ws, rank, dev, case, quant, gs_factor, rnd.random() < 0.5, None, group,
                                  f"{backend} eager call {i} T={T} (previous {seq[i - 1] if i else None})", fp8_case=i)
            eager["cases"] += 1
        # one graph per regime (a T between consecutive boundaries) and PDL setting
        edges = [1] + bounds + [REGIME_MAX_TOKENS + 1]
        token_counts = [rnd.randint(lo, hi - 1) for lo, hi in zip(edges, edges[1:])]
        graphs_row["token_counts"] = token_counts
        graphs = []
        for T in token_counts:
            for pdl in (False, True):
                quant = rnd.choice([None, "nvfp4", "fp8_group128"])
                fp8 = dict(fp8_scale_layout=rnd.choice(["row", "column"]), fp8_pow2_scales=rnd.random() < 0.5)
                case = ref.make_case(2, T, H, rnd.randint(1, 8), dtype, seed=rnd.getrandbits(62), device=dev,
                                     gen_device="cpu", shared=True, drop_frac=0.2, padded_rows=7)
                provided = ref.alloc_outputs(case, quant, extra_scale_bytes=16,
                                             fp8_scale_layout=fp8["fp8_scale_layout"])[rank]
                gs = torch.ones(1, dtype=torch.float32, device=dev)
                kw = dict(case[rank])
                kw.update(provided, quant=quant, program=None, launch_with_pdl=pdl)
                if quant == "nvfp4":
                    kw["global_scale"] = gs
                if quant == "fp8_group128":
                    kw.update(fp8)
                dispatch.moe_finalize_allreduce(ws, **kw)  # eager warm-up: builds the launcher
                torch.cuda.synchronize()
                dispatch.check()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    out = dispatch.moe_finalize_allreduce(ws, **kw)
                torch.cuda.synchronize()
                graphs.append(dict(graph=g, case=case, provided=provided, gs=gs, out=out, quant=quant, fp8=fp8,
                                   T=T, pdl=pdl))
        order = [i % len(graphs) for i in range(len(graphs) * REGIME_GRAPH_REPLAYS)]
        rnd.shuffle(order)
        for i, gi in enumerate(order):
            st = graphs[gi]
            _refresh(st["case"], rnd.getrandbits(62), dev)
            r0 = ref.reference_for(st["case"])
            gs_val = _gs_value(dist, group, r0, st["quant"], rnd.choice([1.0, 0.3, 3.0]))
            if gs_val is not None:
                st["gs"].fill_(gs_val)
            ref.repoison(st["provided"])
            torch.cuda.synchronize()
            st["graph"].replay()
            torch.cuda.synchronize()
            dispatch.check()
            failures += _verify(dist, rank, st["case"], r0, st["out"], st["provided"], st["quant"], gs_val, st["fp8"],
                                group, f"{backend} replay {i}: graph of T={st['T']} pdl={st['pdl']}")
            graphs_row["cases"] += 1
    finally:
        for r in rows:
            r["passed"] = not failures
            r["failures"] = failures[:5]
        _write(out_dir, rank, rows)
        ws.close()
    dist.barrier()
    dist.destroy_process_group()
    if failures:
        raise AssertionError(f"rank {rank}: {len(failures)} failures:\n" + "\n".join(failures[:10]))


# ---- the rendezvous: ranks that disagree, a constructor that fails on one rank --------------------------

MIB = 1 << 20
DISAGREE = {  # field: (rank 0's arguments, rank 1's); every rank must raise ValueError naming the field
    "dtype": (dict(dtype=torch.bfloat16), dict(dtype=torch.float16)),
    "hidden": (dict(hidden=2048), dict(hidden=4096)),
    "max_tokens": (dict(max_tokens=64), dict(max_tokens=128)),
    "oneshot_max_tokens": (dict(oneshot_max_tokens=32), dict(oneshot_max_tokens=16)),
    "vec_per_thread": (dict(vec_per_thread=None), dict(vec_per_thread=2)),
    "timeout_s": (dict(timeout_s=10.0), dict(timeout_s=0.0)),  # a deadline beside none
}
INJECTED = ("hostAlloc", "ipcOpenMemHandle", "out_of_memory")  # what fails on rank 1


def _ws_kwargs(**over):
    kw = dict(max_tokens=64, hidden=2048, dtype=torch.bfloat16, timeout_s=10.0, oneshot_max_tokens=None,
              vec_per_thread=None, backend="ipc")
    kw.update(over)
    return kw


def _build(group, kw):
    import dispatch
    kw = dict(kw)
    return dispatch.Workspace(group, kw.pop("max_tokens"), kw.pop("hidden"), kw.pop("dtype"), **kw)


def _free_memory(dev):
    import gc
    torch.cuda.synchronize(dev)
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(dev)[0]


def _disagreements(backend) -> dict:
    """DISAGREE, and with symmetric memory a rank asking for the other backend."""
    if backend == "ipc":
        return dict(DISAGREE)
    return dict(DISAGREE, backend=(dict(backend="symm_mem"), dict(backend="ipc")))


@pytest.mark.parametrize("backend", BACKENDS)
def test_ranks_that_disagree_are_refused_on_both(tmp_path, base_seed, record_result, backend):
    rows = _run_ranks("_worker_disagree", 2, tmp_path, base_seed, record_result, 300, backend)
    assert len(rows) == 2 and all(r["passed"] for r in rows), rows
    by_rank = {r["rank"]: r["messages"] for r in rows}
    assert set(by_rank[0]) == set(_disagreements(backend)) and by_rank[0] == by_rank[1], by_rank  # the same on both


def test_a_constructor_failing_on_one_rank_raises_on_both(tmp_path, base_seed, record_result):
    rows = _run_ranks("_worker_ctor_fails", 2, tmp_path, base_seed, record_result, timeout_s=300)
    assert len(rows) == 2 and all(r["passed"] for r in rows), rows
    by_rank = {r["rank"]: r["messages"] for r in rows}
    assert set(by_rank[0]) == set(INJECTED) and by_rank[0] == by_rank[1], by_rank


def _rendezvous_row(rank, what):
    return dict(kind="reliability", what=what, rank=rank, world_size=2, devices="two_gpus", calls=0,
                faults_injected=0, hostile_calls=0, messages={})


def _after_refusals(dist, group, rank, dev, base_seed, label, live0, free0, failures, row, backend="ipc"):
    """Nothing left allocated or registered, dispatch.check() works, and the group is still in step: a
    matching workspace builds and computes correct results."""
    import dispatch
    from dispatch import workspace as wsm
    free1 = _free_memory(dev)
    if abs(free0 - free1) >= 16 * MIB:
        failures.append(f"{label}: device memory {(free0 - free1) / MIB:.1f} MiB lower than before")
    if len(wsm._live_workspaces) != live0:
        failures.append(f"{label}: {len(wsm._live_workspaces) - live0} failed workspaces registered as live")
    dispatch.check()
    ws = _build(group, _ws_kwargs(backend=backend))
    try:
        rnd = random.Random(f"{base_seed}:{label}")
        case = ref.make_case(2, rnd.randint(1, 64), 2048, 4, torch.bfloat16, seed=rnd.getrandbits(62), device=dev,
                             gen_device="cpu")
        failures += _one_call(dist, ws, rank, dev, case, None, 1.0, False, None, group, f"{label}: a call after")
        row["calls"] += 1
    finally:
        ws.close()


def _worker_disagree(rank, init_file, out_dir, base_seed, backend="ipc"):
    dist = _child_setup(rank, 2, init_file, "nccl", rank)
    from dispatch import workspace as wsm
    dev = torch.device("cuda", rank)
    disagree = _disagreements(backend)
    row = _rendezvous_row(rank, f"Workspace ({backend}) over two GPUs, rank 1 passing another "
                                f"{' / '.join(disagree)} (timeout_s 0: no deadline)")
    row["backend"] = backend
    failures = []
    try:
        group = dist.new_group([0, 1])
        _build(group, _ws_kwargs(backend=backend)).close()  # communicators up: what follows times the exchange only
        live0, free0 = len(wsm._live_workspaces), _free_memory(dev)
        for field, (kw0, kw1) in disagree.items():
            kw = _ws_kwargs(backend=backend)
            kw.update(kw1 if rank == 1 else kw0)
            msg, fails, seconds = multiproc.expect_raise(lambda: _build(group, kw), ValueError,
                                                         f"{field}: rank 1 has", ("rank 0",), 20.0)
            row["messages"][field] = msg
            row["hostile_calls"] += 1
            failures += [f"{field}: {f}" for f in fails]
        _after_refusals(dist, group, rank, dev, base_seed, "disagree", live0, free0, failures, row, backend)
        # close() gives the device memory back (402 MB of buffers a rank here)
        free1 = _free_memory(dev)
        _build(group, _ws_kwargs(backend=backend, max_tokens=4096, hidden=8192)).close()
        free2 = _free_memory(dev)
        if abs(free1 - free2) >= 16 * MIB:
            failures.append(f"close(): device memory {(free1 - free2) / MIB:.1f} MiB lower than before the workspace")
        row["outcome"] = (f"{len(disagree)} disagreements, each the same ValueError naming the field on both "
                          f"ranks, nothing allocated; then a matching workspace correct; close() gave its memory back")
    except BaseException as e:
        failures.append(f"{type(e).__name__}: {e}"[:2000])
        raise
    finally:
        row["passed"] = not failures
        row["failures"] = failures[:8]
        _write(out_dir, rank, [row])
    dist.barrier()
    dist.destroy_process_group()
    if failures:
        raise AssertionError(f"rank {rank}: " + "\n".join(failures))


def _worker_ctor_fails(rank, init_file, out_dir, base_seed):
    dist = _child_setup(rank, 2, init_file, "nccl", rank)
    from cupy.cuda import runtime
    from dispatch import workspace as wsm
    dev = torch.device("cuda", rank)
    row = _rendezvous_row(rank, "Workspace over two GPUs, rank 1's constructor failing: pinned allocation, "
                                "CUDA IPC open, device out of memory")
    failures = []
    try:
        group = dist.new_group([0, 1])
        _build(group, _ws_kwargs()).close()  # communicators up
        live0 = len(wsm._live_workspaces)
        for case in INJECTED:
            free0 = _free_memory(dev)
            filler, saved = None, None
            # the out-of-memory case: 1.5 GiB of buffers a rank, and rank 1's GPU left with 256 MiB
            kw = _ws_kwargs(max_tokens=16384, hidden=8192) if case == "out_of_memory" else _ws_kwargs()
            step = ("opening the peers' buffers over CUDA IPC" if case == "ipcOpenMemHandle"
                    else "allocating the buffers")
            row["faults_injected"] += 1  # on rank 1; counted in both rows
            if rank == 1:
                if case == "out_of_memory":
                    filler = torch.empty(max(torch.cuda.mem_get_info(dev)[0] - 256 * MIB, 0), dtype=torch.uint8,
                                         device=dev)
                else:
                    saved = getattr(runtime, case)

                    def injected(*a, _case=case):
                        raise RuntimeError(f"{_case} failed (injected on rank 1)")
                    setattr(runtime, case, injected)
            try:
                msg, fails, seconds = multiproc.expect_raise(lambda: _build(group, kw), RuntimeError,
                                                             f"workspace: {step} failed on rank 1",
                                                             ("memory",) if case == "out_of_memory"
                                                             else ("injected",), 20.0)
            finally:
                if saved is not None:
                    setattr(runtime, case, saved)
                del filler
            row["messages"][case] = msg
            failures += [f"{case}: {f}" for f in fails]
            free1 = _free_memory(dev)
            if abs(free0 - free1) >= 16 * MIB:
                failures.append(f"{case}: device memory {(free0 - free1) / MIB:.1f} MiB lower than before")
        _after_refusals(dist, group, rank, dev, base_seed, "constructor failures", live0, _free_memory(dev),
                        failures, row)
        row["outcome"] = (f"{len(INJECTED)} failures on rank 1, each a RuntimeError naming the step and rank 1 on "
                          f"both ranks within 20 s, every allocation freed; then a workspace correct")
    except BaseException as e:
        failures.append(f"{type(e).__name__}: {e}"[:2000])
        raise
    finally:
        row["passed"] = not failures
        row["failures"] = failures[:8]
        _write(out_dir, rank, [row])
    dist.barrier()
    dist.destroy_process_group()
    if failures:
        raise AssertionError(f"rank {rank}: " + "\n".join(failures))

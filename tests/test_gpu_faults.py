"""A lost peer never hangs the job: every wait has a deadline, the error names rank and phase,
and a reset brings the world back to correct results in the same process. After a timeout, kernels
already queued and CUDA-graph replays write the poisoned output (NaN), never numbers computed from
inconsistent buffers; a buffer extent past 2^32 elements is cleared in full (issue 24)."""
import time

import pytest
import torch

from moe_ar_tools import reference as ref

pytestmark = pytest.mark.gpu

dispatch = pytest.importorskip("dispatch")


def _inputs(ws, T, K, seed, rank):
    """Rank-own expert rows and routing; residual and gamma replicated, as tensor parallelism has them."""
    g = torch.Generator(device="cpu").manual_seed(seed * 100 + rank)
    shared = torch.Generator(device="cpu").manual_seed(seed)
    H, D, dev = ws.hidden, ws.dtype, ws.device
    R = T * K
    idx = torch.randperm(R, generator=g).view(T, K).int()
    return dict(allreduce_in=torch.randn(R, H, generator=g).to(dev, D), expanded_idx_to_permuted_idx=idx.to(dev),
                residual_in=torch.randn(T, H, generator=shared).to(dev, D),
                norm_weight=(torch.randn(H, generator=shared) * 0.1 + 1).to(dev, D), eps=1e-6)


def _expected_residual(kws, D):
    """float64 of each rank's partial rounded to D, summed with the residual; a route whose row is
    outside allreduce_in adds nothing (the kernels skip it)."""
    s = 0
    for kw in kws:
        x = kw["allreduce_in"].double()
        idx = kw["expanded_idx_to_permuted_idx"].long()
        inside = (idx >= 0) & (idx < x.shape[0])
        rows = x[idx.clamp(0, x.shape[0] - 1)] * inside[..., None]
        s = s + rows.sum(1).to(D).double()
    return (s + kws[0]["residual_in"].double()).to(D)


def _assert_residual_close(out, expected, what):
    assert torch.equal(out, expected) or \
        (out.double() - expected.double()).abs().max().item() <= expected.double().abs().max().item() * 2 ** -7, what


@pytest.mark.parametrize("tokens", [3, 200])  # one-shot and two-shot regimes
def test_missing_rank_times_out_and_reset_recovers(tokens):
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    world = dispatch.EmulatedWorld(2, 256, 2048, torch.bfloat16, timeout_s=0.5)
    try:
        seed = int(time.time())
        kws = [_inputs(w, tokens, 4, seed, r) for r, w in enumerate(world.workspaces)]
        # Only rank 0 launches: it must give up after the deadline, not hang.
        t0 = time.perf_counter()
        dispatch.moe_finalize_allreduce(world.workspaces[0], **kws[0])
        torch.cuda.synchronize()
        waited = time.perf_counter() - t0
        assert waited < 5.0, f"rank 0 waited {waited:.1f} s for a 0.5 s deadline"
        with pytest.raises(RuntimeError, match=r"rank 0 timed out in phase"):
            dispatch.check()
        with pytest.raises(RuntimeError, match="reset"):  # the next call refuses too
            dispatch.moe_finalize_allreduce(world.workspaces[0], **kws[0])
        world.reset()
        outs = world.run(kws)
        torch.cuda.synchronize()
        world.check()
        expected = _expected_residual(kws, torch.bfloat16)
        for o in outs:
            _assert_residual_close(o.residual_out, expected, "wrong result after reset")
    finally:
        world.close()


# Each family reads the partials' rows its own way: the one-shot and the two-shot with register loads,
# the pipelined two-shot through its row ring (a skipped row there is a stage arrived on without bytes).
@pytest.mark.parametrize("family", ["oneshot", "twoshot", "twoshot_pipelined"])
def test_out_of_range_rows_are_skipped_and_reported(family):
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    H = 2048
    world = dispatch.EmulatedWorld(2, 16, H, torch.bfloat16, timeout_s=5.0)
    try:
        program = dispatch.registry.program_for(family, "bf16", 2, "plain")
        kws = [dict(_inputs(w, 4, 2, 7, r), program=program) for r, w in enumerate(world.workspaces)]
        for kw in kws:
            kw["expanded_idx_to_permuted_idx"][0, 0] = kw["allreduce_in"].shape[0] + 5  # outside allreduce_in
        outs = world.run(kws)
        torch.cuda.synchronize()
        # every rank reads each of its routes once: one skipped route is H / 8 skipped 16-byte loads
        reported = rf"routes had an expanded_idx_to_permuted_idx entry.*\({H // 8} 16-byte row loads"
        with pytest.raises(RuntimeError, match=reported):
            world.check()
        expected = _expected_residual(kws, torch.bfloat16)
        for o in outs:
            _assert_residual_close(o.residual_out, expected, f"{program}: the skipped route must add nothing")
    finally:
        world.close()


# ---- issue 24: extents past 2^32 elements; no wrong results after a timeout --------------------------
D = torch.bfloat16


def _sleep_cycles(seconds):
    """torch.cuda._sleep cycles lasting at least `seconds` at the GPU's highest clock (clock_rate when torch
    reports it, else 1.98 GHz, an H200's boost clock); a slower clock only makes the delay longer."""
    khz = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "clock_rate", 0) or 0
    return int(max(1.98e9, khz * 1e3) * seconds)


def _program(family, quant):
    from dispatch.op import profile_for_quant
    return dispatch.registry.program_for(family, "bf16", 2, profile_for_quant(quant))


def _case_call(world, T, seed, *, quant=None, program=None, K=4, pdl=False):
    """Every rank's kwargs for one call on fresh random inputs, with poisoned preallocated outputs."""
    dev = torch.device("cuda", world.devices[0])
    case = ref.make_case(world.world_size, T, world.hidden, K, world.dtype, seed=seed,
                         device=[torch.device("cuda", d) for d in world.devices], scale_kind="fp32", shared=True)
    layout = "column" if quant == "fp8_group128" else "row"
    provided = ref.alloc_outputs(case, quant, extra_scale_bytes=16, fp8_scale_layout=layout)
    kwargs = []
    for kw, p in zip(case, provided):
        d = dict(kw, **p, quant=quant, program=program, launch_with_pdl=pdl)
        if quant == "nvfp4":
            d["global_scale"] = torch.tensor([1.0], dtype=torch.float32, device=dev)
        if quant == "fp8_tensor":
            d["fp8_scale"] = torch.tensor([0.25], dtype=torch.float32, device=dev)
        if quant == "fp8_group128":
            d["fp8_scale_layout"] = layout
        kwargs.append(d)
    return dict(case=case, provided=provided, kwargs=kwargs, quant=quant, layout=layout)


def _check_correct(call, outs, label):
    quant = call["quant"]
    scale = {"nvfp4": 1.0, "fp8_tensor": 0.25}.get(quant)
    ref.check_outputs(call["case"], outs, call["provided"], quant=quant, global_scale=scale, label=label,
                      fp8_scale_layout=call["layout"])


def _timed_out_ranks(world):
    out = []
    for r, w in enumerate(world.workspaces):
        try:
            w.check()
        except RuntimeError as e:
            assert "timed out in phase" in str(e), str(e)
            out.append(r)
    return out


def test_buffer_extent_past_2_32_elements_is_cleared(seed_for):
    """Issue 24: world size 2, hidden 16384, max_tokens 131072. A two-shot call of 131072 tokens writes
    2^32 elements into its buffer; the next call must clear all of them (a 32-bit count of elements
    read 0, cleared nothing, and a later call on that buffer took stale data for a late peer's). Then
    small calls, one-shot and two-shot, each with one rank ~50 ms late, over two rotations of the
    three buffers, every output element checked against the float64 reference."""
    W, H, T_BIG = 2, 16384, 131072
    free, _ = torch.cuda.mem_get_info()
    if free < 80 * 2 ** 30:
        pytest.skip(f"needs about 80 GiB of free GPU memory, {free / 2 ** 30:.0f} GiB free")
    world = dispatch.EmulatedWorld(W, T_BIG, H, D, timeout_s=10.0, oneshot_max_tokens=min(T_BIG, 1024))
    try:
        assert world.workspaces[0].buffer_elems == 2 ** 32
        small = [(16, "oneshot"), (600, "twoshot"), (96, "oneshot"), (300, "twoshot_early"),
                 (40, "oneshot"), (500, "twoshot_pipelined"), (16, "oneshot")]
        dispatch.warmup(sorted({_program(f, None) for f in ["twoshot"] + [f for _, f in small]}))
        # The big call: every rank's partial of token t is row t of ones, the residual 0, gamma 1: residual_out
        # is exactly 2 and norm_out exactly 1 everywhere (2 * rsqrt(4 + eps) rounds to 1 in bf16).
        dev = world.workspaces[0].device
        ones = torch.ones(T_BIG, H, dtype=D, device=dev)
        idx = torch.arange(T_BIG, dtype=torch.int32, device=dev).view(T_BIG, 1)
        zeros = torch.zeros(T_BIG, H, dtype=D, device=dev)
        gamma = torch.ones(H, dtype=D, device=dev)
        outs = world.run([dict(allreduce_in=ones, expanded_idx_to_permuted_idx=idx, residual_in=zeros,
                               norm_weight=gamma, program=_program("twoshot", None)) for _ in range(W)])
        torch.cuda.synchronize()
        world.check()
        for r, o in enumerate(outs):
            assert [float(x) for x in torch.aminmax(o.residual_out.view(-1))] == [2.0, 2.0], f"rank {r} residual_out"
            assert [float(x) for x in torch.aminmax(o.norm_out.view(-1))] == [1.0, 1.0], f"rank {r} norm_out"
        del outs, ones, idx, zeros
        torch.cuda.empty_cache()
        for i, (T, family) in enumerate(small):
            late = i % W
            call = _case_call(world, T, seed_for(f"small{i}"), program=_program(family, None))
            with torch.cuda.stream(world.streams[late]):  # run() makes this stream wait, then launches on it
                torch.cuda._sleep(_sleep_cycles(0.05))
            outs = world.run(call["kwargs"])
            torch.cuda.synchronize()
            world.check()
            _check_correct(call, outs, f"call {i + 1} after the 131072-token call: T={T} {family}, rank {late} late")
    finally:
        world.close()


POISON_T = 37  # NVFP4 padding rows and FP8 column-major padding tokens (roundup(T, 4) = 40)
QUANTS = [None, "nvfp4", "fp8_group128", "fp8_tensor"]


def _prefill(call):
    """Values no healthy or poisoned call writes where they are checked: the poisoned output must replace them."""
    for p in call["provided"]:
        for name, t in p.items():
            if t.dtype in (torch.uint8, torch.float8_e4m3fn):
                t.view(torch.uint8).fill_(0x11 if name == "quant_out" else ref.POISON_BYTE)
            else:
                t.fill_(3.0)


def _assert_poisoned(call, what):
    """NaN in norm_out and residual_out; quant_out bytes 0x7F; NVFP4 scale bytes of the rows 0x7F, padding 0 and
    the bytes past it untouched; FP8-group scales of the rows NaN (column-major padding 0)."""
    quant, T = call["quant"], POISON_T
    H = call["case"].meta["hidden"]
    for r, p in enumerate(call["provided"]):
        tag = f"{what}, rank {r}"
        for name in ("norm_out", "residual_out"):
            n = int((~torch.isnan(p[name])).sum())
            assert n == 0, f"{tag}: {n} {name} elements are not NaN"
        if quant is None:
            continue
        q = p["quant_out"].view(torch.uint8)
        assert int((q != 0x7F).sum()) == 0, f"{tag}: quant_out bytes not 0x7F: {int((q != 0x7F).sum())}"
        s = p.get("scale_out")  # fp8_tensor writes no scales
        if quant == "nvfp4":
            n = ref.scale_out_bytes(T, H)
            rows = torch.zeros(n, dtype=torch.bool, device=s.device)
            rows[ref.swizzle_offsets(T, H, s.device).reshape(-1)] = True
            assert int((s[:n][rows] != 0x7F).sum()) == 0, f"{tag}: NVFP4 scale bytes of the rows not 0x7F"
            assert int((s[:n][~rows] != 0).sum()) == 0, f"{tag}: NVFP4 scale padding not 0"
            assert int((s[n:] != ref.POISON_BYTE).sum()) == 0, f"{tag}: bytes past the scales written"
        if quant == "fp8_group128":  # column-major [H/128, roundup(T, 4)]
            assert bool(torch.isnan(s[:, :T]).all()), f"{tag}: FP8 group scales of the rows not NaN"
            assert bool((s[:, T:] == 0).all()), f"{tag}: FP8 scale padding not 0"


@pytest.mark.parametrize("quant", QUANTS, ids=["plain", "nvfp4", "fp8_group128", "fp8_tensor"])
@pytest.mark.parametrize("family", ["oneshot", "twoshot", "twoshot_pipelined"])
def test_after_a_timeout_graph_replays_write_the_poisoned_output(family, quant, seed_for):
    """Issue 24: a CUDA graph of a normal call replays correctly; a graph in which rank 1 starts 0.5 s late
    (a sleep on its stream) under a 0.2 s deadline times out, and a call queued behind it (PDL) writes the
    poisoned output; then five replays of the normal graph write the poisoned output on every rank, in
    every element (no exchange on inconsistent buffers); the host still raises; after reset() the graph
    and an eager call are exactly correct again."""
    W, H, LATE = 2, 2048, 1
    world = dispatch.EmulatedWorld(W, 64, H, D, timeout_s=0.2, oneshot_max_tokens=64)
    try:
        program = _program(family, quant)
        call = _case_call(world, POISON_T, seed_for("call"), quant=quant, program=program)
        queued = _case_call(world, POISON_T, seed_for("queued"), quant=quant, program=program, pdl=True)
        outs = world.run(call["kwargs"])  # eager: compiles and loads the program
        torch.cuda.synchronize()
        world.check()
        _check_correct(call, outs, f"{program}: eager, before the graphs")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graph_outs = world.run(call["kwargs"])
        # Each rank on its own stream, the queued call right behind the first on it (no join between them),
        # rank LATE behind a 0.5 s sleep.
        late_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(late_graph):
            current = torch.cuda.current_stream()
            for s in world.streams:
                s.wait_stream(current)
            for r, (w, s) in enumerate(zip(world.workspaces, world.streams)):
                with torch.cuda.stream(s):
                    if r == LATE:
                        torch.cuda._sleep(_sleep_cycles(0.5))
                    dispatch.moe_finalize_allreduce(w, **call["kwargs"][r])
                    dispatch.moe_finalize_allreduce(w, **queued["kwargs"][r])
            for s in world.streams:
                current.wait_stream(s)
        torch.cuda.synchronize()
        for p in call["provided"]:
            ref.repoison(p)
        graph.replay()
        torch.cuda.synchronize()
        world.check()
        _check_correct(call, graph_outs, f"{program}: graph replay before the fault")

        _prefill(queued)
        late_graph.replay()
        torch.cuda.synchronize()
        assert 1 - LATE in _timed_out_ranks(world), "the rank on time must time out waiting for the late one"
        _assert_poisoned(queued, f"{program}: the call queued behind the timeout")
        for i in range(5):
            _prefill(call)
            graph.replay()
            torch.cuda.synchronize()
            _assert_poisoned(call, f"{program}: replay {i + 1} after the timeout")
        assert _timed_out_ranks(world) == [0, 1], "both ranks must report the timeout on the host"
        with pytest.raises(RuntimeError, match="reset"):
            world.run(call["kwargs"])

        world.reset()
        for p in call["provided"]:
            ref.repoison(p)
        graph.replay()
        torch.cuda.synchronize()
        world.check()
        _check_correct(call, graph_outs, f"{program}: graph replay after reset()")
        fresh = _case_call(world, POISON_T, seed_for("fresh"), quant=quant, program=program)
        outs = world.run(fresh["kwargs"])
        torch.cuda.synchronize()
        world.check()
        _check_correct(fresh, outs, f"{program}: eager call after reset()")
    finally:
        world.close()

"""A lost peer never hangs the job: every wait has a deadline, the error names rank and phase,
and a reset brings the world back to correct results in the same process."""
import time

import pytest
import torch

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

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
    s = 0
    for kw in kws:
        x = kw["allreduce_in"].double()
        s = s + x[kw["expanded_idx_to_permuted_idx"].long()].sum(1).to(D).double()
    return (s + kws[0]["residual_in"].double()).to(D)


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
            assert torch.equal(o.residual_out, expected) or \
                (o.residual_out.double() - expected.double()).abs().max().item() <= \
                expected.double().abs().max().item() * 2 ** -7, "wrong result after reset"
    finally:
        world.close()


def test_out_of_range_rows_are_skipped_and_reported():
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    world = dispatch.EmulatedWorld(2, 16, 2048, torch.bfloat16, timeout_s=5.0)
    try:
        kws = [_inputs(w, 4, 2, 7, r) for r, w in enumerate(world.workspaces)]
        for kw in kws:
            kw["expanded_idx_to_permuted_idx"][0, 0] = kw["allreduce_in"].shape[0] + 5  # outside allreduce_in
        outs = world.run(kws)
        torch.cuda.synchronize()
        with pytest.raises(RuntimeError, match="routes had an expanded_idx_to_permuted_idx entry"):
            world.check()
        assert torch.isfinite(outs[0].residual_out.float()).all()
    finally:
        world.close()

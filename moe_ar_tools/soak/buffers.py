"""The soak's preallocated buffers: two sets of max_tokens rows on rank 0's GPU (per-rank tensors
stacked), each rank's views of them, and the pinned counts of the cheap check."""
from __future__ import annotations

import torch

from dispatch.op import scale_out_bytes


SCALE_TAIL = 64  # bytes past the required scale length handed to the kernel, which must stay untouched
COUNTERS = ("residual_out", "norm_out", "cross_rank", "quant_out", "scale_out", "scale_padding", "scale_tail")


# The names of one call's buffers, as _BufferSet attributes and as keys of each rank's views.
_BUFFER_NAMES = ("allreduce_in", "shared", "residual_in", "idx", "scale_fp32", "scale_dtype", "global_scale",
                 "norm_out", "residual_out", "quant_out", "scale_out")


class _BufferSet:
    """One set of input and output buffers of max_tokens rows on rank 0's GPU (two alternate, so that
    a call's check can be read while the next call runs); per-rank tensors are stacked [W, ...]."""

    def __init__(self, soak, index: int):
        W, H, dtype, max_tokens, max_rows = soak.W, soak.H, soak.dtype, soak.max_tokens, soak.max_rows
        home = soak.home_device
        self.index = index
        nvfp4 = "nvfp4" in soak.quants
        scale_capacity = scale_out_bytes(max_tokens, H) + SCALE_TAIL

        def make(device, ranks=()):
            """The buffers on `device`; ranks=(W,) stacks the per-rank ones."""
            return dict(
                # row max_rows stays zero (dropped routes in the check), row max_rows + 1 is scratch
                allreduce_in=torch.zeros(*ranks, max_rows + 2, H, dtype=dtype, device=device),
                shared=torch.zeros(*ranks, max_tokens, H, dtype=dtype, device=device),
                residual_in=torch.zeros(max_tokens, H, dtype=dtype, device=device),
                idx=torch.zeros(max_rows, dtype=torch.int32, device=device),
                scale_fp32=torch.zeros(max_rows, dtype=torch.float32, device=device),
                scale_dtype=torch.zeros(max_rows, dtype=dtype, device=device),
                global_scale=torch.ones(1, dtype=torch.float32, device=device),
                norm_out=torch.zeros(*ranks, max_tokens, H, dtype=dtype, device=device),
                residual_out=torch.zeros(*ranks, max_tokens, H, dtype=dtype, device=device),
                quant_out=torch.zeros(*ranks, max_tokens, H // 2, dtype=torch.uint8, device=device) if nvfp4 else None,
                scale_out=torch.zeros(*ranks, scale_capacity, dtype=torch.uint8, device=device) if nvfp4 else None)

        for name, tensor in make(home, (W,)).items():
            setattr(self, name, tensor)
        per_rank = ("allreduce_in", "shared", "norm_out", "residual_out", "quant_out", "scale_out")
        self.rank_views = []        # [rank] -> {buffer name: the tensor that rank's call reads or writes}
        self.other_gpu_ranks = {}   # rank -> its own buffers, for a rank on another GPU than rank 0's
        for r, ws in enumerate(soak.world.workspaces):
            if ws.device == home:
                views = {name: getattr(self, name) for name in _BUFFER_NAMES}
                views.update({name: views[name][r] for name in per_rank if views[name] is not None})
            else:  # filled from the stacked buffers before each call, its outputs copied back after
                views = make(ws.device)
                self.other_gpu_ranks[r] = views
            views["device"] = ws.device
            self.rank_views.append(views)
        cuda = home.type == "cuda"
        self.host_counts = torch.zeros(len(COUNTERS), dtype=torch.int64, pin_memory=cuda)
        self.counts_ready = torch.cuda.Event() if cuda else None

"""One call of the soak and its checks: fresh inputs, the launch, the cheap per-element check on
the GPU, and the full check against the float64 reference."""
from __future__ import annotations

import math
import time
from typing import NamedTuple, Optional

import torch

from dispatch.op import scale_out_bytes
from moe_ar_tools import reference as ref
from moe_ar_tools.soak.buffers import COUNTERS, SCALE_TAIL
from moe_ar_tools.soak.sampling import DROP_FRAC, GS_LOG_RANGES, CallConfig
from moe_ar_tools.soak.state import SoakState


class _HungCall(Exception):
    """A call that did not finish within Soak.hang_s."""


class _CallRecord(NamedTuple):
    """What the checks of a launched call need to know about it."""
    index: int
    cfg: CallConfig
    rows: int       # allreduce_in rows the call was given
    n_scale: int    # NVFP4 scale bytes it must write (0 without NVFP4)
    mode: str       # "eager" or "graph"
    program: str


class _RankOutputs(NamedTuple):
    """MoeFinalizeOutputs-like view of one rank's outputs for the reference's check_outputs."""
    norm_out: torch.Tensor
    residual_out: torch.Tensor
    quant_out: Optional[torch.Tensor]
    scale_out: Optional[torch.Tensor]


class SoakCalls(SoakState):
    """One call of the soak: its inputs refilled and outputs poisoned, the launch (eager or a graph
    replay), the cheap check enqueued behind it, its counts read one call later, and the full check
    against the float64 reference."""

    # -- one call -------------------------------------------------------------------------------------------

    def _call_kwargs(self, bufs, cfg, rows, n_scale):
        """Every rank's keyword arguments of dispatch.moe_finalize_allreduce for this call."""
        T, K = cfg.tokens, cfg.top_k
        TK = T * K
        per_rank = []
        for r, views in enumerate(bufs.rank_views):
            kw = dict(allreduce_in=views["allreduce_in"][:rows],
                      expanded_idx_to_permuted_idx=views["idx"][:TK].view(T, K), residual_in=views["residual_in"][:T],
                      norm_weight=self.norm_weights[(str(views["device"]), cfg.weight_bias)], eps=cfg.eps,
                      weight_bias=cfg.weight_bias, routed_scaling_factor=cfg.rsf, launch_with_pdl=cfg.pdl,
                      norm_out=views["norm_out"][:T], residual_out=views["residual_out"][:T])
            if cfg.scale == "fp32":
                kw["expert_scale_factor"] = views["scale_fp32"][:TK].view(T, K)
            elif cfg.scale == "dtype":
                kw["expert_scale_factor"] = views["scale_dtype"][:TK].view(T, K)
            if cfg.shared == "all" or (cfg.shared == "rank0" and r == 0):
                kw["shared_expert_output"] = views["shared"][:T]
            if cfg.quant == "nvfp4":
                kw.update(quant="nvfp4", global_scale=views["global_scale"], quant_out=views["quant_out"][:T],
                          scale_out=views["scale_out"][:n_scale + SCALE_TAIL])
            per_rank.append(kw)
        return per_rank

    def _refill(self, bufs, cfg, rows, n_scale):
        """Fresh random inputs for the rows this call reads, poisoned outputs; returns the check's row
        index per (token, route) (dropped routes -> the zero row)."""
        T, K = cfg.tokens, cfg.top_k
        TK = T * K
        allreduce_in = bufs.allreduce_in
        allreduce_in[:, :rows].normal_(0.0, cfg.std)
        perm = torch.randperm(rows, device=self.home_device)
        route = perm[:TK]
        if cfg.drop:
            dropped = torch.rand(TK, device=self.home_device) < DROP_FRAC
            bufs.idx[:TK].copy_(torch.where(dropped, -1, route))
            route_rows = torch.where(dropped, self.max_rows, route)
            # rows no valid route reads are NaN: a kernel must never read them into a result
            allreduce_in.index_fill_(1, torch.where(dropped, route, self.max_rows + 1), math.nan)
        else:
            bufs.idx[:TK].copy_(route)
            route_rows = route
        if rows > TK:
            allreduce_in.index_fill_(1, perm[TK:], math.nan)
        if cfg.scale == "fp32":
            bufs.scale_fp32[:TK].uniform_(0.05, 1.0)
        elif cfg.scale == "dtype":
            bufs.scale_dtype[:TK].uniform_(0.05, 1.0)
        bufs.residual_in[:T].normal_(0.0, 1.5)
        if cfg.shared != "none":
            bufs.shared[:, :T].normal_(0.0, 0.5 * cfg.std)
            if cfg.shared == "rank0":
                bufs.shared[1:, :T].zero_()
        if cfg.quant == "nvfp4":
            lo, hi = GS_LOG_RANGES[cfg.gs_range]
            bufs.global_scale.uniform_(lo, hi).exp_()
        bufs.norm_out[:, :T].fill_(math.nan)
        bufs.residual_out[:, :T].fill_(math.nan)
        if cfg.quant == "nvfp4":
            bufs.quant_out[:, :T].fill_(ref.POISON_BYTE)
            bufs.scale_out[:, :n_scale + SCALE_TAIL].fill_(ref.POISON_BYTE)
        for r, rank_bufs in bufs.other_gpu_ranks.items():
            rank_bufs["allreduce_in"][:rows].copy_(allreduce_in[r, :rows])
            rank_bufs["idx"][:TK].copy_(bufs.idx[:TK])
            rank_bufs["residual_in"][:T].copy_(bufs.residual_in[:T])
            if cfg.scale == "fp32":
                rank_bufs["scale_fp32"][:TK].copy_(bufs.scale_fp32[:TK])
            elif cfg.scale == "dtype":
                rank_bufs["scale_dtype"][:TK].copy_(bufs.scale_dtype[:TK])
            if cfg.shared == "all":
                rank_bufs["shared"][:T].copy_(bufs.shared[r, :T])
            rank_bufs["norm_out"][:T].fill_(math.nan)
            rank_bufs["residual_out"][:T].fill_(math.nan)
            if cfg.quant == "nvfp4":
                rank_bufs["global_scale"].copy_(bufs.global_scale)
                rank_bufs["quant_out"][:T].fill_(ref.POISON_BYTE)
                rank_bufs["scale_out"][:n_scale + SCALE_TAIL].fill_(ref.POISON_BYTE)
        return route_rows

    def _enqueue_check(self, bufs, cfg, n_scale, route_rows):
        """The cheap check of the call just launched, on the GPU: counts of wrong elements per COUNTERS
        entry land in bufs.host_counts when bufs.counts_ready has passed."""
        T, K, dtype = cfg.tokens, cfg.top_k, self.dtype
        TK = T * K
        for r, rank_bufs in bufs.other_gpu_ranks.items():  # bring other GPUs' outputs home
            bufs.norm_out[r, :T].copy_(rank_bufs["norm_out"][:T])
            bufs.residual_out[r, :T].copy_(rank_bufs["residual_out"][:T])
            if cfg.quant == "nvfp4":
                bufs.quant_out[r, :T].copy_(rank_bufs["quant_out"][:T])
                bufs.scale_out[r, :n_scale + SCALE_TAIL].copy_(rank_bufs["scale_out"][:n_scale + SCALE_TAIL])
        scale = {"fp32": bufs.scale_fp32[:TK], "dtype": bufs.scale_dtype[:TK]}.get(cfg.scale)
        shared = bufs.shared[:, :T] if cfg.shared != "none" else None
        residual_expected, residual_tol = ref.residual_expectation(
            bufs.allreduce_in, route_rows, T, K, scale, cfg.rsf, shared, bufs.residual_in[:T], dtype)
        residual_outs, norm_outs = bufs.residual_out[:, :T], bufs.norm_out[:, :T]
        counts = [ref.count_bad(residual_outs[0], residual_expected, residual_tol)]
        norm_expected, norm_tol = ref.norm_expectation(
            residual_outs[0], self.norm_weights[(str(self.home_device), cfg.weight_bias)], cfg.eps, cfg.weight_bias,
            dtype)
        counts.append(ref.count_bad(norm_outs[0], norm_expected, norm_tol))
        if self.W > 1:
            cross_rank = (residual_outs[1:].view(torch.int16) != residual_outs[:1].view(torch.int16)).sum() + \
                (norm_outs[1:].view(torch.int16) != norm_outs[:1].view(torch.int16)).sum()
        else:
            cross_rank = self.zero
        if cfg.quant == "nvfp4":
            quant_outs = bufs.quant_out[:, :T]
            scale_outs = bufs.scale_out[:, :n_scale]
            quant_expected, sf8_expected = ref.nvfp4_blocks(norm_outs[0], bufs.global_scale)
            sf8 = scale_outs[0][self.offsets[:T * (self.H // 16)]]
            counts += [(quant_outs[0] != quant_expected).sum(), (sf8 != sf8_expected.reshape(-1)).sum(),
                       (scale_outs[0] != 0).sum() - (sf8 != 0).sum(),  # padding
                       (bufs.scale_out[:, n_scale:n_scale + SCALE_TAIL] != ref.POISON_BYTE).sum()]
            if self.W > 1:
                cross_rank = cross_rank + (quant_outs[1:] != quant_outs[:1]).sum() + \
                    (scale_outs[1:] != scale_outs[:1]).sum()
        else:
            counts += [self.zero] * 4
        counts.insert(2, cross_rank)
        stacked = torch.stack(counts)
        if self.cuda:
            bufs.host_counts.copy_(stacked, non_blocking=True)
            bufs.counts_ready.record(torch.cuda.current_stream(self.home_device))
        else:
            bufs.host_counts.copy_(stacked)

    def _one_call(self, bufs, cfg, mode, index, graph=None, kwargs=None):
        T, K = cfg.tokens, cfg.top_k
        rows = T * K + cfg.padded_rows
        n_scale = scale_out_bytes(T, self.H) if cfg.quant == "nvfp4" else 0
        route_rows = self._refill(bufs, cfg, rows, n_scale)
        if mode == "graph":
            graph.replay()
        else:
            self.world.run(kwargs if kwargs is not None else self._call_kwargs(bufs, cfg, rows, n_scale))
        self._enqueue_check(bufs, cfg, n_scale, route_rows)
        name, family = self._select(T, cfg.quant, cfg.shared != "none")
        self._count(cfg, mode, name, family)
        return _CallRecord(index, cfg, rows, n_scale, mode, name)

    def _count(self, cfg, mode, name, family):
        stats = self.stats
        stats["calls"] += 1
        stats["graph_calls" if mode == "graph" else "eager_calls"] += 1
        stats["pdl_calls"] += cfg.pdl
        for key, val in (("quant_calls", str(cfg.quant).lower()), ("shared_modes", cfg.shared),
                         ("scale_kinds", cfg.scale), ("regimes", family), ("programs", name),
                         ("top_k", str(cfg.top_k))):
            stats[key][val] = stats[key].get(val, 0) + 1
        stats["dropped_route_calls"] += cfg.drop
        stats["padded_calls"] += cfg.padded_rows > 0
        T = cfg.tokens
        self.tokens_seen[T] = self.tokens_seen.get(T, 0) + 1
        if self.prev_T is not None:
            for quant, bounds in self.bounds.items():
                for bound in bounds:
                    crossing = self.crossings.setdefault(f"{str(quant).lower()}@{bound}", {"up": 0, "down": 0})
                    if self.prev_T < bound <= T:
                        crossing["up"] += 1
                    elif T < bound <= self.prev_T:
                        crossing["down"] += 1
        self.prev_T = T

    # -- results -----------------------------------------------------------------------------------------------

    def _wait(self, event):
        if event is None or event.query():
            return
        t0 = time.monotonic()
        spins = 0
        while not event.query():
            spins += 1
            if spins > 2000:
                time.sleep(2e-5)
            if time.monotonic() - t0 > self.hang_s:
                raise _HungCall(f"a call did not finish within {self.hang_s:g} s")

    def _finish(self, bufs, record):
        """Read the cheap check's counts of `record` (on `bufs`); a failing call gets a full check."""
        self._wait(bufs.counts_ready)
        counts = [int(v) for v in bufs.host_counts.tolist()]
        bad = sum(counts)
        if bad:
            stats = self.stats
            stats["wrong_elements"] += bad
            stats["wrong_calls"] += 1
            for counter, n in zip(COUNTERS, counts):
                stats["wrong_by_output"][counter] += n
            if len(self.failures) < 20:
                self.failures.append(dict(call=record.index, mode=record.mode, program=record.program,
                                          config=record.cfg._asdict(), rows=record.rows,
                                          wrong={counter: n for counter, n in zip(COUNTERS, counts) if n}))
            self._full_check(bufs, record, reason="cheap check failed")

    def _full_check(self, bufs, record, reason="sample"):
        """The call in full against the float64 reference (ref.check_outputs)."""
        cfg = record.cfg
        T, K, H = cfg.tokens, cfg.top_k, self.H
        TK = T * K
        scale = {"fp32": bufs.scale_fp32[:TK], "dtype": bufs.scale_dtype[:TK]}.get(cfg.scale)
        ranks = []
        for r in range(self.W):
            has_shared = cfg.shared == "all" or (cfg.shared == "rank0" and r == 0)
            ranks.append(dict(
                allreduce_in=bufs.allreduce_in[r, :record.rows], expanded_idx_to_permuted_idx=bufs.idx[:TK].view(T, K),
                expert_scale_factor=None if scale is None else scale.view(T, K), routed_scaling_factor=cfg.rsf,
                shared_expert_output=bufs.shared[r, :T] if has_shared else None, residual_in=bufs.residual_in[:T],
                norm_weight=self.norm_weights[(str(self.home_device), cfg.weight_bias)], eps=cfg.eps,
                weight_bias=cfg.weight_bias))
        meta = dict(seed=f"soak call {record.index}", world_size=self.W, tokens=T, hidden=H, top_k=K,
                    dtype=self.dtype, padded_rows=cfg.padded_rows, drop_frac=DROP_FRAC if cfg.drop else 0.0,
                    scale_kind=None if cfg.scale == "none" else cfg.scale, shared=cfg.shared, rsf=cfg.rsf,
                    weight_bias=cfg.weight_bias, eps=cfg.eps)
        case = ref.Case(ranks, meta)
        nvfp4 = cfg.quant == "nvfp4"
        outs = [_RankOutputs(bufs.norm_out[r, :T], bufs.residual_out[r, :T], bufs.quant_out[r, :T] if nvfp4 else None,
                             bufs.scale_out[r, :record.n_scale] if nvfp4 else None) for r in range(self.W)]
        global_scale = float(bufs.global_scale.float().cpu()[0]) if nvfp4 else None
        try:
            ref.check_outputs(case, outs, quant=cfg.quant, global_scale=global_scale, nvfp4_device=self.home_device,
                              label=f"soak call {record.index} ({record.mode}, {record.program}, {reason})")
        except AssertionError as e:
            self.stats["full_check_failures"] += 1
            if len(self.failures) < 40:
                self.failures.append(dict(call=record.index, mode=record.mode, program=record.program,
                                          full_check=str(e)[:3000]))
        self.stats["full_checks"] += 1

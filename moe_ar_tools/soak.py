"""Soak: many calls in an emulated world, random token counts across every regime, every output checked.

    moe-ar-soak --world-size 4 --calls 100000 --time-budget-s 300 --out soak-ws4.json
    moe-ar-soak --world-size 2 --devices 0,1 --calls 100000 --out soak-ws2-2gpu.json
    (or python -m moe_ar_tools.soak ...)

Every call draws a token count T (log-uniform over 1..max_tokens, near a regime boundary of the
selection table, special values, or uniform), top_k, padded and dropped routes, expert scales
(none, float32, dtype), a shared expert (none, every rank, rank 0 only), the output profile
(plain or NVFP4, the global scale a device tensor), PDL on or off, and either an eager
`world.run` or the replay of a CUDA graph captured once per (T bucket, options) with static
buffers refilled with fresh random values before each replay. Graphs are captured only in
single-device worlds (EmulatedWorld.run's contract); a world spread over GPUs runs eager calls
only, and the JSON says so.

Inputs live in preallocated buffers of max_tokens rows; each call refills the rows it uses with
torch's GPU generator (no CPU work per element), poisons its outputs (NaN, 0xAB bytes) and, on
the GPU, right behind the kernels:

* residual_out of rank 0 against the precision contract, element by element: each rank's partial
  is recomputed in float32 and rounded to the dtype, the rounded partials plus residual_in are
  summed in float64, and the tolerance is derived from the contract (float32 accumulation in the
  kernel, one rounding of each partial, one of the sum: the reference's `residual_expectation`);
* norm_out of rank 0 against the float64 RMSNorm of its own residual_out (`norm_expectation`);
* NVFP4: quant_out and the swizzled scale bytes of rank 0 exactly equal to the rule of docs/operation.md applied to
  its own norm_out (`nvfp4_blocks`), scale padding zero, the bytes past the required scale
  length untouched;
* every output of every rank bit-identical to rank 0's (which also proves every element written).

The counts are copied to pinned host memory and read one call later (two buffer slots
alternate), so the CPU never waits for the GPU of the call it just launched. Every
`--full-check-every` calls, and on any call whose cheap check fails, the float64 reference's
check_outputs (moe_ar_tools/reference.py, per-element brackets) checks the call in full.
`world.check()` runs every `--check-every` calls and at the end: a peer-wait timeout is counted and
the world reset.
A call that does not finish within max(60 s, 5 deadlines) is a hang: recorded, and the process
exits with status 3 after writing the JSON.

Exit status: 0 when no element was wrong, no full check failed, no timeout and no hang; 1
otherwise; 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import platform
import random
import socket
import sys
import time
from typing import NamedTuple, Optional

import torch

from dispatch.op import scale_out_bytes
from moe_ar_tools import reference as ref
from moe_ar_tools.provenance import git_commit

SCALE_TAIL = 64  # bytes past the required scale length handed to the kernel, which must stay untouched
DROP_FRAC = 0.2
COUNTERS = ("residual_out", "norm_out", "cross_rank", "quant_out", "scale_out", "scale_padding", "scale_tail")
# (probability) log-uniform, near a regime boundary, special value, uniform
DEFAULT_MIX = (0.45, 0.30, 0.10, 0.15)
GS_LOG_RANGES = {  # natural-log ranges of the NVFP4 global scale (norm_out is O(1): typical is ~2688/amax)
    "typical": (math.log(150.0), math.log(1500.0)),
    "small": (math.log(1e-3), math.log(1.0)),     # zero and subnormal E4M3 block scales
    "large": (math.log(1e4), math.log(1e6)),      # block scales saturating at 448
}

# ---- what to call: token counts, regimes, options (pure Python) ----------------------------------------

def regime_boundaries(select, max_tokens: int, quants, shared_options=(False, True)) -> dict:
    """quant -> sorted token counts T (2..max_tokens) where select(T, quant, shared) differs from
    select(T - 1, quant, shared) for some shared option: the first T of each new regime."""
    out = {}
    for quant in quants:
        bounds = set()
        for shared in shared_options:
            prev = select(1, quant, shared)
            for T in range(2, max_tokens + 1):
                cur = select(T, quant, shared)
                if cur != prev:
                    bounds.add(T)
                prev = cur
        out[quant] = sorted(bounds)
    return out


def regime_ranges(bounds, max_tokens: int) -> list:
    """[(lo, hi)] inclusive token ranges of the regimes between the boundaries."""
    edges = [1] + [b for b in sorted(bounds) if 1 < b <= max_tokens] + [max_tokens + 1]
    return [(lo, hi - 1) for lo, hi in zip(edges, edges[1:]) if lo <= hi - 1]


class TokenSampler:
    """T for a call: log-uniform over 1..max_tokens, near a regime boundary (b - 3 .. b + 2), a special
    value (1, W - 1, W, W + 1, max_tokens, ...), or uniform; `mix` gives the four probabilities."""

    def __init__(self, max_tokens: int, boundaries: dict, world_size: int, rnd: random.Random,
                 mix=DEFAULT_MIX):
        if max_tokens < 1:
            raise ValueError(f"max_tokens: {max_tokens}")
        self.max_tokens = max_tokens
        self.boundaries = {q: sorted(b) for q, b in boundaries.items()}
        self.specials = sorted({t for t in (1, 2, world_size - 1, world_size, world_size + 1, max_tokens - 1,
                                            max_tokens) if 1 <= t <= max_tokens})
        self.rnd = rnd
        total = float(sum(mix))
        acc, self.cum = 0.0, []  # cumulative probabilities of the four kinds of draw
        for share in mix:
            acc += share / total
            self.cum.append(acc)
        self.log_max = math.log(max_tokens + 1)

    def draw(self, quant=None) -> int:
        rnd = self.rnd
        kind = rnd.random()
        bounds = self.boundaries.get(quant) or []
        if kind < self.cum[0]:
            T = int(math.exp(rnd.random() * self.log_max))
        elif kind < self.cum[1] and bounds:
            T = rnd.choice(bounds) + rnd.randint(-3, 2)
        elif kind < self.cum[2]:
            T = rnd.choice(self.specials)
        else:
            T = rnd.randint(1, self.max_tokens)
        return min(max(T, 1), self.max_tokens)


def graph_token_counts(bounds, max_tokens: int, rnd: random.Random) -> list:
    """Token counts to capture graphs at: each regime's first and last T and one inside it."""
    out = set()
    for lo, hi in regime_ranges(bounds, max_tokens):
        out.update((lo, hi, rnd.randint(lo, hi)))
    return sorted(out)


class CallConfig(NamedTuple):
    tokens: int
    top_k: int
    padded_rows: int
    drop: bool            # some routes dropped (index -1)
    scale: str            # expert_scale_factor: "none", "fp32", "dtype"
    shared: str           # shared_expert_output: "none", "all" ranks, "rank0" only
    quant: Optional[str]  # None or "nvfp4"
    pdl: bool
    rsf: float
    weight_bias: int
    eps: float
    std: float            # standard deviation of allreduce_in (and half of it for the shared expert)
    gs_range: str         # key of GS_LOG_RANGES


def draw_config(rnd: random.Random, quant, tokens: int, max_rows: int) -> CallConfig:
    """Random options for one call of `tokens` tokens; allreduce_in rows (T*K + padding) stay <= max_rows."""
    K = rnd.randint(1, 8)
    if rnd.random() < 0.05 and tokens * 16 + 16 <= max_rows:
        K = rnd.randint(9, 16)
    K = max(1, min(K, max_rows // tokens))
    pad = 0 if rnd.random() < 0.7 else rnd.randint(1, 16)
    pad = max(0, min(pad, max_rows - tokens * K))
    return CallConfig(
        tokens=tokens, top_k=K, padded_rows=pad, drop=rnd.random() < 0.25,
        scale=rnd.choice(("none", "fp32", "dtype")), shared=rnd.choice(("none", "all", "rank0")), quant=quant,
        pdl=rnd.random() < 0.5, rsf=1.0 if rnd.random() < 0.5 else ref.f32(rnd.uniform(0.5, 2.0)),
        weight_bias=rnd.randint(0, 1), eps=rnd.choice((1e-6, 1e-5)),
        std=rnd.choice((1.0, 1.0, 1.0, 1.0, 1.0, 0.05, 8.0)),
        gs_range=rnd.choice(("typical",) * 6 + ("small", "large")))


# ---- command line ------------------------------------------------------------------------------------

def parse_devices(spec, world_size: int):
    """'0,1' -> each rank's GPU index, repeated to world_size entries (0,1 for 4 ranks: 0,1,0,1);
    None or '' -> None (every rank on the current GPU)."""
    if spec is None or str(spec).strip() == "":
        return None
    try:
        devs = [int(x) for x in str(spec).split(",") if x.strip() != ""]
    except ValueError:
        raise ValueError(f"devices: {spec!r} is not a comma-separated list of GPU indices") from None
    if not devs or any(d < 0 for d in devs):
        raise ValueError(f"devices: {spec!r} is not a comma-separated list of GPU indices")
    if len(devs) > world_size:
        raise ValueError(f"devices: {len(devs)} entries for world size {world_size}")
    return [devs[r % len(devs)] for r in range(world_size)]


def parse_quants(spec: str) -> list:
    out = []
    for q in str(spec).split(","):
        q = q.strip().lower()
        if q in ("none", "plain"):
            out.append(None)
        elif q == "nvfp4":
            out.append("nvfp4")
        else:
            raise ValueError(f"quants: {q!r} (use none and/or nvfp4)")
    if not out:
        raise ValueError("quants: empty")
    return list(dict.fromkeys(out))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-ar-soak", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--world-size", type=int, required=True, help="ranks of the emulated world (2, 4 or 8)")
    add("--devices", default=None,
        help="each rank's GPU, comma separated, repeated to the world size (default: all on GPU 0)")
    add("--calls", type=int, default=100_000, help="calls to make, fewer if the time budget ends first (100000)")
    add("--time-budget-s", type=float, default=600.0, help="start no call after this many seconds (600)")
    add("--out", default=None, help="JSON result path (default: print it)")
    add("--dtype", choices=sorted(ref.NAME_TO_DTYPE), default="bf16", help="(bf16)")
    add("--hidden", type=int, default=2048, help="(2048)")
    add("--max-tokens", type=int, default=None,
        help="default: max(2048, the last regime boundary of the selection table + 255, rounded to 128)")
    add("--oneshot-max-tokens", type=int, default=None, help="the workspaces' one-shot capacity")
    add("--quants", default="none,nvfp4", help="output profiles to draw from (none,nvfp4)")
    add("--graph-fraction", type=float, default=0.5,
        help="share of calls replayed from CUDA graphs, single-device worlds only (0.5)")
    add("--graph-configs-per-bucket", type=int, default=1,
        help="captured option sets per (regime T bucket, profile, PDL) (1)")
    add("--full-check-every", type=int, default=200,
        help="full check against the float64 reference every N calls (200)")
    add("--check-every", type=int, default=1000, help="world.check() (timeouts) every N calls (1000)")
    add("--timeout-s", type=float, default=10.0, help="the workspaces' peer-wait deadline (10)")
    add("--seed", type=int, default=None, help="default: fresh (recorded in the JSON)")
    add("--no-progress", action="store_true", help="no progress bar / lines")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.world_size < 2:
            raise ValueError(f"world-size: {args.world_size}")
        args.device_list = parse_devices(args.devices, args.world_size)
        args.quant_list = parse_quants(args.quants)
        if args.calls < 1:
            raise ValueError(f"calls: {args.calls} < 1")
        if args.hidden <= 0 or args.hidden % 16:
            raise ValueError(f"hidden: {args.hidden} must be a positive multiple of 16")
        if args.max_tokens is not None and args.max_tokens < 1:
            raise ValueError(f"max-tokens: {args.max_tokens}")
        if not 0.0 <= args.graph_fraction <= 1.0:
            raise ValueError(f"graph-fraction: {args.graph_fraction} not in [0, 1]")
        if args.full_check_every < 1 or args.check_every < 1 or args.graph_configs_per_bucket < 1:
            raise ValueError("full-check-every, check-every and graph-configs-per-bucket must be >= 1")
    except ValueError as e:
        parser.error(str(e))
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(2 ** 62)
    return args


def default_max_tokens(bounds: list) -> int:
    """max(2048, last boundary + 255) rounded up to a multiple of 128, so that every regime of every
    profile of the workspace's selection (`bounds`: {ladder field: tokens} per profile,
    dispatch.table_sets.Selection.limits) is reachable."""
    from dispatch import registry
    last = max([1] + [int(value) + 1 for row in bounds for value in row.values()
                      if int(value) < registry.program_set().all_tokens])
    need = last + 255
    return max(2048, -(-need // 128) * 128)


# ---- machine and commit ----------------------------------------------------------------------------------

def machine_info() -> dict:
    info = {"hostname": socket.gethostname(), "python": platform.python_version(), "torch": torch.__version__}
    try:
        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            info.update(gpu=torch.cuda.get_device_name(0), gpus=n,
                        gpu_names=[torch.cuda.get_device_name(i) for i in range(n)], cuda=torch.version.cuda)
        else:
            info.update(gpu=None, gpus=0)
    except Exception as e:  # noqa: BLE001 - the record must not break the run
        info["gpu_error"] = str(e)
    return info


# ---- the soak --------------------------------------------------------------------------------------------

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


class Soak:
    def __init__(self, args, world=None, log=print):
        import dispatch
        from dispatch import registry
        self.args = args
        self.log = log
        self.dispatch = dispatch
        self.rnd = random.Random(args.seed)
        torch.manual_seed(args.seed & (2 ** 63 - 1))
        self.dtype = ref.NAME_TO_DTYPE[args.dtype]
        self.W, self.H = args.world_size, args.hidden
        self.quants = list(args.quant_list)
        if args.max_tokens:
            self.max_tokens = args.max_tokens
        else:  # the selection the world will have (rank 0's GPU, or the one a given world is on)
            from dispatch import table_sets
            device = (world.workspaces[0].device.index if world is not None else
                      (args.device_list or [None])[0])
            if device is None:
                device = torch.cuda.current_device() if torch.cuda.is_available() else 0
            selection = table_sets.for_workspace(args.dtype, self.W, self.H, self.dtype.itemsize, device)
            self.max_tokens = default_max_tokens([selection.limits(profile) for profile in selection.cells])
        self.max_rows = self.max_tokens * 8 + 16
        self.own_world = world is None
        if world is None:
            world = dispatch.EmulatedWorld(self.W, self.max_tokens, self.H, self.dtype, devices=args.device_list,
                                           timeout_s=args.timeout_s, oneshot_max_tokens=args.oneshot_max_tokens)
        self.world = world
        self.rank0_workspace = world.workspaces[0]
        # rank 0's device: the stacked buffers, the checks, events and graph captures live there
        self.home_device = self.rank0_workspace.device
        self.cuda = self.home_device.type == "cuda"
        if self.cuda:
            torch.cuda.set_device(self.home_device)
        self.rank_devices = [ws.device for ws in world.workspaces]
        self.single_device = len({str(d) for d in self.rank_devices}) == 1
        self.graphs_enabled = self.cuda and self.single_device and args.graph_fraction > 0
        if not self.single_device:
            self.graph_note = (f"eager calls only: this world spans devices {[str(d) for d in self.rank_devices]}, "
                               f"and EmulatedWorld.run is capturable in CUDA graphs for single-device worlds only")
        elif not self.cuda:
            self.graph_note = "eager calls only: no CUDA device"
        elif args.graph_fraction <= 0:
            self.graph_note = "eager calls only: --graph-fraction 0"
        else:
            self.graph_note = f"{args.graph_fraction:.0%} of calls replayed from CUDA graphs"
        self.hang_s = max(60.0, 5.0 * float(args.timeout_s))
        self._select_cache = {}
        self.bounds = regime_boundaries(lambda T, quant, shared: self._select(T, quant, shared)[0], self.max_tokens,
                                        self.quants)
        self.sampler = TokenSampler(self.max_tokens, self.bounds, self.W, self.rnd)
        # NVFP4 scale offsets of max_tokens rows: the first T rows' are T's (the layout does not depend on T)
        self.offsets = ref.swizzle_offsets(self.max_tokens, self.H, device=self.home_device).reshape(-1)
        self.norm_weights = {}  # (device, weight_bias) -> the norm_weight every rank on that device reads
        for weight_bias in (0, 1):
            weights = self._random_norm_weight(weight_bias)
            for d in self._distinct_devices():
                self.norm_weights[(str(d), weight_bias)] = weights if str(d) == str(self.home_device) else weights.to(d)
        self.zero = torch.zeros((), dtype=torch.int64, device=self.home_device)
        self.buffer_sets = [_BufferSet(self, 0), _BufferSet(self, 1)]
        self.graph_configs = self._graph_configs() if self.graphs_enabled else []
        self.graphs = {}
        self.stats = dict(calls=0, eager_calls=0, graph_calls=0, pdl_calls=0, graphs_captured=0,
                          quant_calls={}, shared_modes={}, scale_kinds={}, dropped_route_calls=0, padded_calls=0,
                          regimes={}, programs={}, top_k={}, wrong_elements=0, wrong_by_output={c: 0 for c in COUNTERS},
                          wrong_calls=0, full_checks=0, full_check_failures=0, timeouts=0, world_checks=0, hangs=0)
        self.failures = []
        self.timeout_messages = []
        self.tokens_seen = {}
        self.crossings = {}
        self.prev_T = None
        self.warmup_seconds = 0.0

    # -- selection -------------------------------------------------------------------------------------

    def _select(self, T, quant, has_shared):
        key = (T, quant, bool(has_shared))
        got = self._select_cache.get(key)
        if got is None:
            name = self.dispatch.select_program(self.rank0_workspace, T, quant, bool(has_shared))
            got = self._select_cache[key] = (name, self.dispatch.program_info(name)["family"])
        return got

    def _graph_configs(self):
        cfgs = []
        for q in self.quants:
            for T in graph_token_counts(self.bounds[q], self.max_tokens, self.rnd):
                for pdl in (False, True):
                    for _ in range(self.args.graph_configs_per_bucket):
                        cfgs.append(draw_config(self.rnd, q, T, self.max_rows)._replace(pdl=pdl))
        return cfgs

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

    def _distinct_devices(self):
        """Each device some rank runs on, once."""
        return list({str(d): d for d in self.rank_devices}.values())

    def _sync(self):
        if self.cuda:
            for d in self._distinct_devices():
                torch.cuda.synchronize(d)

    def _world_check(self):
        self.stats["world_checks"] += 1
        try:
            self.world.check()
        except RuntimeError as e:
            self._record_error(e)

    def _record_error(self, e):
        msg = str(e)
        if "timed out" in msg:
            self.stats["timeouts"] += 1
        else:
            self.stats["wrong_calls"] += 1
            if len(self.failures) < 40:
                self.failures.append(dict(error=msg[:2000]))
        if len(self.timeout_messages) < 10:
            self.timeout_messages.append(msg[:500])
        self._sync()
        self.world.reset()

    def _capture(self, kwargs):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.world.run(kwargs)
        torch.cuda.synchronize(self.home_device)
        self.stats["graphs_captured"] += 1
        return graph

    def _warmup(self):
        if not self.cuda:
            return
        t0 = time.perf_counter()
        names = sorted({name for name, _family in self._select_cache.values()})  # every program selection can pick
        for d in self._distinct_devices():
            self.dispatch.warmup(names, device_index=d.index)
        self.warmup_seconds = time.perf_counter() - t0

    # -- the loop ------------------------------------------------------------------------------------------------

    def run(self) -> dict:
        args = self.args
        self._warmup()
        progress = _CallProgress(args.calls, enabled=not args.no_progress, log=self.log)
        t_start = time.monotonic()
        stopped_by = "calls"
        hang = error = None
        next_check = args.check_every
        calls_made = 0
        pending = None  # (buffers, record) of the last call, its cheap check not yet read
        try:
            while calls_made < args.calls:
                if time.monotonic() - t_start > args.time_budget_s:
                    stopped_by = "time_budget"
                    break
                bufs = self.buffer_sets[calls_made % 2]
                use_graph = self.graphs_enabled and self.rnd.random() < args.graph_fraction
                try:
                    if use_graph:
                        cfg = self.rnd.choice(self.graph_configs)
                        key = (bufs.index, cfg)
                        graph = self.graphs.get(key)
                        if graph is None:
                            # an eager call with the static buffers builds the launchers, then capture
                            pending = self._drain(pending)
                            rows = cfg.tokens * cfg.top_k + cfg.padded_rows
                            n_scale = scale_out_bytes(cfg.tokens, self.H) if cfg.quant == "nvfp4" else 0
                            kwargs = self._call_kwargs(bufs, cfg, rows, n_scale)
                            record = self._one_call(bufs, cfg, "eager", calls_made, kwargs=kwargs)
                            calls_made += 1
                            self._finish(bufs, record)
                            self.graphs[key] = self._capture(kwargs)
                            progress.update(calls_made)
                            continue
                        record = self._one_call(bufs, cfg, "graph", calls_made, graph=graph)
                    else:
                        quant = self.rnd.choice(self.quants)
                        cfg = draw_config(self.rnd, quant, self.sampler.draw(quant), self.max_rows)
                        record = self._one_call(bufs, cfg, "eager", calls_made)
                except RuntimeError as e:
                    if "timed out" not in str(e):
                        raise
                    pending = self._drain(pending)
                    self._record_error(e)
                    calls_made += 1
                    continue
                calls_made += 1
                if pending is not None:
                    self._finish(*pending)
                pending = (bufs, record)
                if record.index % args.full_check_every == 0:
                    pending = self._drain(pending)
                    self._full_check(bufs, record)
                if calls_made >= next_check:
                    next_check += args.check_every
                    pending = self._drain(pending)
                    self._world_check()
                    self._refresh_norm_weights()
                progress.update(calls_made)
            pending = self._drain(pending)
            self._sync()
            self._world_check()
        except _HungCall as e:
            hang = str(e)
            self.stats["hangs"] += 1
        except KeyboardInterrupt:
            stopped_by = "interrupted"
            try:
                pending = self._drain(pending)
            except _HungCall as e:
                hang = str(e)
                self.stats["hangs"] += 1
        except Exception as e:  # noqa: BLE001 - record it in the JSON, fail the run
            import traceback
            stopped_by = "error"
            error = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-4000:]}"
        progress.close()
        seconds = time.monotonic() - t_start
        result = self._result(seconds, stopped_by, hang)
        result["error"] = error
        if error is not None:
            result["passed"] = False
        if hang is None and error is None and self.own_world:
            self._sync()
            self.graphs.clear()
            self.world.close()
        return result

    def _drain(self, pending):
        if pending is not None:
            self._finish(*pending)
        return None

    def _refresh_norm_weights(self):
        """New RMSNorm weights now and then (in place: captured graphs read the same tensors)."""
        for weight_bias in (0, 1):
            weights = self.norm_weights[(str(self.home_device), weight_bias)]
            weights.copy_(self._random_norm_weight(weight_bias))
            for d in self._distinct_devices():
                if str(d) != str(self.home_device):
                    self.norm_weights[(str(d), weight_bias)].copy_(weights)

    def _random_norm_weight(self, weight_bias):
        """gamma around 1 (weight_bias 0) or around 0 (weight_bias 1: the kernel adds the 1)."""
        return (torch.randn(self.H, device=self.home_device) * 0.1 + (1.0 if weight_bias == 0 else 0.0)).to(self.dtype)

    def _result(self, seconds, stopped_by, hang) -> dict:
        stats = dict(self.stats)
        seen = sorted(self.tokens_seen)
        log2_hist = {}  # "lo-hi" power-of-two bucket -> calls
        for T, n in self.tokens_seen.items():
            bucket = f"{2 ** (T.bit_length() - 1)}-{2 ** T.bit_length() - 1}"
            log2_hist[bucket] = log2_hist.get(bucket, 0) + n
        passed = (stats["calls"] > 0 and stats["wrong_elements"] == 0 and stats["wrong_calls"] == 0
                  and stats["full_check_failures"] == 0 and stats["timeouts"] == 0 and stats["hangs"] == 0)
        return dict(
            tool="moe_ar_tools.soak", machine=machine_info(), commit=git_commit(),
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            world_size=self.W, devices=[str(d) for d in self.rank_devices], single_device=self.single_device,
            dtype=self.args.dtype, hidden=self.H, max_tokens=self.max_tokens,
            oneshot_max_tokens=getattr(self.rank0_workspace, "oneshot_max_tokens", None), timeout_s=self.args.timeout_s,
            seed=self.args.seed, quants=[str(quant).lower() for quant in self.quants],
            calls_requested=self.args.calls, time_budget_s=self.args.time_budget_s, stopped_by=stopped_by,
            **stats,
            graph_note=self.graph_note, graph_configs=len(self.graph_configs),
            boundaries={str(quant).lower(): bounds for quant, bounds in self.bounds.items()},
            boundary_crossings=self.crossings,
            tokens=dict(min=seen[0] if seen else None, max=seen[-1] if seen else None, distinct=len(seen),
                        log2_histogram=dict(sorted(log2_hist.items(), key=lambda kv: int(kv[0].split("-")[0])))),
            failures=self.failures, timeout_messages=self.timeout_messages,
            hang=hang, seconds=round(seconds, 3), warmup_seconds=round(self.warmup_seconds, 3),
            calls_per_second=round(stats["calls"] / seconds, 1) if seconds > 0 else None,
            passed=passed)


class _RankOutputs(NamedTuple):
    """MoeFinalizeOutputs-like view of one rank's outputs for the reference's check_outputs."""
    norm_out: torch.Tensor
    residual_out: torch.Tensor
    quant_out: Optional[torch.Tensor]
    scale_out: Optional[torch.Tensor]


class _CallProgress:
    """tqdm when importable, else one printed line every 5,000 calls."""

    def __init__(self, total, enabled, log=print):
        self.enabled, self.total, self.bar, self.n, self.log = enabled, total, None, 0, log
        self.next_line = 5000
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, dynamic_ncols=True, unit="call",
                                mininterval=0.5 if sys.stderr.isatty() else 30.0)
            except ImportError:
                self.bar = None

    def update(self, n):
        if not self.enabled:
            return
        if self.bar is not None:
            if n - self.n >= 100 or n >= self.total:
                self.bar.update(n - self.n)
                self.n = n
        elif n >= self.next_line:
            self.log(f"soak: {n}/{self.total} calls", flush=True)
            self.next_line += 5000

    def close(self):
        if self.bar is not None:
            self.bar.close()


def write_result(result: dict, out) -> None:
    text = json.dumps(result, indent=1, sort_keys=True, default=str)
    if out:
        path = pathlib.Path(out)
        if path.parent and not path.parent.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    else:
        print(text)


def summary_line(r: dict) -> str:
    """One line of the result r."""
    return (f"soak ws{r['world_size']} {r['dtype']} devices={r['devices']}: {r['calls']} calls "
            f"({r['eager_calls']} eager, {r['graph_calls']} graph, {r['pdl_calls']} PDL) in {r['seconds']:.1f} s, "
            f"regimes {r['regimes']}, wrong elements {r['wrong_elements']}, full checks {r['full_checks']} "
            f"({r['full_check_failures']} failed), timeouts {r['timeouts']}, hangs {r['hangs']}: "
            f"{'PASS' if r['passed'] else 'FAIL'}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("moe-ar-soak: needs a CUDA GPU (torch sees none)", file=sys.stderr)
        return 2
    soak = Soak(args)
    result = soak.run()
    write_result(result, args.out)
    print(summary_line(result), flush=True)
    if result["hangs"]:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)  # a kernel may still spin: do not wait for the CUDA context to go down
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

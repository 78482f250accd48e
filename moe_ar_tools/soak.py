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
* NVFP4: quant_out and the swizzled scale bytes of rank 0 exactly equal to op.md's rule applied to
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
import subprocess
import sys
import time
from typing import NamedTuple, Optional

import torch

from dispatch.op import scale_out_bytes
from moe_ar_tools import reference as ref

ROOT = pathlib.Path(__file__).resolve().parent.parent
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
    for q in quants:
        bounds = set()
        for sh in shared_options:
            prev = select(1, q, sh)
            for T in range(2, max_tokens + 1):
                cur = select(T, q, sh)
                if cur != prev:
                    bounds.add(T)
                prev = cur
        out[q] = sorted(bounds)
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
        acc, self.cum = 0.0, []
        for m in mix:
            acc += m / total
            self.cum.append(acc)
        self.log_max = math.log(max_tokens + 1)

    def draw(self, quant=None) -> int:
        rnd = self.rnd
        x = rnd.random()
        bounds = self.boundaries.get(quant) or []
        if x < self.cum[0]:
            T = int(math.exp(rnd.random() * self.log_max))
        elif x < self.cum[1] and bounds:
            T = rnd.choice(bounds) + rnd.randint(-3, 2)
        elif x < self.cum[2]:
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
        if q in ("none", "plain", "110"):
            out.append(None)
        elif q in ("nvfp4", "111"):
            out.append("nvfp4")
        else:
            raise ValueError(f"quants: {q!r} (use none and/or nvfp4)")
    if not out:
        raise ValueError("quants: empty")
    return list(dict.fromkeys(out))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-ar-soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, required=True, help="ranks of the emulated world (2, 4 or 8)")
    p.add_argument("--devices", default=None,
                   help="each rank's GPU, comma separated, repeated to the world size (default: all on GPU 0)")
    p.add_argument("--calls", type=int, default=100_000, help="calls to make, fewer if the time budget ends first (100000)")
    p.add_argument("--time-budget-s", type=float, default=600.0, help="start no call after this many seconds (600)")
    p.add_argument("--out", default=None, help="JSON result path (default: print it)")
    p.add_argument("--dtype", choices=sorted(ref.NAME_TO_DTYPE), default="bf16", help="(bf16)")
    p.add_argument("--hidden", type=int, default=2048, help="(2048)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="default: max(2048, the last regime boundary of the selection table + 255, rounded to 128)")
    p.add_argument("--oneshot-max-tokens", type=int, default=None, help="the workspaces' one-shot capacity")
    p.add_argument("--quants", default="none,nvfp4", help="output profiles to draw from (none,nvfp4)")
    p.add_argument("--graph-fraction", type=float, default=0.5, help="share of calls replayed from CUDA graphs, single-device worlds only (0.5)")
    p.add_argument("--graph-configs-per-bucket", type=int, default=1,
                   help="captured option sets per (regime T bucket, profile, PDL) (1)")
    p.add_argument("--full-check-every", type=int, default=200, help="full moe_ar_tools/reference.py check every N calls (200)")
    p.add_argument("--check-every", type=int, default=1000, help="world.check() (timeouts) every N calls (1000)")
    p.add_argument("--timeout-s", type=float, default=10.0, help="the workspaces' peer-wait deadline (10)")
    p.add_argument("--seed", type=int, default=None, help="default: fresh (recorded in the JSON)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar / lines")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    a = p.parse_args(argv)
    try:
        if a.world_size < 2:
            raise ValueError(f"world-size: {a.world_size}")
        a.device_list = parse_devices(a.devices, a.world_size)
        a.quant_list = parse_quants(a.quants)
        if a.calls < 1:
            raise ValueError(f"calls: {a.calls} < 1")
        if a.hidden <= 0 or a.hidden % 16:
            raise ValueError(f"hidden: {a.hidden} must be a positive multiple of 16")
        if a.max_tokens is not None and a.max_tokens < 1:
            raise ValueError(f"max-tokens: {a.max_tokens}")
        if not 0.0 <= a.graph_fraction <= 1.0:
            raise ValueError(f"graph-fraction: {a.graph_fraction} not in [0, 1]")
        if a.full_check_every < 1 or a.check_every < 1 or a.graph_configs_per_bucket < 1:
            raise ValueError("full-check-every, check-every and graph-configs-per-bucket must be >= 1")
    except ValueError as e:
        p.error(str(e))
    if a.seed is None:
        a.seed = random.SystemRandom().randrange(2 ** 62)
    return a


def default_max_tokens(selection_rows, dtype_name: str, world_size: int) -> int:
    """max(2048, last boundary + 255) rounded up to a multiple of 128, so that every regime of every
    profile of (dtype, world size) in the selection table is reachable."""
    from dispatch import registry
    last = 1
    for s in selection_rows:
        if s.get("dtype") == dtype_name and int(s.get("world_size", -1)) == world_size:
            last = max(last, *(int(s[k]) + 1 for k in ("oneshot_max_tokens", "early_max_tokens", "twoshot_max_tokens",
                                                        "loads_max_tokens")
                               if int(s[k]) < registry.ALL_TOKENS))
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


def commit() -> str:
    c = os.environ.get("MOE_AR_COMMIT")
    if c:
        return c
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


# ---- the soak --------------------------------------------------------------------------------------------

class _Hang(Exception):
    pass


class _Rec(NamedTuple):
    index: int
    cfg: CallConfig
    rows: int
    n_scale: int
    ridx: torch.Tensor
    mode: str
    program: str


class _Slot:
    """One set of input and output buffers of max_tokens rows (two alternate, so that a call's check
    can be read while the next call runs)."""

    def __init__(self, soak, index: int):
        W, H, D, Tm, Rc = soak.W, soak.H, soak.dtype, soak.max_tokens, soak.max_rows
        dev = soak.home
        self.index = index
        nvfp4 = "nvfp4" in soak.quants
        # allreduce_in of every rank; row Rc stays zero (dropped routes in the check), row Rc + 1 is scratch
        self.X = torch.zeros(W, Rc + 2, H, dtype=D, device=dev)
        self.SH = torch.zeros(W, Tm, H, dtype=D, device=dev)
        self.RES = torch.zeros(Tm, H, dtype=D, device=dev)
        self.IDX = torch.zeros(Rc, dtype=torch.int32, device=dev)
        self.SC32 = torch.zeros(Rc, dtype=torch.float32, device=dev)
        self.SCD = torch.zeros(Rc, dtype=D, device=dev)
        self.GS = torch.ones(1, dtype=torch.float32, device=dev)
        self.NO = torch.zeros(W, Tm, H, dtype=D, device=dev)
        self.RO = torch.zeros(W, Tm, H, dtype=D, device=dev)
        scap = scale_out_bytes(Tm, H) + SCALE_TAIL
        self.QO = torch.zeros(W, Tm, H // 2, dtype=torch.uint8, device=dev) if nvfp4 else None
        self.SO = torch.zeros(W, scap, dtype=torch.uint8, device=dev) if nvfp4 else None
        self.bases = []
        self.remote = {}
        for r, ws in enumerate(soak.world.workspaces):
            if ws.device == dev:
                b = dict(X=self.X[r], SH=self.SH[r], RES=self.RES, IDX=self.IDX, SC32=self.SC32, SCD=self.SCD,
                         GS=self.GS, NO=self.NO[r], RO=self.RO[r],
                         QO=self.QO[r] if nvfp4 else None, SO=self.SO[r] if nvfp4 else None)
            else:  # a rank on another GPU: its own copies, filled from these before each call
                d = ws.device
                b = dict(X=torch.zeros(Rc + 2, H, dtype=D, device=d), SH=torch.zeros(Tm, H, dtype=D, device=d),
                         RES=torch.zeros(Tm, H, dtype=D, device=d), IDX=torch.zeros(Rc, dtype=torch.int32, device=d),
                         SC32=torch.zeros(Rc, dtype=torch.float32, device=d),
                         SCD=torch.zeros(Rc, dtype=D, device=d), GS=torch.ones(1, dtype=torch.float32, device=d),
                         NO=torch.zeros(Tm, H, dtype=D, device=d), RO=torch.zeros(Tm, H, dtype=D, device=d),
                         QO=torch.zeros(Tm, H // 2, dtype=torch.uint8, device=d) if nvfp4 else None,
                         SO=torch.zeros(scap, dtype=torch.uint8, device=d) if nvfp4 else None)
                self.remote[r] = b
            b["device"] = ws.device
            self.bases.append(b)
        cuda = dev.type == "cuda"
        self.host = torch.zeros(len(COUNTERS), dtype=torch.int64, pin_memory=cuda)
        self.event = torch.cuda.Event() if cuda else None


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
        selection_rows = registry.program_set().manifest["selection"]["boundaries"]
        self.max_tokens = args.max_tokens or default_max_tokens(selection_rows, args.dtype, self.W)
        self.max_rows = self.max_tokens * 8 + 16
        self.own_world = world is None
        if world is None:
            world = dispatch.EmulatedWorld(self.W, self.max_tokens, self.H, self.dtype, devices=args.device_list,
                                           timeout_s=args.timeout_s, oneshot_max_tokens=args.oneshot_max_tokens)
        self.world = world
        self.ws0 = world.workspaces[0]
        self.home = self.ws0.device
        self.cuda = self.home.type == "cuda"
        if self.cuda:  # checks, events and graph captures run on rank 0's GPU
            torch.cuda.set_device(self.home)
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
        self.bounds = regime_boundaries(lambda T, q, sh: self._select(T, q, sh)[0], self.max_tokens, self.quants)
        self.sampler = TokenSampler(self.max_tokens, self.bounds, self.W, self.rnd)
        # NVFP4 scale offsets of max_tokens rows: the first T rows' are T's (the layout does not depend on T)
        self.offsets = ref.swizzle_offsets(self.max_tokens, self.H, device=self.home).reshape(-1)
        self.gamma = {}
        for wb in (0, 1):
            g = (torch.randn(self.H, device=self.home) * 0.1 + (1.0 if wb == 0 else 0.0)).to(self.dtype)
            for d in {str(x): x for x in self.rank_devices}.values():
                self.gamma[(str(d), wb)] = g if str(d) == str(self.home) else g.to(d)
        self.zero = torch.zeros((), dtype=torch.int64, device=self.home)
        self.slots = [_Slot(self, 0), _Slot(self, 1)]
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
            name = self.dispatch.select_program(self.ws0, T, quant, bool(has_shared))
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

    def _kwargs(self, slot, cfg, rows, n_scale):
        T, K = cfg.tokens, cfg.top_k
        TK = T * K
        out = []
        for r, b in enumerate(slot.bases):
            kw = dict(allreduce_in=b["X"][:rows], expanded_idx_to_permuted_idx=b["IDX"][:TK].view(T, K),
                      residual_in=b["RES"][:T], norm_weight=self.gamma[(str(b["device"]), cfg.weight_bias)],
                      eps=cfg.eps, weight_bias=cfg.weight_bias, routed_scaling_factor=cfg.rsf,
                      launch_with_pdl=cfg.pdl, norm_out=b["NO"][:T], residual_out=b["RO"][:T])
            if cfg.scale == "fp32":
                kw["expert_scale_factor"] = b["SC32"][:TK].view(T, K)
            elif cfg.scale == "dtype":
                kw["expert_scale_factor"] = b["SCD"][:TK].view(T, K)
            if cfg.shared == "all" or (cfg.shared == "rank0" and r == 0):
                kw["shared_expert_output"] = b["SH"][:T]
            if cfg.quant == "nvfp4":
                kw.update(quant="nvfp4", global_scale=b["GS"], quant_out=b["QO"][:T],
                          scale_out=b["SO"][:n_scale + SCALE_TAIL])
            out.append(kw)
        return out

    def _refill(self, slot, cfg, rows, n_scale):
        """Fresh random inputs for the rows this call reads, poisoned outputs; returns the check's row
        index per (token, route) (dropped routes -> the zero row)."""
        T, K = cfg.tokens, cfg.top_k
        TK = T * K
        dev = self.home
        X = slot.X
        X[:, :rows].normal_(0.0, cfg.std)
        perm = torch.randperm(rows, device=dev)
        route = perm[:TK]
        if cfg.drop:
            dropped = torch.rand(TK, device=dev) < DROP_FRAC
            slot.IDX[:TK].copy_(torch.where(dropped, -1, route))
            ridx = torch.where(dropped, self.max_rows, route)
            # rows no valid route reads are NaN: a kernel must never read them into a result
            X.index_fill_(1, torch.where(dropped, route, self.max_rows + 1), math.nan)
        else:
            slot.IDX[:TK].copy_(route)
            ridx = route
        if rows > TK:
            X.index_fill_(1, perm[TK:], math.nan)
        if cfg.scale == "fp32":
            slot.SC32[:TK].uniform_(0.05, 1.0)
        elif cfg.scale == "dtype":
            slot.SCD[:TK].uniform_(0.05, 1.0)
        slot.RES[:T].normal_(0.0, 1.5)
        if cfg.shared != "none":
            slot.SH[:, :T].normal_(0.0, 0.5 * cfg.std)
            if cfg.shared == "rank0":
                slot.SH[1:, :T].zero_()
        if cfg.quant == "nvfp4":
            lo, hi = GS_LOG_RANGES[cfg.gs_range]
            slot.GS.uniform_(lo, hi).exp_()
        slot.NO[:, :T].fill_(math.nan)
        slot.RO[:, :T].fill_(math.nan)
        if cfg.quant == "nvfp4":
            slot.QO[:, :T].fill_(ref.POISON_BYTE)
            slot.SO[:, :n_scale + SCALE_TAIL].fill_(ref.POISON_BYTE)
        for r, b in slot.remote.items():
            b["X"][:rows].copy_(X[r, :rows])
            b["IDX"][:TK].copy_(slot.IDX[:TK])
            b["RES"][:T].copy_(slot.RES[:T])
            if cfg.scale == "fp32":
                b["SC32"][:TK].copy_(slot.SC32[:TK])
            elif cfg.scale == "dtype":
                b["SCD"][:TK].copy_(slot.SCD[:TK])
            if cfg.shared == "all":
                b["SH"][:T].copy_(slot.SH[r, :T])
            b["NO"][:T].fill_(math.nan)
            b["RO"][:T].fill_(math.nan)
            if cfg.quant == "nvfp4":
                b["GS"].copy_(slot.GS)
                b["QO"][:T].fill_(ref.POISON_BYTE)
                b["SO"][:n_scale + SCALE_TAIL].fill_(ref.POISON_BYTE)
        return ridx

    def _enqueue_check(self, slot, cfg, rows, n_scale, ridx):
        """The cheap check of the call just launched, on the GPU; counts land in slot.host at slot.event."""
        T, K, D = cfg.tokens, cfg.top_k, self.dtype
        TK = T * K
        for r, b in slot.remote.items():  # bring other GPUs' outputs home
            slot.NO[r, :T].copy_(b["NO"][:T])
            slot.RO[r, :T].copy_(b["RO"][:T])
            if cfg.quant == "nvfp4":
                slot.QO[r, :T].copy_(b["QO"][:T])
                slot.SO[r, :n_scale + SCALE_TAIL].copy_(b["SO"][:n_scale + SCALE_TAIL])
        scale = slot.SC32[:TK] if cfg.scale == "fp32" else (slot.SCD[:TK] if cfg.scale == "dtype" else None)
        shared = slot.SH[:, :T] if cfg.shared != "none" else None
        S, tol = ref.residual_expectation(slot.X, ridx, T, K, scale, cfg.rsf, shared, slot.RES[:T], D)
        ro, no = slot.RO[:, :T], slot.NO[:, :T]
        counts = [ref.count_bad(ro[0], S, tol)]
        y, ntol = ref.norm_expectation(ro[0], self.gamma[(str(self.home), cfg.weight_bias)], cfg.eps,
                                   cfg.weight_bias, D)
        counts.append(ref.count_bad(no[0], y, ntol))
        if self.W > 1:
            xr = (ro[1:].view(torch.int16) != ro[:1].view(torch.int16)).sum() + \
                (no[1:].view(torch.int16) != no[:1].view(torch.int16)).sum()
        else:
            xr = self.zero
        if cfg.quant == "nvfp4":
            q0 = slot.QO[:, :T]
            so = slot.SO[:, :n_scale]
            qexp, sf8 = ref.nvfp4_blocks(no[0], slot.GS)
            got = so[0][self.offsets[:T * (self.H // 16)]]
            counts += [(q0[0] != qexp).sum(), (got != sf8.reshape(-1)).sum(),
                       (so[0] != 0).sum() - (got != 0).sum(),
                       (slot.SO[:, n_scale:n_scale + SCALE_TAIL] != ref.POISON_BYTE).sum()]
            if self.W > 1:
                xr = xr + (q0[1:] != q0[:1]).sum() + (so[1:] != so[:1]).sum()
        else:
            counts += [self.zero] * 4
        counts.insert(2, xr)
        stacked = torch.stack(counts)
        if self.cuda:
            slot.host.copy_(stacked, non_blocking=True)
            slot.event.record(torch.cuda.current_stream(self.home))
        else:
            slot.host.copy_(stacked)

    def _one_call(self, slot, cfg, mode, index, graph=None, kwargs=None):
        T, K = cfg.tokens, cfg.top_k
        rows = T * K + cfg.padded_rows
        n_scale = scale_out_bytes(T, self.H) if cfg.quant == "nvfp4" else 0
        ridx = self._refill(slot, cfg, rows, n_scale)
        if mode == "graph":
            graph.replay()
        else:
            self.world.run(kwargs if kwargs is not None else self._kwargs(slot, cfg, rows, n_scale))
        self._enqueue_check(slot, cfg, rows, n_scale, ridx)
        name, family = self._select(T, cfg.quant, cfg.shared != "none")
        self._count(cfg, mode, name, family)
        return _Rec(index, cfg, rows, n_scale, ridx, mode, name)

    def _count(self, cfg, mode, name, family):
        s = self.stats
        s["calls"] += 1
        s["graph_calls" if mode == "graph" else "eager_calls"] += 1
        s["pdl_calls"] += cfg.pdl
        for key, val in (("quant_calls", str(cfg.quant).lower()), ("shared_modes", cfg.shared),
                         ("scale_kinds", cfg.scale), ("regimes", family), ("programs", name),
                         ("top_k", str(cfg.top_k))):
            s[key][val] = s[key].get(val, 0) + 1
        s["dropped_route_calls"] += cfg.drop
        s["padded_calls"] += cfg.padded_rows > 0
        T = cfg.tokens
        self.tokens_seen[T] = self.tokens_seen.get(T, 0) + 1
        if self.prev_T is not None:
            for q, bounds in self.bounds.items():
                for b in bounds:
                    key = f"{str(q).lower()}@{b}"
                    c = self.crossings.setdefault(key, {"up": 0, "down": 0})
                    if self.prev_T < b <= T:
                        c["up"] += 1
                    elif T < b <= self.prev_T:
                        c["down"] += 1
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
                raise _Hang(f"a call did not finish within {self.hang_s:g} s")

    def _finish(self, slot, rec):
        """Read the cheap check's counts of `rec` (on `slot`); a failing call gets a full check."""
        self._wait(slot.event)
        counts = [int(v) for v in slot.host.tolist()]
        bad = sum(counts)
        if bad:
            s = self.stats
            s["wrong_elements"] += bad
            s["wrong_calls"] += 1
            for c, v in zip(COUNTERS, counts):
                s["wrong_by_output"][c] += v
            if len(self.failures) < 20:
                self.failures.append(dict(call=rec.index, mode=rec.mode, program=rec.program,
                                          config=rec.cfg._asdict(), rows=rec.rows,
                                          wrong=dict((c, v) for c, v in zip(COUNTERS, counts) if v)))
            self._full_check(slot, rec, reason="cheap check failed")

    def _full_check(self, slot, rec, reason="sample"):
        cfg = rec.cfg
        T, K, H = cfg.tokens, cfg.top_k, self.H
        TK = T * K
        ranks = []
        for r in range(self.W):
            has_shared = cfg.shared == "all" or (cfg.shared == "rank0" and r == 0)
            ranks.append(dict(
                allreduce_in=slot.X[r, :rec.rows], expanded_idx_to_permuted_idx=slot.IDX[:TK].view(T, K),
                expert_scale_factor=(slot.SC32[:TK].view(T, K) if cfg.scale == "fp32" else
                                     slot.SCD[:TK].view(T, K) if cfg.scale == "dtype" else None),
                routed_scaling_factor=cfg.rsf, shared_expert_output=slot.SH[r, :T] if has_shared else None,
                residual_in=slot.RES[:T], norm_weight=self.gamma[(str(self.home), cfg.weight_bias)], eps=cfg.eps,
                weight_bias=cfg.weight_bias))
        meta = dict(seed=f"soak call {rec.index}", world_size=self.W, tokens=T, hidden=H, top_k=K, dtype=self.dtype,
                    padded_rows=cfg.padded_rows, drop_frac=DROP_FRAC if cfg.drop else 0.0,
                    scale_kind=None if cfg.scale == "none" else cfg.scale, shared=cfg.shared, rsf=cfg.rsf,
                    weight_bias=cfg.weight_bias, eps=cfg.eps)
        case = ref.Case(ranks, meta)
        nv = cfg.quant == "nvfp4"
        outs = [ref_outputs(slot.NO[r, :T], slot.RO[r, :T], slot.QO[r, :T] if nv else None,
                            slot.SO[r, :rec.n_scale] if nv else None) for r in range(self.W)]
        gs = float(slot.GS.float().cpu()[0]) if nv else None
        try:
            ref.check_outputs(case, outs, quant=cfg.quant, global_scale=gs, nvfp4_device=self.home,
                              label=f"soak call {rec.index} ({rec.mode}, {rec.program}, {reason})")
        except AssertionError as e:
            self.stats["full_check_failures"] += 1
            if len(self.failures) < 40:
                self.failures.append(dict(call=rec.index, mode=rec.mode, program=rec.program,
                                          full_check=str(e)[:3000]))
        self.stats["full_checks"] += 1

    def _sync(self):
        if self.cuda:
            for d in {str(x): x for x in self.rank_devices}.values():
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
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self.world.run(kwargs)
        torch.cuda.synchronize(self.home)
        self.stats["graphs_captured"] += 1
        return g

    def _warmup(self):
        if not self.cuda:
            return
        t0 = time.perf_counter()
        names = sorted({name for name, _family in self._select_cache.values()})  # every program selection can pick
        for d in {str(x): x for x in self.rank_devices}.values():
            self.dispatch.warmup(names, device_index=d.index)
        self.warmup_seconds = time.perf_counter() - t0

    # -- the loop ------------------------------------------------------------------------------------------------

    def run(self) -> dict:
        args = self.args
        self._warmup()
        progress = _Progress(args.calls, enabled=not args.no_progress, log=self.log)
        t_start = time.monotonic()
        stopped_by = "calls"
        hang = error = None
        next_check = args.check_every
        i = 0
        pending = None
        try:
            while i < args.calls:
                if time.monotonic() - t_start > args.time_budget_s:
                    stopped_by = "time_budget"
                    break
                slot = self.slots[i % 2]
                use_graph = self.graphs_enabled and self.rnd.random() < args.graph_fraction
                try:
                    if use_graph:
                        cfg = self.rnd.choice(self.graph_configs)
                        key = (slot.index, cfg)
                        graph = self.graphs.get(key)
                        if graph is None:
                            # an eager call with the static buffers builds the launchers, then capture
                            pending = self._drain(pending)
                            rows = cfg.tokens * cfg.top_k + cfg.padded_rows
                            n_scale = scale_out_bytes(cfg.tokens, self.H) if cfg.quant == "nvfp4" else 0
                            kwargs = self._kwargs(slot, cfg, rows, n_scale)
                            rec = self._one_call(slot, cfg, "eager", i, kwargs=kwargs)
                            i += 1
                            self._finish(slot, rec)
                            self.graphs[key] = self._capture(kwargs)
                            progress.update(i)
                            continue
                        rec = self._one_call(slot, cfg, "graph", i, graph=graph)
                    else:
                        quant = self.rnd.choice(self.quants)
                        cfg = draw_config(self.rnd, quant, self.sampler.draw(quant), self.max_rows)
                        rec = self._one_call(slot, cfg, "eager", i)
                except RuntimeError as e:
                    if "timed out" not in str(e):
                        raise
                    pending = self._drain(pending)
                    self._record_error(e)
                    i += 1
                    continue
                i += 1
                if pending is not None:
                    self._finish(*pending)
                pending = (slot, rec)
                if rec.index % args.full_check_every == 0:
                    pending = self._drain(pending)
                    self._full_check(slot, rec)
                if i >= next_check:
                    next_check += args.check_every
                    pending = self._drain(pending)
                    self._world_check()
                    self._refresh_gamma()
                progress.update(i)
            pending = self._drain(pending)
            self._sync()
            self._world_check()
        except _Hang as e:
            hang = str(e)
            self.stats["hangs"] += 1
        except KeyboardInterrupt:
            stopped_by = "interrupted"
            try:
                pending = self._drain(pending)
            except _Hang as e:
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

    def _refresh_gamma(self):
        """New RMSNorm weights now and then (in place: captured graphs read the same tensors)."""
        for wb in (0, 1):
            g = self.gamma[(str(self.home), wb)]
            g.copy_((torch.randn(self.H, device=self.home) * 0.1 + (1.0 if wb == 0 else 0.0)).to(self.dtype))
            for d in {str(x): x for x in self.rank_devices}.values():
                if str(d) != str(self.home):
                    self.gamma[(str(d), wb)].copy_(g)

    def _result(self, seconds, stopped_by, hang) -> dict:
        s = dict(self.stats)
        toks = sorted(self.tokens_seen)
        log2_hist = {}
        for T, n in self.tokens_seen.items():
            k = f"{2 ** (T.bit_length() - 1)}-{2 ** T.bit_length() - 1}"
            log2_hist[k] = log2_hist.get(k, 0) + n
        passed = (s["calls"] > 0 and s["wrong_elements"] == 0 and s["wrong_calls"] == 0
                  and s["full_check_failures"] == 0 and s["timeouts"] == 0 and s["hangs"] == 0)
        return dict(
            tool="moe_ar_tools.soak", machine=machine_info(), commit=commit(),
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            world_size=self.W, devices=[str(d) for d in self.rank_devices], single_device=self.single_device,
            dtype=self.args.dtype, hidden=self.H, max_tokens=self.max_tokens,
            oneshot_max_tokens=getattr(self.ws0, "oneshot_max_tokens", None), timeout_s=self.args.timeout_s,
            seed=self.args.seed, quants=[str(q).lower() for q in self.quants],
            calls_requested=self.args.calls, time_budget_s=self.args.time_budget_s, stopped_by=stopped_by,
            **s,
            graph_note=self.graph_note, graph_configs=len(self.graph_configs),
            boundaries={str(q).lower(): b for q, b in self.bounds.items()},
            boundary_crossings=self.crossings,
            tokens=dict(min=toks[0] if toks else None, max=toks[-1] if toks else None, distinct=len(toks),
                        log2_histogram=dict(sorted(log2_hist.items(), key=lambda kv: int(kv[0].split("-")[0])))),
            failures=self.failures, timeout_messages=self.timeout_messages,
            hang=hang, seconds=round(seconds, 3), warmup_seconds=round(self.warmup_seconds, 3),
            calls_per_second=round(s["calls"] / seconds, 1) if seconds > 0 else None,
            passed=passed)


class ref_outputs(NamedTuple):
    """MoeFinalizeOutputs-like view of one rank's outputs for moe_ar_tools/reference.py's check_outputs."""
    norm_out: torch.Tensor
    residual_out: torch.Tensor
    quant_out: Optional[torch.Tensor]
    scale_out: Optional[torch.Tensor]


class _Progress:
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

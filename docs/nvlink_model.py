"""Cost model of one fused call per rank over one NVLink domain: one-shot, two-shot and the
pipelined two-shot, at any world size. Standard library only; prints the tables of
docs/nvlink-domains.md (rerun it after changing a parameter, and paste its output there).

    python3 docs/nvlink_model.py                       # the doc's tables
    python3 docs/nvlink_model.py --alpha-us 3.7        # another latency per NVLink round trip
    python3 docs/nvlink_model.py --world-sizes 8 16 --tokens 1 4 16 --hidden 4096

Shape: H 7168, bf16, top_k 8 with the shared expert, plain output profile (the issue's target).
Per call and per rank, with row = H * 2 bytes, C = ceil(T / W) tokens owned by a rank in the
two-shot, owned(r) = the tokens rank r owns (C for the first ranks, fewer or none for the last):

  op HBM (any protocol)  K*T rows of experts + T shared + T residual (two-shot: the owned rows
                         only) + 2*T outputs, + routing (8 bytes a route) + gamma
  one-shot               sends its partial to every peer: (W-1)*T rows out, as many in;
                         its buffer: W*T rows written (W-1 by peers), read, cleared next call;
                         one NVLink round trip; time = fixed + alpha + max(HBM, NVLink)
  two-shot               reduce-scatter: T-owned rows out, (W-1)*owned rows in; all-gather:
                         (W-1)*owned rows out, T-owned in (together 2*(W-1)/W*T rows when W
                         divides T); its buffer: W*C + T rows written, read, cleared; two round
                         trips, the two phases one after the other:
                         time = fixed + 2*alpha + max(HBM, NVLink of phase 1) + the same of phase 2
  pipelined two-shot     the same exchange with the phases overlapped over token columns, and only
                         the received rows go through the buffer (written, read and cleared as read):
                         time = fixed + 2*alpha + max(HBM, NVLink) of the whole call

The call ends when its slowest rank does, so each term is taken at the busiest rank. HBM time is
bytes / B_hbm, NVLink time is max(bytes out, bytes in) / beta (beta: one direction, one GPU; the
NVSwitch is taken as non-blocking, every GPU one hop from every other). `fixed` and `alpha` are
fitted to the 2x H200 benchmark at 1 token (one-shot 6.4 us = fixed + alpha; the early two-shot
1.7 us more = one more round trip); the calibration table compares the model with that benchmark.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re

HIDDEN = 7168
ELEM_BYTES = 2  # bf16
TOP_K = 8
SHARED = True
ROUTE_BYTES = 8  # int32 index + fp32 weight
FIXED_US = 4.7   # launch under graph replay (2.3 us measured empty) + a call's local work at 1 token
ALPHA_US = 1.7   # one NVLink round trip: store, visible at the peer, seen by its poll
# (name, beta GB/s one direction per GPU, HBM GB/s read + write)
PARAMETER_SETS = (
    ("H200 fabric, measured on 2x H200 (NVLink 388 GB/s one way, HBM 4.13 TB/s)", 388.0, 4130.0),
    ("NVL72 (GB200/GB300), datasheet lead (NVLink5 900 GB/s one way, HBM 8 TB/s)", 900.0, 8000.0),
)
WORLD_SIZES = (8, 16, 32, 72)
TOKENS = (1, 16, 128, 1024, 8192)
PIPELINED_MIN_TOKENS = 1024  # below, the model leaves out what the pipeline costs to fill (see the doc)
BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench_results" / "h200x2-2026-11-30-529cb84-bf16.json"


class Shape:
    def __init__(self, hidden=HIDDEN, elem_bytes=ELEM_BYTES, top_k=TOP_K, shared=SHARED):
        self.row = hidden * elem_bytes
        self.top_k = top_k
        self.shared = shared
        self.hidden = hidden
        self.elem_bytes = elem_bytes

    def op_reads(self, T: int) -> float:
        """Expert rows, shared row and routing of T tokens: what computing the partials reads."""
        return (self.top_k + self.shared) * T * self.row + T * self.top_k * ROUTE_BYTES

    def op_tail(self, T: int, residual_rows: int) -> float:
        """residual_in rows read, residual_out + norm_out written, gamma."""
        return residual_rows * self.row + 2 * T * self.row + self.row


def owned(T: int, W: int) -> list[int]:
    C = -(-T // W)
    return [max(0, min(C, T - r * C)) for r in range(W)]


def oneshot(T, W, s: Shape, beta, hbm, alpha, fixed):
    nvl = (W - 1) * T * s.row
    hbm_bytes = s.op_reads(T) + s.op_tail(T, T) + 3 * W * T * s.row
    t = fixed + alpha + max(hbm_bytes / hbm, nvl / beta) / 1e3
    return t, {"nvl": nvl, "hbm": hbm_bytes, "buffer": W * T * s.row, "per_peer": T * s.row}


def twoshot(T, W, s: Shape, beta, hbm, alpha, fixed, pipelined=False):
    C = -(-T // W)
    worst, worst_nvl, worst_hbm = 0.0, 0.0, 0.0
    for o in owned(T, W):
        out1, in1 = (T - o) * s.row, (W - 1) * o * s.row   # reduce-scatter
        out2, in2 = (W - 1) * o * s.row, (T - o) * s.row   # all-gather
        if pipelined:
            hbm_b = s.op_reads(T) + s.op_tail(T, o) + 3 * (in1 + in2)
            nvl_b = max(out1 + out2, in1 + in2)
            t = max(hbm_b / hbm, nvl_b / beta) / 1e3
        else:
            hbm1 = s.op_reads(T) + 2 * W * o * s.row + o * s.row          # slots written, read; residual
            hbm2 = 2 * T * s.row + 2 * T * s.row + s.row + (W * C + T) * s.row  # rows, outputs, clear
            nvl1, nvl2 = max(out1, in1), max(out2, in2)
            t = (max(hbm1 / hbm, nvl1 / beta) + max(hbm2 / hbm, nvl2 / beta)) / 1e3
            hbm_b, nvl_b = hbm1 + hbm2, max(out1 + out2, in1 + in2)
        if t >= worst:
            worst, worst_nvl, worst_hbm = t, nvl_b, hbm_b
    return fixed + 2 * alpha + worst, {"nvl": worst_nvl, "hbm": worst_hbm, "buffer": (W * C + T) * s.row,
                                       "per_peer": C * s.row}


def best_twoshot(T, W, s, beta, hbm, alpha, fixed):
    """The faster two-shot the model speaks for: the pipelined one only from PIPELINED_MIN_TOKENS."""
    t = twoshot(T, W, s, beta, hbm, alpha, fixed)[0]
    if T >= PIPELINED_MIN_TOKENS:
        t = min(t, twoshot(T, W, s, beta, hbm, alpha, fixed, pipelined=True)[0])
    return t


def crossover(W, s, beta, hbm, alpha, fixed, limit=1 << 17):
    """The largest T at which the one-shot is still no slower than the two-shot (0: never)."""
    last = 0
    for T in range(1, limit):
        if oneshot(T, W, s, beta, hbm, alpha, fixed)[0] <= best_twoshot(T, W, s, beta, hbm, alpha, fixed):
            last = T
        elif T > 4 * (last + 1) + 64:
            break
    return last


def committed_oneshot_max_tokens(s: Shape) -> dict:
    """World size -> (oneshot_max_tokens, source) of the first committed table set (bf16, plain), in
    tokens at the shape's hidden size (a cell fitted in bytes per rank divided by the row's bytes)."""
    path = BENCH.parent.parent / "generated" / "manifest.json"
    if not path.exists():
        return {}
    sets = [t for t in json.loads(path.read_text()).get("selection", {}).get("sets", []) if t["match"]]
    out = {}
    for b in sets[0]["boundaries"] if sets else []:
        if b["dtype"] == "bf16" and b["profile"] == "plain":
            limit = b["limits"]["oneshot_max_tokens"]
            row = 1 if b["key"] == "tokens" else s.hidden * s.elem_bytes
            out[b["world_size"]] = (limit // row, b["source"].split(":")[0].split(" in ")[0])
    return out


def mb(x: float) -> str:
    return f"{x / 1e6:.2f}" if x < 1e8 else f"{x / 1e6:.0f}"


# The benchmark names a program as it was measured: the committed one spells the family by its code
# (moe_ar_os_bf16_ws2_plain), later ones by its name (bench_results/README.md).
FAMILY_OF_CODE = {"os": "oneshot", "ts": "twoshot", "tse": "twoshot_early", "tsp": "twoshot_pipelined"}


def calibration(s: Shape, alpha, fixed):
    if not BENCH.exists():
        print(f"(no {BENCH.name}: calibration table skipped)\n")
        return
    doc = json.loads(BENCH.read_text())
    beta, hbm = doc["bandwidth"]["nvlink_GBps"], doc["bandwidth"]["hbm_GBps"]
    meas = {}
    for r in doc["records"]:
        program = re.match(r"moe_ar_([a-z_]+?)_(?:bf16|fp16)_ws\d+_", r["system"])
        if (r["hidden"], r["top_k"], bool(r["shared"]), r["profile"]) == (s.hidden, s.top_k, s.shared, "plain") \
                and program and r.get("valid", True):
            family = FAMILY_OF_CODE.get(program.group(1), program.group(1))
            meas[(family, r["tokens"])] = r["median_us"]
    if not meas:
        print(f"(no point of {BENCH.name} at this shape: calibration table skipped)\n")
        return
    print(f"Calibration, world size 2 ({BENCH.name}, H {s.hidden} top_k {s.top_k} + shared, plain; beta "
          f"{beta:.0f} GB/s, HBM {hbm:.0f} GB/s as measured there): measured us / model us\n")
    print("| T | one-shot | model | two-shot (early) | two-shot | model | pipelined | model |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for T in sorted({t for _, t in meas}):
        m = lambda k: f"{meas[(k, T)]:.1f}" if (k, T) in meas else "-"
        os_ = oneshot(T, 2, s, beta, hbm, alpha, fixed)[0]
        ts = twoshot(T, 2, s, beta, hbm, alpha, fixed)[0]
        tp = twoshot(T, 2, s, beta, hbm, alpha, fixed, pipelined=True)[0]
        print(f"| {T} | {m('oneshot')} | {os_:.1f} | {m('twoshot_early')} | {m('twoshot')} | {ts:.1f} | "
              f"{m('twoshot_pipelined')} | {tp:.1f} |")
    print()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--alpha-us", type=float, default=ALPHA_US, help="latency of one NVLink round trip")
    ap.add_argument("--fixed-us", type=float, default=FIXED_US, help="launch + local work of a call at 1 token")
    ap.add_argument("--beta-gbps", type=float, nargs="*", help="NVLink GB/s one way per GPU (replaces the sets)")
    ap.add_argument("--hbm-gbps", type=float, default=None, help="HBM GB/s, with --beta-gbps")
    ap.add_argument("--world-sizes", type=int, nargs="+", default=list(WORLD_SIZES))
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    ap.add_argument("--hidden", type=int, default=HIDDEN)
    a = ap.parse_args(argv)
    s = Shape(hidden=a.hidden)
    sets = PARAMETER_SETS
    if a.beta_gbps:
        sets = tuple((f"beta {b:g} GB/s, HBM {a.hbm_gbps or 4130:g} GB/s", b, a.hbm_gbps or 4130.0)
                     for b in a.beta_gbps)
    print(f"fixed {a.fixed_us} us, alpha {a.alpha_us} us per NVLink round trip; H {s.hidden}, "
          f"{s.elem_bytes}-byte elements, top_k {s.top_k} + shared expert, plain profile\n")
    calibration(s, a.alpha_us, a.fixed_us)

    print("Bytes per rank and call (MB = 1e6 bytes; NVLink: the larger of out and in at the busiest rank; "
          "buffer: one rotating buffer, the workspace holds 3)\n")
    print("| W | T | NVLink 1-shot | NVLink 2-shot | HBM 1-shot | HBM 2-shot | HBM pipelined "
          "| to each peer 1-shot | to each peer 2-shot, a phase | buffer 1-shot | buffer 2-shot |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for W in a.world_sizes:
        for T in a.tokens:
            _, o = oneshot(T, W, s, 1.0, 1.0, 0, 0)
            _, t = twoshot(T, W, s, 1.0, 1.0, 0, 0)
            _, p = twoshot(T, W, s, 1.0, 1.0, 0, 0, pipelined=True)
            print(f"| {W} | {T} | {mb(o['nvl'])} | {mb(t['nvl'])} | {mb(o['hbm'])} | {mb(t['hbm'])} | {mb(p['hbm'])} "
                  f"| {mb(o['per_peer'])} | {mb(t['per_peer'])} | {mb(o['buffer'])} | {mb(t['buffer'])} |")
    print()

    for name, beta, hbm in sets:
        print(f"Modelled call time, us: {name}\n")
        print("| W | T | one-shot | two-shot | pipelined two-shot | fastest | NVLink floor, two-shot | HBM floor, pipelined |")
        print("|---:|---:|---:|---:|---:|---|---:|---:|")
        for W in a.world_sizes:
            for T in a.tokens:
                os_, o = oneshot(T, W, s, beta, hbm, a.alpha_us, a.fixed_us)
                ts, t = twoshot(T, W, s, beta, hbm, a.alpha_us, a.fixed_us)
                tp, p = twoshot(T, W, s, beta, hbm, a.alpha_us, a.fixed_us, pipelined=True)
                times = {"one-shot": os_, "two-shot": ts}
                if T >= PIPELINED_MIN_TOKENS:
                    times["pipelined"] = tp
                best = min(times, key=times.get)
                tp_s = f"{tp:.1f}" if T >= PIPELINED_MIN_TOKENS else "-"
                print(f"| {W} | {T} | {os_:.1f} | {ts:.1f} | {tp_s} | {best} | {t['nvl'] / beta / 1e3:.1f} "
                      f"| {p['hbm'] / hbm / 1e3:.1f} |")
        print()

    print("Crossover: the largest T at which the one-shot is still no slower than the two-shot (the "
          f"pipelined two-shot counted from {PIPELINED_MIN_TOKENS} tokens)\n")
    alphas = sorted({a.alpha_us, 3.7})
    committed = committed_oneshot_max_tokens(s)
    head = " | ".join(f"{n.split(',')[0]}, alpha {al:g} us" for n, _, _ in sets for al in alphas)
    print(f"| W | {head} | committed tables (bf16, plain) |")
    print("|---:|" + "---:|" * (len(sets) * len(alphas)) + "---|")
    for W in sorted({2, 4} | set(a.world_sizes)):
        cells = [str(crossover(W, s, beta, hbm, al, a.fixed_us)) for _, beta, hbm in sets for al in alphas]
        c = committed.get(W)
        print(f"| {W} | " + " | ".join(cells) + f" | {f'{c[0]} ({c[1]})' if c else '-'} |")
    print()


if __name__ == "__main__":
    main()

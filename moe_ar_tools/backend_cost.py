"""What the workspace's backends cost on this machine: CUDA IPC ("ipc") against torch symmetric
memory ("symm_mem"), one process per GPU.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=. \\
        torchrun --nproc-per-node 2 -m moe_ar_tools.backend_cost --out FILE.json

For each backend:

  construction  wall time of Workspace(...) (the rendezvous, allocation, sentinel fill and the
                peers' mappings), slowest rank; the first construction of each backend (one-time
                costs: communicators, torch's symmetric-memory setup) apart from the median of the
                next --constructions; both backends alternate, in one order then the other
  bytes         per rank: the buffers' nominal size (3 rotating buffers; the state and error words
                add 32 device and 16 pinned host bytes), and the drop in the device's free memory
                while a workspace lives (allocation granularity, torch's signal pad and its small
                peer-pointer arrays included)
  call time     H 7168, top_k 8 + shared expert, bf16, plain output, T in --tokens: each backend's
                call captured in one CUDA graph of --calls calls (rotating over input sets that
                together exceed twice the L2), the two graphs replayed --replays times interleaved
                in an order shuffled per round; per replay the slowest rank's time; the median per
                call, and the median of the per-replay ratios symm_mem / ipc

Both workspaces run the same automatically selected program on the same inputs; their outputs are
compared bit for bit (a difference is reported, and the point marked invalid). Writes the JSON
(--out) on rank 0 and prints a Markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

BACKENDS = ("ipc", "symm_mem")
TOKENS = (1, 16, 128, 1024, 8192)
HIDDEN = 7168
TOP_K = 8


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m moe_ar_tools.backend_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write (rank 0)")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="token counts, comma-separated")
    p.add_argument("--calls", type=int, default=10, help="calls captured in each CUDA graph")
    p.add_argument("--replays", type=int, default=50, help="replays of each graph")
    p.add_argument("--constructions", type=int, default=5, help="timed constructions of each backend after the first")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.tokens = sorted({int(t) for t in args.tokens.split(",") if t.strip()})
    if not args.tokens or min(args.tokens) < 1:
        p.error("--tokens: positive integers")
    for name in ("calls", "replays", "constructions"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: at least 1")
    return args


class Run:
    def __init__(self, args):
        import torch
        import torch.distributed as dist
        from moe_ar_tools.bench import config
        os.environ.update(config.REQUIRED_ENV)  # never NVLink multicast, whatever the caller's shell says
        self.args = args
        self.local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(self.local)
        self.device = torch.device("cuda", self.local)
        dist.init_process_group("nccl", device_id=self.device)
        self.rank, self.W = dist.get_rank(), dist.get_world_size()
        self.group = dist.group.WORLD
        self.gloo = dist.new_group(backend="gloo")
        self.dtype = torch.bfloat16
        self.max_tokens = max(args.tokens)
        props = torch.cuda.get_device_properties(self.device)
        self.l2_bytes = int(getattr(props, "L2_cache_size", 0) or config.FALLBACK_L2_BYTES)

    def log(self, msg):
        if self.rank == 0:
            print(msg, flush=True)

    def gather(self, obj) -> list:
        import torch.distributed as dist
        out = [None] * self.W
        dist.all_gather_object(out, obj, group=self.gloo)
        return out

    def build(self, backend):
        """(workspace or None, error message, seconds of the slowest rank, device bytes of the largest rank)."""
        import torch
        import torch.distributed as dist
        import dispatch
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.gloo)
        free0 = torch.cuda.mem_get_info(self.device)[0]
        t0 = time.perf_counter()
        try:
            ws = dispatch.Workspace(self.group, self.max_tokens, HIDDEN, self.dtype, backend=backend)
            error = None
        except (ValueError, RuntimeError) as e:  # raised on every rank alike (e.g. symmetric memory missing)
            ws, error = None, f"{type(e).__name__}: {e}"
        seconds = time.perf_counter() - t0
        torch.cuda.synchronize(self.device)
        used = free0 - torch.cuda.mem_get_info(self.device)[0]
        every = self.gather((seconds, used))
        return ws, error, max(s for s, _ in every), max(u for _, u in every)

    def construction(self) -> dict:
        out = {b: {"construct_s": [], "device_bytes": []} for b in BACKENDS}
        for b in BACKENDS:  # the first of each: one-time costs
            ws, error, s, used = self.build(b)
            out[b].update(construct_first_s=s, device_bytes_first=used, error=error)
            if ws is not None:
                out[b]["buffer_bytes"] = ws._moe_ar_state.memory.buffer_bytes
                out[b]["chosen"] = ws.backend
                ws.close()
        live = [b for b in BACKENDS if out[b]["error"] is None]
        for c in range(self.args.constructions):
            for b in (live if c % 2 == 0 else live[::-1]):
                ws, error, s, used = self.build(b)
                if ws is None:
                    raise RuntimeError(f"{b}: built once, then failed: {error}")
                out[b]["construct_s"].append(s)
                out[b]["device_bytes"].append(used)
                ws.close()
        for b in live:
            out[b]["construct_median_s"] = statistics.median(out[b]["construct_s"])
            out[b]["device_bytes_median"] = statistics.median(out[b]["device_bytes"])
        return out

    def calls(self, workspaces: dict) -> list:
        import torch
        import dispatch
        from moe_ar_tools.bench import config, inputs, outputs, timing
        shape = config.Shape(HIDDEN, TOP_K, True)
        names = sorted({dispatch.select_program(ws, T, None, True) for ws in workspaces.values()
                        for T in self.args.tokens})
        dispatch.warmup(names, device_index=self.local)  # no rank compiles while its peer waits on it
        rows = []
        for T in self.args.tokens:
            per_set = (T * TOP_K + 3 * T) * HIDDEN * 2
            n_sets = timing.input_sets_for(per_set, self.l2_bytes, self.args.calls)
            sets = inputs.make_input_sets(shape, T, n_sets, self.dtype, self.rank, self.args.seed, self.device)
            outs = {b: outputs.alloc_output_sets(T, HIDDEN, self.dtype, None, n_sets, self.device) for b in workspaces}

            def step(b, i):
                x, o = sets[i], outs[b][i]
                dispatch.moe_finalize_allreduce(
                    workspaces[b], allreduce_in=x.allreduce_in, expanded_idx_to_permuted_idx=x.idx,
                    residual_in=x.residual, norm_weight=x.norm_weight, expert_scale_factor=x.scale,
                    routed_scaling_factor=config.ROUTED_SCALING_FACTOR, shared_expert_output=x.shared,
                    eps=config.EPS, norm_out=o["norm_out"], residual_out=o["residual_out"])

            for b in workspaces:  # eager: every input set once, then the outputs compared
                outputs.poison(outs[b])
                for i in range(n_sets):
                    step(b, i)
            torch.cuda.synchronize(self.device)
            dispatch.check()
            identical = all(torch.equal(outs[a][i][k].view(torch.int16), outs[b][i][k].view(torch.int16))
                            for a in workspaces for b in workspaces for i in range(n_sets)
                            for k in ("norm_out", "residual_out"))
            identical = all(self.gather(identical))
            graphs = {}
            for b in workspaces:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for i in range(self.args.calls):
                        step(b, i % n_sets)
                graphs[b] = g
            torch.cuda.synchronize(self.device)
            order = list(workspaces)
            ev = {b: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(self.args.replays)] for b in order}
            for rep, perm in enumerate(timing.replay_orders(len(order), self.args.replays, self.args.seed + T)):
                for j in perm:
                    b = order[j]
                    ev[b][rep][0].record()
                    graphs[b].replay()
                    ev[b][rep][1].record()
            torch.cuda.synchronize(self.device)
            dispatch.check()
            mine = {b: [a.elapsed_time(z) * 1e3 / self.args.calls for a, z in ev[b]] for b in order}
            every = self.gather(mine)
            slowest = {b: [max(r[b][i] for r in every) for i in range(self.args.replays)] for b in order}
            row = {"tokens": T, "program": dispatch.select_program(workspaces[order[0]], T, None, True),
                   "input_sets": n_sets, "identical_outputs": identical,
                   "median_us": {b: statistics.median(slowest[b]) for b in order},
                   "replay_us": slowest}
            if "ipc" in slowest and "symm_mem" in slowest:
                row["ratio_symm_mem_over_ipc"] = timing.pair_ratio(slowest["symm_mem"], slowest["ipc"])
            rows.append(row)
            self.log(f"  T={T}: " + ", ".join(f"{b} {row['median_us'][b]:.1f} us" for b in order)
                     + ("" if identical else "  OUTPUTS DIFFER"))
            del graphs, ev, sets, outs
        return rows


def table(result: dict) -> str:
    backends = result["backends"]
    live = [b for b in BACKENDS if backends[b].get("error") is None]
    lines = ["| backend | construction, first / median, ms | buffers per rank, MB | device memory per rank, MB | "
             + " | ".join(f"T={r['tokens']}, us" for r in result["calls"]) + " |",
             "|---|---:|---:|---:|" + "---:|" * len(result["calls"])]
    for b in BACKENDS:
        c = backends[b]
        if b not in live:
            lines.append(f"| {b} | unavailable: {c['error']} |")
            continue
        lines.append(f"| {b} | {c['construct_first_s'] * 1e3:.1f} / {c['construct_median_s'] * 1e3:.1f} | "
                     f"{c['buffer_bytes'] / 1e6:.1f} | {c['device_bytes_median'] / 1e6:.1f} | "
                     + " | ".join(f"{r['median_us'][b]:.1f}" for r in result["calls"]) + " |")
    if len(live) == 2:
        lines.append("| symm_mem / ipc | | | | " + " | ".join(
            f"{r['ratio_symm_mem_over_ipc']:.3f}" + ("" if r["identical_outputs"] else " (outputs differ)")
            for r in result["calls"]) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch
    import torch.distributed as dist
    import dispatch
    from moe_ar_tools import provenance
    from moe_ar_tools.bench import config
    run = Run(args)
    run.log(f"backend_cost: {run.W} ranks, {torch.cuda.get_device_name(run.device)}; constructions ...")
    result = None
    if run.rank == 0:
        result = {"gpu": torch.cuda.get_device_name(run.device), "world_size": run.W, **provenance.stamp(),
                  "env": {k: os.environ.get(k) for k in config.REQUIRED_ENV},
                  "config": {"hidden": HIDDEN, "top_k": TOP_K, "shared": True, "dtype": "bf16", "profile": "plain",
                             "max_tokens": run.max_tokens, "tokens": args.tokens, "calls_per_graph": args.calls,
                             "replays": args.replays, "constructions": args.constructions, "seed": args.seed,
                             "l2_bytes": run.l2_bytes}}
    backends = run.construction()
    workspaces = {}
    for b in BACKENDS:
        if backends[b]["error"] is None:
            workspaces[b] = dispatch.Workspace(run.group, run.max_tokens, HIDDEN, run.dtype, backend=b)
    run.log("call times (CUDA graphs) ...")
    try:
        calls = run.calls(workspaces)
    finally:
        for ws in workspaces.values():
            ws.close()
    if run.rank == 0:
        result.update(backends=backends, calls=calls)
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(table(result), flush=True)
        print(f"wrote {out}", flush=True)
    dist.barrier(group=run.gloo)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

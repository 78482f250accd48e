"""The soak's loop: eager calls and graph replays until the call count or the time budget, the
checks between them, and the result."""
from __future__ import annotations

import datetime
import sys
import time

from dispatch.op import scale_out_bytes
from moe_ar_tools.provenance import git_commit
from moe_ar_tools.soak.calls import SoakCalls, _HungCall
from moe_ar_tools.soak.result import machine_info
from moe_ar_tools.soak.sampling import draw_config


class Soak(SoakCalls):
    """The soak: calls until --calls or the time budget, every check, and the result."""

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

"""The soak's state: its world, buffers, counters, the programs selection picks, the options of
the captured graphs, and the upkeep of the world between calls."""
from __future__ import annotations

import random
import time

import torch

from moe_ar_tools import reference as ref
from moe_ar_tools.soak.buffers import COUNTERS, _BufferSet
from moe_ar_tools.soak.sampling import (TokenSampler, default_max_tokens, draw_config, graph_token_counts,
                                        regime_boundaries)


class SoakState:
    """The soak's world (its own EmulatedWorld, or one given), buffers, RMSNorm weights, program
    selection and graph options, and the world's upkeep (sync, check, reset, capture, warm-up).
    SoakCalls makes and checks one call; Soak runs the loop."""

    def __init__(self, args, world=None, log=print):
        import dispatch
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

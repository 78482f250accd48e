"""The launch of a program on a workspace: the loaded kernel, its grid (every block of every rank
resident at once), its kernel argument struct with the call's data pointers packed in, and
cuLaunchKernelEx through ctypes on torch's current stream."""
from __future__ import annotations

import ctypes
import struct

import torch

from . import registry, shape_constants
from .workspace_sizes import ALL_TOKENS, cluster_layout_split, row_split

_POINTER_FIELDS = ("allreduce_in", "expanded_idx", "expert_scale", "shared_in", "residual_in", "norm_weight",
                   "quant_scale", "norm_out", "residual_out", "quant_out", "scale_out")
# The kernel argument fields each call argument's data pointer goes to.
_FIELD_OF = {"allreduce_in": "allreduce_in", "expanded_idx_to_permuted_idx": "expanded_idx",
             "expert_scale_factor": "expert_scale", "shared_expert_output": "shared_in", "residual_in": "residual_in",
             "norm_weight": "norm_weight", "global_scale": "quant_scale", "fp8_scale": "quant_scale",
             "norm_out": "norm_out", "residual_out": "residual_out", "quant_out": "quant_out", "scale_out": "scale_out"}


class _Launcher:
    """One program on one workspace: the loaded kernel, its grid limit, a reusable argument struct
    with the per-workspace fields filled in, and prebuilt launch configurations."""

    def __init__(self, ws, name: str):
        info = registry.program_info(name)
        if info["dtype"] != ws.dtype_name or info["world_size"] != ws.world_size:
            raise ValueError(f"program: {name} is for {info['dtype']} world size {info['world_size']}, the workspace "
                             f"is {ws.dtype_name} world size {ws.world_size}")
        self.name = name
        self.family = info["family"]
        self.regime = info["regime"]
        self.profile = info["profile"]
        self.sliced_units = info["sliced_units"]  # a work unit is a row slice, not a whole row
        self.column_units = info["column_units"]  # a work unit is a column: a token of each rank
        prog = registry.load(name, ws.device_index)
        sms = torch.cuda.get_device_properties(ws.device).multi_processor_count
        # Every block of every rank on this GPU must be resident at once: blocks spin on peers.
        # When ranks share a GPU (emulation), each rank may have two kernels resident (its current
        # one and the next, started early by PDL), and blocks of different programs (different
        # register counts) pack onto SMs with some waste: a run that filled the GPU to 100% of
        # the occupancy figure left a rank's blocks unplaced and timed out. Each kernel gets a
        # quarter of its rank's share, so four kernels per rank would still fit.
        sharing = ws.ranks_on_device * (4 if ws.ranks_on_device > 1 else 1)
        if ws.ranks_on_device > 1:
            # An SM holds blocks of two kernels at once only in one split of its memory between L1
            # and shared memory, chosen per kernel. Two-shot blocks spinning on a peer rank, in a
            # split with little shared memory, on every SM, left no SM for that rank's pipelined
            # blocks with their row ring: a timeout (seen on one GPU: twoshot_early and
            # twoshot_pipelined at 303 tokens).
            # So here every program asks for the largest shared memory. The attribute stays with
            # the loaded program for the process (tests that also run one rank a GPU).
            prog.prefer_largest_shared_memory()
        self.dynamic_smem = registry.dynamic_smem_bytes(info, ws.hidden, ws.dtype.itemsize)
        self.row_splits = ws.row_splits_for(self.regime)
        self.max_blocks = [self._blocks_at_once(prog, split.threads, sms, sharing, ws.hidden)
                           for split in self.row_splits]  # per row split of this program on the workspace
        # world size 1's programs built per call shape (shape_constants.py; one row split only)
        builds = shape_constants.applies(self.regime, self.row_splits, self.profile, ws.hidden)
        self.shape_builds = {} if builds else None
        # the streaming builds for calls of few routes split the row their own way (shape_constants.few_routes)
        self.few_routes_split = (row_split(ws.hidden // 8, shape_constants.FEW_ROUTES_VEC_PER_THREAD, ALL_TOKENS)
                                 if builds and ws.vec_per_thread is None
                                 and shape_constants.few_routes(self.regime, self.profile, ws.hidden) else None)
        self.sms, self.sharing = sms, sharing
        self.function_ptr = prog.function_ptr
        self.cluster_function_ptr = prog.cluster_function_ptr
        self.threads = [split.threads for split in self.row_splits]
        self.cluster_blocks = cluster_blocks_for(self.regime, self.row_splits) if prog.cluster_function_ptr else 1
        # the most tokens a call runs in the cluster layout, per top_k (index: top_k), and at any top_k
        self.cluster_max_tokens_by_top_k = tuple(cluster_max_tokens_for(self.row_splits, self.cluster_blocks, k)
                                                 for k in range(_CLUSTER_MAX_ROUTES + 1))
        self.cluster_max_tokens = max(self.cluster_max_tokens_by_top_k)
        # the cluster layout's own split, one vector a thread over the cluster's blocks; a split the
        # workspace fixes (vec_per_thread) is every call's, the cluster layout's too
        self.cluster_split = (cluster_layout_split(ws.hidden // 8, self.cluster_blocks, self.cluster_max_tokens)
                              if ws.vec_per_thread is None else self.row_splits[0])
        # the launch attributes of a cluster launch, without and with PDL (kept alive with the launcher)
        self.cluster_attrs = (_cluster_attributes(self.cluster_blocks, False),
                              _cluster_attributes(self.cluster_blocks, True))
        # The fields every call of this program on this workspace shares.
        template = self.template = registry.params_struct()()
        for r, ptr in enumerate(ws.peer_buffer_ptrs):
            template.peer_buffers[r] = ptr or None
        memory = ws._moe_ar_state.memory
        template.state = memory.state
        template.error = memory.error_host
        template.buffer_elems = ws.buffer_elems
        template.timeout_ns = ws.timeout_ns
        template.hidden = ws.hidden
        template.rank = ws.rank
        self.pointer_base = type(template).allreduce_in.offset
        self.device_index = ws.device_index
        _driver()  # loaded here, not on the launch path

    def _blocks_at_once(self, prog, threads: int, sms: int, sharing: int, hidden: int) -> int:
        """The grid limit of `prog` under a split of `threads` threads: its blocks resident at once."""
        per_sm = prog.max_blocks_per_sm(threads, self.dynamic_smem)
        if per_sm < 1:
            raise ValueError(f"hidden: {hidden} needs {threads} threads a block, which {self.name} cannot run")
        return max(1, per_sm * sms // sharing)

    def _shape_build(self, ws, top_k: int, scale_kind: int, T: int, cluster: bool = False) -> tuple:
        """(kernel, grid limit, row split) of this program built for the workspace's row and a call's
        top_k and router weight kind, built at the first call signature that needs it; with `cluster`,
        its cluster kernel built for the cluster layout's split (the grid limit None: a cluster launch
        takes T * cluster_blocks blocks). The latency program's one-block kernel is built bound to one
        block a multiprocessor at least for calls of T tokens where shape_constants says so; the
        streaming program's build for a call of few routes has its own split and register cap."""
        few = self.takes_few_routes(top_k)
        split = self.few_routes_split if few else self.cluster_split if cluster else self.row_splits[0]
        min_blocks = (None if cluster or self.regime != registry.LOCAL_LATENCY_REGIME
                      else shape_constants.one_block_min_blocks(split.vec_per_thread, split.threads, T))
        key = (top_k, scale_kind, min_blocks) + (("cluster",) if cluster else ())
        build = self.shape_builds.get(key)
        if build is None:
            prefix = shape_constants.defines(ws.hidden, top_k, scale_kind, split.vec_per_thread, split.threads,
                                             min_blocks, shape_constants.FEW_ROUTES_REGISTER_CAP if few else None)
            prog = registry.load(self.name, self.device_index, prefix)
            build = self.shape_builds[key] = (prog.cluster_function_ptr, None, split) if cluster else (
                prog.function_ptr, self._blocks_at_once(prog, split.threads, self.sms, self.sharing, ws.hidden),
                split)
        return build

    def takes_few_routes(self, top_k: int) -> bool:
        """Whether this launcher runs calls of top_k routes as the streaming program's few-routes build."""
        return self.few_routes_split is not None and top_k <= shape_constants.FEW_ROUTES_MAX_TOP_K

    def one_wave_tokens(self) -> int:
        """The most tokens a call of this program runs in one wave of blocks, a block a token: its
        grid limit under the row split of its largest calls (the program as built for every shape)."""
        return self.max_blocks[-1]

    def row_split_index(self, T: int) -> int:
        """The index in row_splits of the split a call of T tokens uses."""
        return next(i for i, split in enumerate(self.row_splits) if T <= split.max_tokens)

    def kernel_call(self, ws, T, a, order) -> "_KernelCall":
        """The launch state of a call signature: the kernel argument with this program's fields and the
        call's scalars, where the data pointers of `order` (call argument names, in kernel field
        order) go in it, and the launch configuration."""
        params = type(self.template)()
        ctypes.memmove(ctypes.addressof(params), ctypes.addressof(self.template), ctypes.sizeof(params))
        scale = a["expert_scale_factor"]
        params.scale_kind = 0 if scale is None else (1 if scale.dtype == torch.float32 else 2)
        flags = registry.program_set().constants["QuantFlag"]  # Params.quant_flags bits (generator/abi.py)
        params.quant_flags = ((flags["kScalesColumnMajor"] if a["fp8_scale_layout"] == "column" else 0)
                              | (flags["kScalesPow2"] if a["fp8_pow2_scales"] else 0))
        params.fault_stop_after = ws._moe_ar_state.fault_stop_after_units  # tests only; 0 in real use
        params.tokens, params.top_k, params.rows = T, a["expanded_idx_to_permuted_idx"].shape[1], \
            a["allreduce_in"].shape[0]
        params.routed_scaling_factor = a["routed_scaling_factor"]
        params.eps = a["eps"]
        params.weight_bias = float(a["weight_bias"])
        cluster = self.uses_cluster(T, params.top_k)
        split = self.cluster_split if cluster else self.row_splits[self.row_split_index(T)]
        function_ptr, max_blocks = self.cluster_function_ptr if cluster else self.function_ptr, None
        if self.shape_builds is not None and shape_constants.serves(self.regime, T, params.top_k,
                                                                     self.takes_few_routes(params.top_k)):
            function_ptr, max_blocks, split = self._shape_build(ws, params.top_k, params.scale_kind, T, cluster)
        params.vec_per_thread = split.vec_per_thread
        config = self.config_for(ws, T, a["launch_with_pdl"], params.top_k, max_blocks, split.threads)
        return _KernelCall(params, order, config, function_ptr)

    def uses_cluster(self, T: int, top_k: int) -> bool:
        """Whether a call of T tokens and top_k routes runs the cluster layout (world size 1, few tokens)."""
        return top_k <= _CLUSTER_MAX_ROUTES and T <= self.cluster_max_tokens_by_top_k[top_k]

    def config_for(self, ws, T, pdl, top_k, max_blocks=None, threads=None):
        """The launch configuration of a call of T tokens and top_k routes (the stream is set at each
        launch); `max_blocks` and `threads`: the grid limit and block of a shape build (default: the
        program's)."""
        i = self.row_split_index(T)
        limit = self.max_blocks[i] if max_blocks is None else max_blocks
        config = _LaunchConfig()
        if self.uses_cluster(T, top_k):
            # world size 1's cluster layout: a token a cluster, the row's threads over its blocks (local.cuh)
            config.gridDimX = T * self.cluster_blocks
            config.gridDimY = config.gridDimZ = config.blockDimY = config.blockDimZ = 1
            config.blockDimX = self.cluster_split.threads // self.cluster_blocks
            config.sharedMemBytes = self.dynamic_smem
            attrs = self.cluster_attrs[bool(pdl)]
            config.attrs, config.numAttrs = attrs, len(attrs)
            return config
        if self.sliced_units:  # a unit is one row slice
            config.gridDimX = min(T * self.row_splits[i].vec_per_thread, limit)
        elif self.column_units:  # a unit is one column: a token of each rank
            config.gridDimX = balanced_grid(-(-T // ws.world_size), limit)
        else:  # a unit is one row
            config.gridDimX = min(T, limit)
        config.gridDimY = config.gridDimZ = config.blockDimY = config.blockDimZ = 1
        config.blockDimX = self.threads[i] if threads is None else threads
        config.sharedMemBytes = self.dynamic_smem
        if pdl:
            config.attrs, config.numAttrs = _PDL_ATTRIBUTE, 1
        return config

    def launch(self, kernel: "_KernelCall", pointers) -> None:
        """Launch on the current stream; `pointers`: the data pointers in the kernel call's order."""
        kernel.packer.pack_into(kernel.params, self.pointer_base, *pointers)
        kernel.config.hStream = _current_stream(self.device_index)
        err = _cu_launch_kernel_ex(kernel.config_ref, kernel.function_ptr, kernel.param_pointer, None)
        if err:
            raise RuntimeError(f"cuLaunchKernelEx({self.name}) failed: CUresult {err}")


_CLUSTER_MAX_ROUTES = 8  # the cluster layout runs the all-loads row (local.cuh): top_k <= 8


def cluster_blocks_for(regime: str, row_splits) -> int:
    """Blocks a cluster of world size 1's latency program spreads a token over (1: no cluster layout):
    the largest C <= cluster_max_blocks that divides the warps of its one row split, where C >= 2, the
    row has cluster_min_warps warps or more and the split is the all-loads one (2 vectors a thread or
    fewer, whole warps)."""
    if regime != registry.LOCAL_LATENCY_REGIME or len(row_splits) != 1:
        return 1
    split = row_splits[0]
    limits = registry.program_set().limits
    if split.vec_per_thread > 2 or split.threads % 32 or split.threads // 32 < limits["cluster_min_warps"]:
        return 1
    warps = split.threads // 32
    most = limits["cluster_max_blocks"]
    blocks = max(c for c in range(1, most + 1) if warps % c == 0)
    return blocks if blocks >= 2 else 1


def cluster_max_tokens_for(row_splits, cluster_blocks: int, top_k: int) -> int:
    """The most tokens a call of world size 1's latency program with top_k routes runs in its cluster
    layout (0: none): the manifest's cluster_max_tokens for rows of cluster_round_min_warps warps or
    more; smaller rows (H 2048 to 6143) gain less from the spread, the less the fewer routes a token
    loads: cluster_small_row_many_routes_max_tokens at top_k >= cluster_many_routes_top_k, else
    cluster_small_row_max_tokens (generator/abi.py)."""
    if cluster_blocks <= 1 or top_k > _CLUSTER_MAX_ROUTES:
        return 0
    limits = registry.program_set().limits
    if row_splits[0].threads // 32 >= limits["cluster_round_min_warps"]:
        return limits["cluster_max_tokens"]
    if top_k >= limits["cluster_many_routes_top_k"]:
        return limits["cluster_small_row_many_routes_max_tokens"]
    return limits["cluster_small_row_max_tokens"]


class _KernelCall:
    """A launch of one program for one call signature (everything but the data pointers and stream)."""

    __slots__ = ("params", "param_pointer", "packer", "config", "config_ref", "function_ptr")

    def __init__(self, params, order, config, function_ptr):
        self.params, self.config, self.function_ptr = params, config, function_ptr
        self.param_pointer = (ctypes.c_void_p * 1)(ctypes.addressof(params))  # cuLaunchKernelEx's kernelParams
        self.config_ref = ctypes.byref(config)
        # The pointer fields are consecutive 8-byte words (generator/abi.py): the call's pointers go
        # to the fields of `order`, in order; the others stay 0 (struct pad bytes).
        fields = {_FIELD_OF[name] for name in order}
        self.packer = struct.Struct("<" + "".join("Q" if f in fields else "8x" for f in _POINTER_FIELDS))


# ---- the driver call -------------------------------------------------------------------------
# cuLaunchKernelEx straight through ctypes: its configuration is a prebuilt structure per call
# signature, so a launch sets the stream and makes one foreign call (layouts from cuda.h).

class _LaunchAttributeValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("programmaticStreamSerializationAllowed", ctypes.c_int),
                ("clusterDim", ctypes.c_uint * 3)]


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _LaunchAttributeValue)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_PDL_ATTRIBUTE = (_LaunchAttribute * 1)()
_PDL_ATTRIBUTE[0].id = _CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_PDL_ATTRIBUTE[0].value.programmaticStreamSerializationAllowed = 1
_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4


def _cluster_attributes(blocks: int, pdl: bool):
    """The launch attributes of a cluster of `blocks` blocks along x, and PDL if asked."""
    attrs = (_LaunchAttribute * (1 + int(pdl)))()
    attrs[0].id = _CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attrs[0].value.clusterDim[:] = (blocks, 1, 1)
    if pdl:
        attrs[1].id = _CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attrs[1].value.programmaticStreamSerializationAllowed = 1
    return attrs


_cu_launch_kernel_ex = None


def _driver() -> None:
    """Load the driver's cuLaunchKernelEx (once). Called with the GIL held (PyDLL), as torch launches:
    a launch returns at once, and letting the GIL go and taking it back per call costs more."""
    global _cu_launch_kernel_ex
    if _cu_launch_kernel_ex is None:
        libcuda = ctypes.PyDLL("libcuda.so.1")
        fn = libcuda.cuLaunchKernelEx
        fn.restype = ctypes.c_int
        fn.argtypes = (ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
        _cu_launch_kernel_ex = fn


def _current_stream(device_index: int) -> int:
    return torch.cuda.current_stream(device_index).cuda_stream


if hasattr(torch._C, "_cuda_getCurrentRawStream"):
    _current_stream = torch._C._cuda_getCurrentRawStream  # noqa: F811  (the same value, without a Stream object)


def balanced_grid(units: int, max_blocks: int) -> int:
    """Blocks for `units` columns of the pipelined two-shot: as many as fit, less the ones that would
    leave the other blocks a round of columns to do alone. Every block then takes the same number of
    columns, give or take one at the end (1,024 columns, 396 blocks fit: 342 blocks of 3 columns,
    not 232 blocks of 3 and 164 of 2). A last round run by a few blocks leaves HBM idle
    (bench_results/pipelined/grid/ measures both grids)."""
    grid = min(units, max_blocks)
    rounds = -(-units // grid)
    return -(-units // rounds)


def launcher_for(ws, name: str) -> _Launcher:
    """The launcher of program `name` on workspace `ws`, built at its first use."""
    launchers = ws._moe_ar_state.launchers
    launcher = launchers.get(name)
    if launcher is None:
        launcher = launchers[name] = _Launcher(ws, name)
    return launcher

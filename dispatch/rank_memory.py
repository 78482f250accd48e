"""One rank's memory, allocated once: its rotating buffers from one of two backends, its device
state words and its host-mapped error words.

    buffers  3 x buffer_elems elements of dtype, filled with -0.0 (the Lamport sentinel);
             peers write into them, only this rank reads and clears them
    state    8 uint32 in device memory: call counter, extent written into each buffer, ...
    error    4 uint32 in host-mapped memory: the kernel records a timeout there and the host
             reads it on the next call without synchronizing

Backends (only the buffers differ; the state and error words are local and allocated alike, and the
kernels see one pointer per rank either way, so the same generated programs run on both):

    ipc        cudaMalloc, CUDA IPC handles exchanged on the group: one host only
    symm_mem   torch.distributed._symmetric_memory (its CUDA backend, cuMem allocations) mapped by
               torch's rendezvous on the group: one host, or hosts of one multi-node NVLink domain.
               NVLink multicast stays off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1 unless the caller set it)
"""
from __future__ import annotations

import ctypes
import os

import numpy as np
import torch

from . import backend_facts, registry

SENTINEL_WORD = 0x80008000  # two -0.0 halves


def state_word(name: str) -> int:
    """A device state word's index, or kStateWords (their number): the manifest's StateWord
    (generator/abi.py SHARED_ENUMS, which params.cuh renders for the kernels)."""
    return registry.program_set().constants["StateWord"][name]


def error_word(name: str) -> int:
    """A host-mapped error word's index, or kErrorWords (their number): the manifest's ErrorWord."""
    return registry.program_set().constants["ErrorWord"][name]


_LAZY = {"STATE_WORDS": (state_word, "kStateWords"), "STATE_BAD_ROWS": (state_word, "kBadRows"),
         "ERROR_WORDS": (error_word, "kErrorWords")}


def __getattr__(name):  # the names of _LAZY, for importers: read from the manifest at first use
    if name in _LAZY:
        fn, word = _LAZY[name]
        return fn(word)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
_CUDA_HOST_ALLOC_PORTABLE_MAPPED = 0x01 | 0x02
# Torch's CUDA symmetric memory builds an NVLink multicast object at rendezvous unless this is set;
# our kernels use none, and multicast can take a shared host's GPUs down.
MULTICAST_ENV = "TORCH_SYMM_MEM_DISABLE_MULTICAST"


class _CudaMallocBuffers:
    """Buffers from cudaMalloc: the CUDA IPC backend exports them; EmulatedWorld's ranks share them
    within the process. Called with the device current."""

    def __init__(self, device_index: int, nbytes: int):
        from cupy.cuda import runtime
        self.ptr = runtime.malloc(nbytes)

    def release(self) -> None:
        from cupy.cuda import runtime
        ptr, self.ptr = self.ptr, 0  # never freed twice, even if this free fails
        if ptr:
            runtime.free(ptr)


class SymmMemBuffers:
    """Buffers from torch symmetric memory (its CUDA backend): a block of torch's symmetric allocator
    of its own, not one of its implicit pool, which would keep the block past close() and hand it
    back with the peers' mappings torch cached for it (ranks whose pools returned different blocks
    would pair mappings that do not match). rendezvous() maps every peer's block. NVLink multicast
    stays off: MULTICAST_ENV is set to "1" before the allocation unless the caller set it."""

    def __init__(self, device_index: int, nbytes: int):
        os.environ.setdefault(MULTICAST_ENV, "1")
        self.symm = backend_facts.symm_mem_module()
        self.nbytes = nbytes
        self.handle = None
        self.ptrs = []
        self.tensor = self.symm._SymmetricMemory.empty_strided_p2p((nbytes,), (1,), torch.uint8,
                                                                   torch.device("cuda", device_index))
        self.ptr = self.tensor.data_ptr()
        if self.ptr % 16:  # the kernels store 16-byte vectors; every rank's block has the same layout
            raise RuntimeError(f"torch's symmetric buffer at {self.ptr:#x} is not 16-byte aligned")

    def rendezvous(self, group, rank: int, world_size: int) -> int:
        """torch's rendezvous on `group` (collective: torch exchanges and maps every rank's block).
        Returns this rank's buffers' offset in its block, which every peer adds to its pointer to the
        block. Raises if a peer's block has no pointer here (a peer torch could not map)."""
        handle = self.symm.rendezvous(self.tensor, group)
        if handle is None:
            raise RuntimeError("torch's rendezvous returned no handle (the buffers are not torch symmetric memory)")
        self.handle = handle
        ptrs = [int(p or 0) for p in handle.buffer_ptrs]
        if len(ptrs) != world_size or getattr(handle, "rank", rank) != rank:
            raise RuntimeError(f"torch's rendezvous gave rank {getattr(handle, 'rank', '?')} of {len(ptrs)}, expected "
                               f"rank {rank} of {world_size}")
        missing = [str(r) for r, p in enumerate(ptrs) if not p]
        if missing:
            raise RuntimeError(f"torch's rendezvous mapped no buffers of rank {', '.join(missing)} (a peer reachable "
                               f"only over the network?)")
        offset = self.ptr - ptrs[rank]
        size = getattr(handle, "buffer_size", None)
        if offset < 0 or (size is not None and offset + self.nbytes > size):
            raise RuntimeError(f"the buffers (at offset {offset}, {self.nbytes} bytes) are not inside torch's block "
                               f"of {size} bytes")
        self.ptrs = ptrs
        return offset

    def peer_pointers(self, offsets: list) -> list:
        """Every rank's buffers in this process's address space, from every rank's offset."""
        return [p + o for p, o in zip(self.ptrs, offsets)]

    def release(self) -> None:
        """Drop the handle and the tensor. Torch then unmaps the peers' blocks and unmaps and releases
        this rank's (cuMemUnmap / cuMemRelease, after synchronizing the device); the driver returns a
        block's memory once every rank that mapped it has released it too."""
        self.handle = None
        self.ptrs = []
        self.tensor = None
        self.ptr = 0


class RankMemory:
    """One rank's buffers, state and error words, on one device. `buffers`: what allocates the
    buffers (_CudaMallocBuffers or SymmMemBuffers); the state and error words are the same for every
    backend (local: no peer touches them)."""

    def __init__(self, device_index: int, buffer_elems: int, elem_size: int, buffers=_CudaMallocBuffers):
        import cupy
        from cupy.cuda import runtime
        self.device_index = device_index
        self.buffer_bytes = 3 * buffer_elems * elem_size
        self.block = None
        self.buffers = self.state = self.error_host = 0
        try:
            with cupy.cuda.Device(device_index):
                self.block = buffers(device_index, self.buffer_bytes)
                self.buffers = self.block.ptr
                self.state = runtime.malloc(state_word("kStateWords") * 4)
            self.error_host = runtime.hostAlloc(error_word("kErrorWords") * 4, _CUDA_HOST_ALLOC_PORTABLE_MAPPED)
            # With unified addressing a mapped host allocation has the same address on the device.
            self.error = np.ctypeslib.as_array((ctypes.c_uint32 * error_word("kErrorWords")).from_address(self.error_host))
            self.reset()
        except BaseException:
            self.free(quiet=True)  # what was taken before the step that failed
            raise

    def reset(self) -> None:
        """Sentinel into every buffer, zero state and error words (the device is synchronized)."""
        import cupy
        from cupy.cuda import runtime
        with cupy.cuda.Device(self.device_index):
            mem = cupy.cuda.UnownedMemory(self.buffers, self.buffer_bytes, self, self.device_index)
            words = cupy.ndarray((self.buffer_bytes // 4,), cupy.uint32, cupy.cuda.MemoryPointer(mem, 0))
            words.fill(SENTINEL_WORD)
            runtime.memset(self.state, 0, state_word("kStateWords") * 4)
            runtime.deviceSynchronize()
        self.error[:] = 0

    def read_state(self) -> np.ndarray:
        import cupy
        from cupy.cuda import runtime
        out = np.zeros(state_word("kStateWords"), np.uint32)
        with cupy.cuda.Device(self.device_index):
            runtime.deviceSynchronize()
            runtime.memcpy(out.ctypes.data, self.state, state_word("kStateWords") * 4, runtime.memcpyDeviceToHost)
        return out

    def free(self, quiet: bool = False) -> None:
        """Release what is allocated, each part on its own (also after a failed constructor); the
        first error is raised at the end unless `quiet` (cleanup while another error is raised)."""
        import cupy
        from cupy.cuda import runtime
        errors = []

        def attempt(fn, *args):
            try:
                fn(*args)
            except Exception as e:
                errors.append(e)

        if self.block is not None or self.state:
            try:
                with cupy.cuda.Device(self.device_index):
                    attempt(runtime.deviceSynchronize)  # no kernel may still use the buffers
                    block, self.block, self.buffers = self.block, None, 0  # never released twice
                    if block is not None:
                        attempt(block.release)
                    ptr, self.state = self.state, 0
                    if ptr:
                        attempt(runtime.free, ptr)
            except Exception as e:
                errors.append(e)
        if self.error_host:
            ptr, self.error_host = self.error_host, 0
            attempt(runtime.freeHost, ptr)
        if errors and not quiet:
            raise errors[0]


class LocalMemory:
    """World size 1's device memory: the state words only. No buffers and no host-mapped error words
    (nothing can time out: error stays zero). What the launcher and check() read of a workspace's
    memory, as workspace.RankMemory has it."""

    buffers = 0         # no rotating buffers
    buffer_bytes = 0
    error_host = 0      # the kernel's error pointer: null (the local programs never write it)

    def __init__(self, device_index: int):
        import cupy
        from cupy.cuda import runtime
        self.device_index = device_index
        self.error = np.zeros(error_word("kErrorWords"), np.uint32)
        self.state = 0
        with cupy.cuda.Device(device_index):
            self.state = runtime.malloc(state_word("kStateWords") * 4)
        try:
            self.reset()
        except BaseException:
            self.free(quiet=True)
            raise

    def reset(self) -> None:
        """Zero the state words (the skipped-route count); the device is synchronized."""
        import cupy
        from cupy.cuda import runtime
        with cupy.cuda.Device(self.device_index):
            runtime.memset(self.state, 0, state_word("kStateWords") * 4)
            runtime.deviceSynchronize()

    read_state = RankMemory.read_state  # synchronize, copy the state words to the host

    def free(self, quiet: bool = False) -> None:
        """Release the state words once the device's kernels have finished; an error is raised unless `quiet`."""
        import cupy
        from cupy.cuda import runtime
        ptr, self.state = self.state, 0  # never freed twice, even if this free fails
        if not ptr:
            return
        try:
            with cupy.cuda.Device(self.device_index):
                runtime.deviceSynchronize()
                runtime.free(ptr)
        except Exception:
            if not quiet:
                raise

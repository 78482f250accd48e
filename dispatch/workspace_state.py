"""What the package keeps of one workspace: its call plans, launchers, memory, peers' buffers,
open/closed state and the test-only fault setting, behind one interface.

The workspace is the user's object: its public names are the ones dispatch/API.md documents. The
package's own per-workspace state lives in a WorkspaceState instead, which the workspace holds as
`ws._moe_ar_state`, the one private attribute that other modules read (op.py, call_plan.py,
launcher.py, emulated_world.py; tests/test_private_names_cpu.py keeps it the only one). Its names
are the package's interface:

    plans           call signature -> call_plan.CallPlan (op.py bounds their number)
    recent_plans    op.py's most recently used plans, first the last call's (the short path)
    launchers       program name -> launcher._Launcher, built at the program's first call
    memory          rank_memory.RankMemory or LocalMemory (None until allocated)
    peer_buffers    each rank's buffers in this process's address space (max_world_size entries, 0: none)
    closed          True once closed (a Workspace also while its ranks build it)
    timeout_ns      the workspace's deadline, for the timeout message
    fault_stop_after_units  tests only (setting it drops the plans; see below)

    ensure_open()        ValueError once closed
    check_error_words()  RuntimeError once a kernel of this rank recorded a timeout
    ensure_callable()    both, in that order: the launch path's one call
    forget()             closed: no plan or launcher is kept
"""
from __future__ import annotations

from . import registry
from .rank_memory import error_word


def phase_meaning(phase: int) -> str:
    """What a call waited for in the phase it timed out in (the manifest's Phase, generator/abi.py)."""
    return registry.program_set().constant_meanings["Phase"].get(phase, str(phase))


class WorkspaceState:
    """One workspace's state, as the package's modules use it (module doc)."""

    __slots__ = ("plans", "recent_plans", "launchers", "memory", "peer_buffers", "closed", "timeout_ns",
                 "_fault_stop_after_units")

    def __init__(self):
        self.plans = {}
        self.recent_plans = []
        self.launchers = {}
        self.memory = None
        self.peer_buffers = [0] * registry.program_set().limits["max_world_size"]
        self.closed = False
        self.timeout_ns = 0
        self._fault_stop_after_units = 0

    def ensure_open(self) -> None:
        if self.closed:
            raise ValueError("workspace: this workspace was closed")

    def check_error_words(self) -> None:
        if self.memory.error[0]:  # kErrCode is word 0 (test_abi_constants_cpu.py keeps it there)
            self._raise_timeout()

    def ensure_callable(self) -> None:
        """ensure_open() and check_error_words() in one call (the launch path's)."""
        if self.closed:
            raise ValueError("workspace: this workspace was closed")
        if self.memory.error[0]:
            self._raise_timeout()

    def _raise_timeout(self):
        err = self.memory.error
        rank, phase = int(err[error_word("kErrRank")]), int(err[error_word("kErrPhase")])
        raise RuntimeError(
            f"moe_finalize_allreduce: rank {rank} timed out in phase {phase_meaning(phase)} "
            f"(a peer did not take part in a call within {self.timeout_ns / 1e9:g} s). The workspace's buffers "
            f"are now inconsistent: call reset() on every rank's workspace (or rebuild them) before the next call.")

    def forget(self) -> None:
        """Closed: no plan or launcher refers to the workspace any more (its memory is freed by the caller)."""
        self.closed = True
        self.launchers.clear()
        self.plans.clear()
        self.recent_plans.clear()

    @property
    def fault_stop_after_units(self) -> int:
        """Fault injection for tests only: > 0 makes this rank's kernels send that many phase-1 work
        units and stop (tests/test_gpu_reliability.py). Read when a plan is built, into its kernel
        argument; setting it drops every plan, so that a call never checks it."""
        return self._fault_stop_after_units

    @fault_stop_after_units.setter
    def fault_stop_after_units(self, units: int) -> None:
        if type(units) is not int or not 0 <= units < 2 ** 31:
            raise ValueError(f"fault_stop_after_units: {units!r}, expected an int in 0..2^31-1")
        self._fault_stop_after_units = units
        self.plans.clear()
        self.recent_plans.clear()

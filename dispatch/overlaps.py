"""Which of a call's tensors may share memory: an output with no input and no other output (only
residual_out may be residual_in itself), and, all ranks in one process, an output of one rank with
no tensor of another rank."""
from __future__ import annotations

import torch

_OUTPUT_NAMES = ("norm_out", "residual_out", "quant_out", "scale_out")
_INPUT_NAMES = ("allreduce_in", "expanded_idx_to_permuted_idx", "expert_scale_factor", "shared_expert_output",
                "residual_in", "norm_weight", "global_scale", "fp8_scale")
_OVERLAP_RULE = ("an output must not share memory with an input or another output; only residual_out may be "
                 "residual_in itself (in place: the same data pointer, shape and dtype)")
IN_PLACE = ("residual_out", "residual_in")  # (output, input): the one output that may be that input itself


def overlap_pairs(names) -> list:
    """The overlap rule over a call's tensors, by name: (i, j, in_place) for each pair names[i],
    names[j] that must not share a byte: every output with each output before it (i the earlier),
    then with every input (i the output); in_place: names[i] may be names[j] itself, exactly
    (IN_PLACE). The full checks (check_overlaps) and a plan's short path both take their pairs from
    here; the order is the one the full checks report in."""
    outputs = [k for k, name in enumerate(names) if name in _OUTPUT_NAMES]
    inputs = [k for k, name in enumerate(names) if name not in _OUTPUT_NAMES]
    pairs = []
    for n, k in enumerate(outputs):
        pairs += [(e, k, False) for e in outputs[:n]]
        pairs += [(k, j, (names[k], names[j]) == IN_PLACE) for j in inputs]
    return pairs


def check_overlaps(outputs, inputs):
    """outputs, inputs: lists of (name, tensor, data pointer) of checked (contiguous) tensors, whose
    bytes are exactly [pointer, pointer + nbytes). Raises ValueError naming an output for any pair of
    overlap_pairs that shares a byte, except residual_out exactly over residual_in."""
    spans = [(name, p, p + x.nbytes) for name, x, p in outputs + inputs]
    for i, j, in_place in overlap_pairs([name for name, _, _ in spans]):
        (name, lo, hi), (other, olo, ohi) = spans[i], spans[j]
        if max(lo, olo) < min(hi, ohi):  # a shared byte (an empty tensor shares none)
            if in_place:
                if lo == olo and hi == ohi:  # both [T, H] D: residual_in itself
                    continue
                raise ValueError(f"residual_out: overlaps residual_in in memory without being residual_in "
                                 f"itself; {_OVERLAP_RULE}")
            raise ValueError(f"{name}: overlaps {other} in memory; {_OVERLAP_RULE}")


def _spans(a):
    """(name, first byte, one past the last byte, is an output) of every non-empty tensor a checked
    call reads or writes (outputs allocated or given)."""
    out = []
    for names, is_out in ((_OUTPUT_NAMES, True), (_INPUT_NAMES, False)):
        for name in names:
            x = a.get(name)
            if isinstance(x, torch.Tensor) and x.numel():
                p = x.data_ptr()
                out.append((name, p, p + x.numel() * x.element_size(), is_out))
    return out


def check_rank_overlaps(per_rank_args) -> None:
    """All ranks in one process (EmulatedWorld.run): an output of one rank sharing memory with any
    tensor of another rank is a ValueError naming per_rank_kwargs[r] and the argument. per_rank_args:
    each rank's checked arguments (with its outputs); inputs may be shared by ranks."""
    spans = sorted((lo, hi, r, name, is_out) for r, a in enumerate(per_rank_args)
                   for name, lo, hi, is_out in _spans(a))
    active = []  # spans that may still overlap what comes next (sorted by start)
    for lo, hi, r, name, is_out in spans:
        active = [s for s in active if s[1] > lo]
        for _, _, r2, name2, is_out2 in active:
            if r2 != r and (is_out or is_out2):
                (ro, no), (ri, ni) = ((r, name), (r2, name2)) if is_out else ((r2, name2), (r, name))
                raise ValueError(f"per_rank_kwargs[{ro}]: {no} overlaps {ni} of per_rank_kwargs[{ri}] in memory "
                                 f"(each rank's outputs need memory of their own)")
        active.append((lo, hi, r, name, is_out))

"""The public entries refuse a bad call with a ValueError naming the argument on any machine, a CPU
one included (no torch AssertionError, no AttributeError from deep inside)."""
import pytest
import torch

import dispatch


def test_max_tokens_out_of_range_names_both_bounds():
    from dispatch.workspace_sizes import MAX_TOKENS
    with pytest.raises(ValueError, match=rf"max_tokens: 0 is out of range, expected 1\.\.{MAX_TOKENS}"):
        dispatch.LocalWorkspace(max_tokens=0, hidden=256, dtype=torch.bfloat16)


def test_select_program_names_a_workspace_that_is_not_one():
    with pytest.raises(ValueError, match="ws: None is not a dispatch workspace"):
        dispatch.select_program(None, 16)


def test_the_call_names_a_workspace_that_is_not_one():
    x = torch.zeros(2, 16)
    with pytest.raises(ValueError, match="workspace: 'ws' is not a dispatch workspace"):
        dispatch.moe_finalize_allreduce("ws", allreduce_in=x, expanded_idx_to_permuted_idx=x, residual_in=x,
                                        norm_weight=x)


def test_warmup_names_one_string_and_a_missing_gpu(monkeypatch):
    with pytest.raises(ValueError, match="names: a list of program names"):
        dispatch.warmup("moe_ar_local_bf16_ws1_plain")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match="device_index: no CUDA GPU"):
        dispatch.warmup([dispatch.programs()[0]])


def test_emulated_world_without_a_gpu_names_devices(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match="devices: no CUDA GPU"):
        dispatch.EmulatedWorld(2, max_tokens=16, hidden=256, dtype=torch.bfloat16)

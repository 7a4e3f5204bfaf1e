"""The simulated out-of-memory error reads as CUDA's: the failing request is not in use."""

import re

import pytest
import torch
from torch import nn

import helpers
from helpers.measure.memory import fmt_bytes, oom_message

CUDA = re.compile(
    r"CUDA out of memory\. Tried to allocate (?P<req>[\d.]+ \w+)\. GPU 0 has a total capacity "
    r"of (?P<cap>[\d.]+ \w+) of which (?P<free>[\d.]+ \w+) is free\. Of the allocated memory "
    r"(?P<used>[\d.]+ \w+) is allocated by PyTorch, and 0 bytes is reserved by PyTorch but "
    r"unallocated\."
)


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 bytes"),
        (1024, "1024 bytes"),
        (1025, "1.00 KiB"),
        (2**20, "1024.00 KiB"),
        (2**20 + 1, "1.00 MiB"),
        (3 * 2**30, "3.00 GiB"),
    ],
)
def test_sizes_print_as_cuda_format_size(n, text):
    assert fmt_bytes(n) == text  # c10/cuda/CUDACachingAllocator.cpp: format_size


def test_message_adds_up_like_cudas():
    used = {"parameters": 3000, "gradients": 0, "optimizer_state": 0, "activations": 500}
    used["total"] = 3500
    m = CUDA.match(oom_message(2048, 4096, used))
    assert m and m["req"] == "2.00 KiB" and m["cap"] == "4.00 KiB"
    assert m["free"] == "596 bytes" and m["used"] == "3.42 KiB"  # free + in use = capacity


def test_the_failing_activation_is_not_counted_as_in_use():
    model = nn.Linear(1000, 1000, bias=False)  # 4,000,000 bytes of parameters
    x = torch.randn(16, 1000)  # the activation autograd saves: 64,000 bytes
    with pytest.raises(torch.OutOfMemoryError) as err:
        with helpers.memory_limit(4_050_000, model):
            model(x).sum()
    m = CUDA.match(str(err.value))
    assert m, str(err.value)
    assert m["req"] == fmt_bytes(64_000) and m["used"] == fmt_bytes(4_000_000)
    assert m["free"] == fmt_bytes(50_000) and m["cap"] == fmt_bytes(4_050_000)
    assert "activations 0 bytes" in str(err.value)  # the request is not already "in use"


def test_growth_found_at_a_check_is_the_request():
    model = nn.Linear(100, 100)  # 40,400 bytes of parameters
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(torch.OutOfMemoryError) as err:
        with helpers.memory_limit(100_000, model, opt) as budget:
            model(torch.randn(2, 100)).sum().backward()
            budget.check()  # parameters + gradients: 80,800 bytes, fits
            opt.step()  # Adam's two moments: 80,800 bytes more
            budget.check()
    m = CUDA.match(str(err.value))
    assert m["req"] == fmt_bytes(80_800) and m["used"] == fmt_bytes(80_800)
    assert m["free"] == fmt_bytes(100_000 - 80_800)


def test_parameters_alone_too_big_fail_on_entry_with_nothing_in_use():
    with pytest.raises(torch.OutOfMemoryError) as err:
        with helpers.memory_limit(1000, nn.Linear(100, 100)):
            pass
    m = CUDA.match(str(err.value))
    assert m["req"] == fmt_bytes(40_400) and m["used"] == "0 bytes" and m["free"] == "1000 bytes"


def test_a_budget_that_fails_on_entry_leaves_no_hook_behind():
    with pytest.raises(torch.OutOfMemoryError):
        with helpers.memory_limit(1000, nn.Linear(100, 100)):
            pass
    model = nn.Linear(100, 100)
    model(torch.randn(4, 100)).sum().backward()  # no budget is active any more: no error

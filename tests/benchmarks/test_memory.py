"""The CPU peak-memory tracker counts live tensor storage, forward and backward."""

import torch

from benchmarks.memory import TensorMemoryTracker, peak_memory_bytes

MB = 1_000_000


def test_peak_counts_live_storages_and_frees_dead_ones():
    def work():
        a = torch.ones(MB // 4)  # 1 MB
        b = torch.ones(MB // 4)  # 2 MB live
        del a, b
        c = torch.ones(3 * MB // 4)  # 3 MB live at once: the peak
        return c.sum()

    assert 3 * MB <= peak_memory_bytes(work) < 3 * MB + 4096


def test_backward_allocations_are_seen():
    x = torch.randn(500, 500, requires_grad=True)
    tracker = TensorMemoryTracker()
    with tracker:
        y = (x * 2).exp()  # x*2 is freed after exp; y is saved for backward
        y.sum().backward()
    one = 500 * 500 * 4
    assert tracker.peak >= 3 * one  # y, a gradient temporary, x.grad
    assert tracker.peak < 5 * one


def test_views_do_not_double_count():
    def work():
        a = torch.ones(MB // 4)
        return a.view(2, -1)[0] + 0  # the view shares a's storage

    assert peak_memory_bytes(work) < 1.6 * MB

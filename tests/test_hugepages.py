"""Packed weights on transparent huge pages (worker/hugepages.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from worker.hugepages import HUGE_PAGE_BYTES, on_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _anon_huge_bytes(address: int) -> int:
    """AnonHugePages of the mapping holding `address`, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(a, 16) for a in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return 0


def test_the_copy_is_equal_aligned_and_small_tensors_stay_put():
    t = torch.randn(1536, 1024, generator=torch.Generator().manual_seed(0)).bfloat16()
    h = on_huge_pages(t)
    assert torch.equal(h, t) and h.is_contiguous() and h.data_ptr() != t.data_ptr()
    assert h.data_ptr() % HUGE_PAGE_BYTES == 0
    small = torch.randn(64, 64)
    assert on_huge_pages(small) is small


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                    reason="this kernel offers no transparent huge pages")
def test_the_copy_is_backed_by_huge_pages():
    h = on_huge_pages(torch.randn(4 * HUGE_PAGE_BYTES // 4))
    assert _anon_huge_bytes(h.data_ptr()) >= 2 * HUGE_PAGE_BYTES

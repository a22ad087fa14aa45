"""Host-side bookkeeping of the paged pool: which pages are free, which pages each slot holds, the page table.

Pages 1 .. P-1 are allocatable (page 0 is the null page, `paged.NULL_PAGE`). A slot's pages are its logical
pages 0, 1, ... in order; `grow` gives a slot enough pages for a number of rows (all or nothing), `release` takes
them all back. `table` is the `[slots, max_pages]` page table to copy to the device after a change.
"""

from __future__ import annotations

import numpy as np

from hspec_jax.serving.paged import NULL_PAGE


def pages_for(rows: int, page_size: int) -> int:
    """Pages that hold `rows` rows."""
    return -(-rows // page_size)


class PageAllocator:
    def __init__(self, num_pages: int, slots: int, max_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"a pool needs at least 2 pages (the null page and one more), got {num_pages}")
        self.num_pages, self.page_size, self.max_pages = num_pages, page_size, max_pages
        self.free = list(range(num_pages - 1, NULL_PAGE, -1))  # popped from the end: lowest ids first
        self.held: list[list[int]] = [[] for _ in range(slots)]
        self.table = np.full((slots, max_pages), NULL_PAGE, np.int32)

    @property
    def usable(self) -> int:
        """Allocatable pages (all but the null page)."""
        return self.num_pages - 1

    @property
    def used(self) -> int:
        return self.usable - len(self.free)

    def grow(self, slot: int, rows: int) -> bool:
        """Give `slot` pages for its first `rows` rows; False (and nothing changed) when the pool or the page table
        is too small."""
        need = pages_for(rows, self.page_size) - len(self.held[slot])
        if need <= 0:
            return True
        if need > len(self.free) or len(self.held[slot]) + need > self.max_pages:
            return False
        for _ in range(need):
            page = self.free.pop()
            self.table[slot, len(self.held[slot])] = page
            self.held[slot].append(page)
        return True

    def release(self, slot: int) -> int:
        """Return every page of `slot` to the pool -> how many."""
        pages = self.held[slot]
        self.free.extend(reversed(pages))
        self.held[slot] = []
        self.table[slot] = NULL_PAGE
        return len(pages)

    def check(self) -> None:
        """Raise if a page is leaked, shared by two slots, or the table disagrees with what the slots hold."""
        held = [p for pages in self.held for p in pages]
        everything = sorted(held + self.free)
        if everything != list(range(1, self.num_pages)):
            raise AssertionError(f"pages leaked or shared: held {sorted(held)}, free {sorted(self.free)}")
        for slot, pages in enumerate(self.held):
            expected = pages + [NULL_PAGE] * (self.max_pages - len(pages))
            if self.table[slot].tolist() != expected:
                raise AssertionError(f"page table of slot {slot} is {self.table[slot].tolist()}, holds {pages}")

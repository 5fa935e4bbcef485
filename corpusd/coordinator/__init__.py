"""The coordinator: holder registry with leases, placement (WaterFill + dynamic CP), the
durable global page table, and all-or-nothing publishing of pinned corpora onto holders."""

"""The memory plan: what a run will hold on the device, line by line, and how many KV pages that leaves.

Before anything large is allocated, :mod:`runtime.app.memory_checks` fills a :class:`MemoryPlan` from the config:
fixed lines (weights per dtype, named workspaces, CUDA graphs, the activation peak of the largest step, small
tables) and per-page lines (the KV pool, DeepSeek-V4's compressed pools, the indexer keys, the draft pool: bytes
per ``kv.page_size`` page). With ``kv.num_pages=auto`` on CUDA the pools take ``memory.fraction`` of the device
memory that the fixed lines leave free; on the CPU ``auto`` is a fixed :data:`CPU_NUM_PAGES`. An explicit page
count is kept, and refused (with every over-budget line and its fix) when the peak exceeds what the device has.

How much memory there is comes from an injected :class:`MemoryReader` (the container's ``memory_reader``):
:class:`DeviceMemory` reads the GPU (``torch.cuda.mem_get_info``) and the host (``/proc/meminfo``); tests inject a
:class:`FixedMemory`.
"""

from __future__ import annotations

import gc
import os
from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch

CPU_NUM_PAGES = 1024  # kv.num_pages=auto on the CPU: a fixed pool (host memory is not sized from)
GiB = 1 << 30


@dataclass(frozen=True)
class MemoryReading:
    """Bytes a memory has in all (``total``) and what this process may still take (``free``)."""

    total: int
    free: int


class MemoryReader(Protocol):
    """Where the plan learns how much memory there is (the container's ``memory_reader`` provider)."""

    def device(self, device: torch.device) -> MemoryReading: ...

    def host(self) -> MemoryReading: ...

    def peak(self, device: torch.device) -> int: ...


def _meminfo() -> MemoryReading:
    """Host memory: MemTotal and MemAvailable of /proc/meminfo (else the page counts of sysconf)."""
    try:
        with open("/proc/meminfo") as f:
            kb = {line.split(":")[0]: int(line.split()[1]) for line in f if line.split()[1:2]}
        return MemoryReading(kb["MemTotal"] * 1024, kb.get("MemAvailable", kb.get("MemFree", 0)) * 1024)
    except (OSError, KeyError, ValueError):
        page = os.sysconf("SC_PAGE_SIZE")
        return MemoryReading(os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page)


class DeviceMemory:
    """The real reader: ``torch.cuda.mem_get_info`` for a GPU, ``/proc/meminfo`` for the host (and the CPU device);
    ``peak`` is the caching allocator's high-water mark (0 on the CPU).

    Before reading the GPU, garbage is collected and the caching allocator hands its wholly unused segments back
    to the driver (``torch.cuda.empty_cache``): an earlier runtime of the same process (a test session, the parity
    reference after the candidate) leaves its freed blocks there. What stays reserved lies in segments that still
    hold live tensors; it is not counted, since a pool's one large tensor cannot be cut from such fragments (counting
    it made a pool of 3 x 41.7 GiB fail at its third layer on an H200, with 42 GiB reserved but unallocated)."""

    def device(self, device: torch.device) -> MemoryReading:
        device = torch.device(device)
        if device.type != "cuda":
            return self.host()
        gc.collect()  # a dropped runtime caught in a reference cycle still holds its pools until collected
        with torch.cuda.device(device):
            torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        return MemoryReading(int(total), int(free))

    def host(self) -> MemoryReading:
        return _meminfo()

    def peak(self, device: torch.device) -> int:
        device = torch.device(device)
        return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0


@dataclass
class FixedMemory:
    """A reader that reports fixed numbers (tests, and planning for a GPU this machine does not have)."""

    device_total: int
    device_free: int
    host_total: int = 64 * GiB
    host_free: int = 64 * GiB
    peak_bytes: int = 0

    def device(self, device: torch.device) -> MemoryReading:
        return MemoryReading(self.device_total, self.device_free)

    def host(self) -> MemoryReading:
        return MemoryReading(self.host_total, self.host_free)

    def peak(self, device: torch.device) -> int:
        return self.peak_bytes


@dataclass(frozen=True)
class PlanLine:
    """One line of the budget. ``nbytes``: fixed bytes, or for a paged line bytes per page. ``fix``: how a user
    makes it smaller (empty: nothing to do about it). ``host``: held in host memory (pinned) on a GPU run."""

    name: str
    nbytes: int
    fix: str = ""
    host: bool = False


@dataclass
class MemoryPlan:
    """The budget of one run on one rank.

    Attributes
    ----------
    device : the device's name; ``total`` / ``free`` its bytes when the plan was made
    fixed : lines whose bytes do not depend on the page count
    paged : lines of bytes per page (the pools ``kv.num_pages`` sizes)
    num_pages : the page count (page 0 is the padding page); ``auto``: it came from ``kv.num_pages=auto``
    min_pages : the fewest pages the workload can run with (one longest request)
    reference : the parity reference's own plan (it runs after this run's model is freed), or None
    reference_skip : why the parity reference cannot run here (empty: it can, or check=off)
    """

    device: str
    total: int
    free: int
    host_total: int
    host_free: int
    on_cpu: bool
    fraction: float
    page_size: int
    fixed: list[PlanLine] = field(default_factory=list)
    paged: list[PlanLine] = field(default_factory=list)
    num_pages: int = 0
    auto: bool = False
    min_pages: int = 2
    activation: str = "estimated"  # estimated | given (memory.activation_bytes)
    reference: MemoryPlan | None = None
    reference_skip: str = ""

    # ----------------------------------------------------------------------------------------- sums
    def fixed_bytes(self, host: bool = False) -> int:
        return sum(x.nbytes for x in self.fixed if x.host == host)

    def page_bytes(self, host: bool = False) -> int:
        return sum(x.nbytes for x in self.paged if x.host == host)

    def peak_bytes(self, host: bool = False) -> int:
        """What the run holds at its peak on the device (``host``: in pinned host memory)."""
        return self.fixed_bytes(host) + self.num_pages * self.page_bytes(host)

    @property
    def budget(self) -> int:
        """Bytes the device side may take: the device's free memory (the CPU: the host's available memory)."""
        return self.free

    @property
    def tokens(self) -> int:
        return max(0, self.num_pages - 1) * self.page_size

    def on_device(self) -> tuple[int, int]:
        """(fixed, per page) bytes that count against the device budget: on the CPU host lines count too."""
        if self.on_cpu:
            return self.fixed_bytes() + self.fixed_bytes(True), self.page_bytes() + self.page_bytes(True)
        return self.fixed_bytes(), self.page_bytes()

    def pages_that_fit(self, fraction: float = 1.0) -> int:
        """Pages that ``fraction`` of the memory the fixed lines leave free holds (0 when nothing is left)."""
        fixed, per_page = self.on_device()
        left = self.budget - fixed
        if per_page <= 0 or left <= 0:
            return 0
        return int(fraction * left) // per_page

    def rows(self) -> list[tuple[str, int]]:
        """(label, bytes) line by line, for ``+explain=true`` and the report."""
        out = [("device total", self.total), ("device free at start", self.free)]
        out += [(x.name + (" (host, pinned)" if x.host and not self.on_cpu else ""), x.nbytes) for x in self.fixed]
        out += [(f"{x.name}: {self.num_pages} x {x.nbytes} B" + (" (host, pinned)" if x.host and not self.on_cpu
                                                               else ""), x.nbytes * self.num_pages) for x in self.paged]
        out.append(("peak (device)", self.peak_bytes() + (self.peak_bytes(True) if self.on_cpu else 0)))
        if self.reference is not None:
            out.append(("parity reference (after this model is freed): peak", self.reference.peak_bytes()))
        return out

    def summary(self) -> str:
        """One line: pages, tokens and the peak against the device, for messages (the OOM report)."""
        how = ("kv.num_pages" if not self.auto else f"auto: the CPU's fixed {CPU_NUM_PAGES}" if self.on_cpu
               else f"auto, memory.fraction={self.fraction:g}")
        return (f"memory plan on {self.device}: {self.num_pages} pages ({how}) = {self.tokens} tokens; predicted "
                f"peak {self.peak_bytes() / GiB:.2f} GiB of {self.free / GiB:.2f} GiB free "
                f"({self.total / GiB:.2f} GiB total); activation peak {self.activation}")

    def as_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("fixed", "paged", "reference")}
        out["fixed"] = {x.name: x.nbytes for x in self.fixed}
        out["per_page"] = {x.name: x.nbytes for x in self.paged}
        out["tokens"], out["peak_bytes"] = self.tokens, self.peak_bytes()
        out["host_peak_bytes"] = self.peak_bytes(True)
        out["reference"] = self.reference.as_dict() if self.reference is not None else None
        return out


def agree_pages(pages: int, group) -> int:
    """Under tensor parallelism every rank sized its own pool: the smallest count wins on every rank (a collective:
    every rank calls it; ``group.gather_objects`` of the injected group). tp=1: ``pages``."""
    return min(int(p) for p in group.gather_objects(int(pages))) if group.size > 1 else int(pages)

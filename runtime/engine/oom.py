"""A CUDA out-of-memory error in the middle of a run (a corner the memory plan missed, such as fragmentation):
reported with the step, the batch and the plan, then the engine retracts the step's requests and goes on.

The engine owns the retraction (the same path as an exhausted KV pool: pages return, generated tokens are kept,
the request is prefilled again later, nothing is lost); :class:`OOMGuard` decides whether the run can go on,
releases the allocator's cached blocks, records the event and halves the scheduler's limits so the failed step is
not rebuilt as it was.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from runtime.core.memory_plan import GiB, MemoryPlan, MemoryReader

#: the scheduler limits an out-of-memory step halves (never below 1)
LIMITS = ("max_running_requests", "max_tokens_per_batch", "chunked_prefill_size")


@dataclass(frozen=True)
class OOMEvent:
    """One step that ran out of device memory, as the report lists it."""

    step: int  # index of the step in the run (the failed step is not recorded as a step)
    mode: str
    batch_size: int
    tokens: int
    retracted: int  # the step's requests, all retracted
    limits: dict  # the scheduler limits after the back-off
    peak_bytes: int  # the allocator's high-water mark when it failed (0 on the CPU)
    plan: str  # the memory plan's one-line summary
    error: str

    def as_dict(self) -> dict:
        return asdict(self)


class OutOfMemoryStop(RuntimeError):
    """A step ran out of device memory and the engine cannot retract its way out (the message says why)."""


class OOMGuard:
    """What the engine does with a ``torch.OutOfMemoryError`` raised by a step.

    Parameters
    ----------
    plan : MemoryPlan
        The run's plan (its summary goes into every report of the event).
    group : SingleRank or TPGroup
        With tensor parallelism the error is not recoverable on one rank (the others are inside the step's
        collectives), so it is raised with the report.
    reader : MemoryReader
        The allocator's high-water mark at the failure.
    device : torch.device
    """

    def __init__(self, plan: MemoryPlan, group, reader: MemoryReader, device: torch.device):
        self.plan, self.group, self.reader, self.device = plan, group, reader, torch.device(device)

    def handle(self, error: BaseException, step: int, batch, limits: dict, retracted: int) -> OOMEvent:
        """Report the failure of step ``step`` (``batch``: its ForwardBatch; None: a speculative round of
        ``retracted`` requests) and halve ``limits`` in place; raise :class:`OutOfMemoryStop` when retracting cannot
        help: tensor parallelism, or a step that was already the smallest (one request, one token)."""
        peak = self.reader.peak(self.device)
        mode, size, tokens = ((batch.mode.value, batch.batch_size, batch.num_tokens) if batch is not None
                              else ("speculative round", retracted, retracted))
        where = (f"step {step} ({mode}, {size} requests, {tokens} tokens) ran out of device memory (allocator peak "
                 f"{peak / GiB:.2f} GiB); {self.plan.summary()}")
        if self.group.size > 1:
            raise OutOfMemoryStop(f"{where}. Tensor parallelism: the other ranks are inside this step's collectives, "
                                  "so one rank cannot retract alone. Fix: lower kv.num_pages or memory.fraction, or "
                                  "workload.max_tokens_per_batch") from error
        if size <= 1 and tokens <= 1:
            raise OutOfMemoryStop(f"{where}. The step was already one request of one token. Fix: lower kv.num_pages "
                                  "or memory.fraction (more room for activations), or use fewer layers") from error
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the failed step's freed blocks back to the device
        for key in LIMITS:
            limits[key] = max(1, int(limits[key]) // 2)
        return OOMEvent(step, mode, size, tokens, retracted,
                        {k: limits[k] for k in LIMITS}, peak, self.plan.summary(), str(error).split("\n")[0][:300])

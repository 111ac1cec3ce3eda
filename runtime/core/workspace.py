"""The workspace ledger: the one door through which backends get device scratch memory.

Every workspace is a named :class:`WorkspaceSpec`. Nothing is allocated until a consumer acquires it, so a
workspace that no built object consumes costs zero bytes, and the report says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from runtime.core.errors import ConfigError, Problem

if TYPE_CHECKING:
    from runtime.core.device import DeviceInfo
    from runtime.core.dsv4_spec import DSV4AttentionSpec
    from runtime.core.model_spec import ModelSpec


@dataclass(frozen=True)
class WorkspaceSpec:
    """A named device buffer.

    Attributes
    ----------
    name : str
        Ledger key; consumers of a shareable workspace get the same tensor.
    nbytes : int
        Size in bytes (the tensor is uint8 [nbytes]; consumers view it as they need).
    zero_init : bool
        Fill with zeros at allocation (kernels that read counters or flags need it).
    shareable : bool
        Several consumers may hold it at once (they must not use it concurrently).
    """

    name: str
    nbytes: int
    zero_init: bool = False
    shareable: bool = False


@dataclass(frozen=True)
class WorkspaceInputs:
    """What a backend class sizes its workspaces from (its ``workspace_specs`` classmethod). The container and the
    memory plan build it from the same resolved config, so the plan's bytes are the bytes the ledger allocates.

    Attributes
    ----------
    model : ModelSpec
        This rank's model (its share of the heads).
    cfg : dict
        The resolved plain root config (``backend``, ``kv``, ``graph``, ``speculative``, ``workspace`` sections).
    device : DeviceInfo
        The device the workspaces live on (its kind resolves ``impl=auto``; its SM count sizes split scratch).
    v4_attention : DSV4AttentionSpec or None
        DeepSeek-V4: this rank's attention spec (``num_heads / tp``); None for other models.
    """

    model: ModelSpec
    cfg: dict
    device: DeviceInfo
    v4_attention: DSV4AttentionSpec | None = None


class WorkspaceLedger:
    """Allocates each workspace once, lazily, and keeps name -> bytes for the report.

    Parameters
    ----------
    device : torch.device
    known : sequence of str
        Every workspace name the runtime can build; unconsumed ones are reported with 0 bytes.
    """

    def __init__(self, device: torch.device, known: tuple[str, ...] = ()):
        self.device = device
        self._known = list(known)
        self._buffers: dict[str, torch.Tensor] = {}
        self._specs: dict[str, WorkspaceSpec] = {}
        self._consumers: dict[str, list[str]] = {}

    def acquire(self, spec: WorkspaceSpec, consumer: str,
                allocate: Callable[[int], torch.Tensor] | None = None) -> torch.Tensor:
        """The buffer of ``spec`` (uint8 [spec.nbytes]); allocated on the first call, by ``allocate(nbytes)`` when
        given (memory of another allocator, e.g. the symmetric memory of the all-reduce's IPC buffers)."""
        if spec.name in self._buffers:
            held = self._specs[spec.name]
            if not (held.shareable and spec.shareable) or held.nbytes < spec.nbytes:
                raise ConfigError(
                    [
                        Problem(
                            what=f"workspace '{spec.name}' requested by '{consumer}'",
                            got=f"already held by {self._consumers[spec.name]} "
                            f"(shareable={held.shareable}, {held.nbytes} bytes)",
                            expected=f"a shareable workspace of at least {spec.nbytes} bytes",
                            fix="give the second consumer its own workspace name, or mark both shareable",
                        )
                    ]
                )
            self._consumers[spec.name].append(consumer)
            return self._buffers[spec.name]
        alloc = torch.zeros if spec.zero_init else torch.empty
        self._buffers[spec.name] = allocate(spec.nbytes) if allocate is not None else \
            alloc(spec.nbytes, dtype=torch.uint8, device=self.device)
        self._specs[spec.name] = spec
        self._consumers[spec.name] = [consumer]
        if spec.name not in self._known:
            self._known.append(spec.name)
        return self._buffers[spec.name]

    def report(self) -> dict[str, int]:
        """name -> bytes allocated, 0 for a known workspace nobody consumed."""
        return {name: (self._specs[name].nbytes if name in self._specs else 0) for name in self._known}

    def specs(self) -> dict[str, WorkspaceSpec]:
        """name -> spec of every workspace allocated so far."""
        return dict(self._specs)

    def consumers(self) -> dict[str, list[str]]:
        return {name: list(c) for name, c in self._consumers.items()}

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self._specs.values())

"""DeepSeek-V4 attention shape as a small frozen value, independent of :class:`runtime.core.model_spec.ModelSpec`.

V4 attention is shared-KV MQA (one ``head_dim``-wide KV row is both key and value for every query head) over a
sliding window of the latest ``sliding_window`` tokens, plus, on compressed layers, entries that each summarise a
window of ``compress_rate`` tokens:

* ``sliding``: the window only;
* ``csa`` (compressed sparse attention): entries every ``compress_rates.csa`` tokens (overlapping windows of
  twice that width); a lightning indexer picks ``index_topk`` of them per query;
* ``hca`` (heavily compressed attention): entries every ``compress_rates.hca`` tokens; every query attends to all
  entries whose window has closed.

The backend (``backends/dsv4.py``) and the pools (:mod:`runtime.core.dsv4_pools`) are built from this value; the
model builds it from a Hugging Face ``config.json`` (:meth:`DSV4AttentionSpec.from_hf_config`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class DSV4LayerType(str, enum.Enum):
    sliding = "sliding_attention"
    csa = "compressed_sparse_attention"
    hca = "heavily_compressed_attention"


@dataclass(frozen=True)
class DSV4AttentionSpec:
    """Attention shape of a DeepSeek-V4 model.

    Attributes
    ----------
    num_heads : int
        Query heads H (all share one KV head).
    head_dim : int
        D, width of a query head and of a KV row (512 in V4); the last ``rope_dim`` channels carry RoPE.
    rope_dim : int
        Rotary channels at the end of every head (64 in V4).
    sliding_window : int
        W: a query at position t sees window tokens ``t - W + 1 .. t``.
    layer_types : tuple of DSV4LayerType
        One per decoder layer.
    csa_rate, hca_rate : int
        Tokens per compressed entry of CSA / HCA layers.
    index_n_heads, index_head_dim, index_topk : int
        Lightning indexer heads, key width and entries kept per query (CSA layers).
    """

    num_heads: int
    head_dim: int
    rope_dim: int
    sliding_window: int
    layer_types: tuple[DSV4LayerType, ...]
    csa_rate: int
    hca_rate: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int

    @property
    def sm_scale(self) -> float:
        return self.head_dim**-0.5

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def layers_of(self, kind: DSV4LayerType) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == kind]

    def rate_of(self, layer_id: int) -> int:
        """Tokens per compressed entry of ``layer_id`` (0 for a sliding-only layer)."""
        kind = self.layer_types[layer_id]
        return {DSV4LayerType.csa: self.csa_rate, DSV4LayerType.hca: self.hca_rate}.get(kind, 0)

    @classmethod
    def from_hf_config(cls, cfg: dict) -> DSV4AttentionSpec:
        """From a DeepSeek-V4 ``config.json`` dict (as ``transformers.DeepseekV4Config.to_dict()`` writes it:
        ``layer_types`` and ``compress_rates`` resolved; legacy ``compress_ratios`` also accepted)."""
        head_dim = int(cfg["head_dim"])
        rope = cfg.get("qk_rope_head_dim") or int(head_dim * float(cfg.get("partial_rotary_factor") or 64 / 512))
        rates = dict(cfg.get("compress_rates") or {})
        csa = int(rates.get(DSV4LayerType.csa.value, cfg.get("compress_rate_csa", 4)))
        hca = int(rates.get(DSV4LayerType.hca.value, cfg.get("compress_rate_hca", 128)))
        types = cfg.get("layer_types")
        if types is None:
            by_ratio = {0: DSV4LayerType.sliding, csa: DSV4LayerType.csa, hca: DSV4LayerType.hca}
            types = [by_ratio[int(r)].value for r in cfg["compress_ratios"]]
        return cls(
            num_heads=int(cfg["num_attention_heads"]),
            head_dim=head_dim,
            rope_dim=int(rope),
            sliding_window=int(cfg["sliding_window"]),
            layer_types=tuple(DSV4LayerType(t) for t in types[: int(cfg["num_hidden_layers"])]),
            csa_rate=csa,
            hca_rate=hca,
            index_n_heads=int(cfg["index_n_heads"]),
            index_head_dim=int(cfg["index_head_dim"]),
            index_topk=int(cfg["index_topk"]),
        )


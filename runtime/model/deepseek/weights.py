"""The weights of a DeepSeek model as plain tensors, and their seeded random initialisation (the presets).

Linear weights keep the Hugging Face layout ``[out, in]`` (applied with ``F.linear``), so a checkpoint's
tensors are used as they are stored. ``kv_b_proj`` is split at load into ``w_uk`` [H, qk_nope, kv_lora] and
``w_uv`` [H, kv_lora, v_head] for the absorbed path. ``q_a_proj`` and ``kv_a_proj_with_mqa`` (both read the
normed hidden state) are concatenated once, at load or random init, into ``qkv_a``: one GEMM per layer
(:meth:`AttentionWeights.of`); ``q_a`` and ``kv_a`` are views of it.

``model.weights=fp8`` (a preset) generates the same float weights and keeps each tensor DeepSeek's fp8 release
stores in fp8 (:func:`runtime.model.deepseek.stored.release_fp8`) as a :class:`~runtime.model.quantized.BlockFP8`
(quantized whole, then cut, so every tp holds the same blocks); ``kv_b_proj`` goes through fp8 and back to the
model dtype, as a stored checkpoint's does at load. A linear weight field below is a float tensor or a BlockFP8.

Random initialisation: normal weights scaled by 1/sqrt(fan_in); the projections that write into the residual
stream (attention output, MLP down) are scaled by a further 1/sqrt(2 * num_layers) (the GPT-2 / Megatron
residual init), so the stream stays O(1) through depth and the first layers already say much of what the whole
stack says, as in a trained model (a draft made of the first layers is accepted at a meaningful rate).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from runtime.core.config import LayerKind
from runtime.core.model_spec import MLPLayer, ModelSpec
from runtime.core.parallel import ONE_RANK, Sharding
from runtime.model.deepseek.sharding import FULL, experts_of, tensor_cut
from runtime.model.deepseek.stored import RELEASE_ROUTER, release_fp8, router_dtype
from runtime.model.indexer import IndexerWeights
from runtime.model.quantized import BlockFP8, bytes_by_dtype, cat_rows


def _named(obj, prefix: str = ""):
    """(field path, tensor or BlockFP8) of every weight of a weights dataclass, nested ones included. Tuples are
    not walked: they hold other views of the same storage (:attr:`MoEWeights.stacked`), counted once here."""
    for k, v in vars(obj).items():
        if isinstance(v, (torch.Tensor, BlockFP8)):
            yield prefix + k, v
        elif dataclasses.is_dataclass(v):
            yield from _named(v, f"{prefix}{k}.")


def _tensors(obj) -> list[torch.Tensor]:
    """Every tensor of a weights dataclass (a BlockFP8's values and scales), nested weights dataclasses included."""
    return [t for _, v in _named(obj) for t in (v.tensors if isinstance(v, BlockFP8) else [v])]


@dataclass
class AttentionWeights:
    """One MLA layer (attention half of a decoder layer). Build it with :meth:`of` (which fuses q_a and kv_a)."""

    attn_norm: torch.Tensor  # [D]
    qkv_a: torch.Tensor  # [q_lora + kv_lora + rope, D]: q_a_proj rows (q LoRA only), then kv_a_proj_with_mqa rows
    q_a_norm: torch.Tensor | None  # [q_lora]
    q_b: torch.Tensor  # [H * qk_head, q_in]   (q_in = q_lora or D; q_proj without q LoRA)
    kv_a_norm: torch.Tensor  # [kv_lora]
    w_uk: torch.Tensor  # [H, qk_nope, kv_lora]   (kv_b's key half)
    w_uv: torch.Tensor  # [H, kv_lora, v_head]    (kv_b's value half, transposed)
    o: torch.Tensor  # [D, H * v_head]
    indexer: IndexerWeights | None = None  # sparse layers (DeepSeek-V3.2)

    @classmethod
    def of(cls, attn_norm, q_a: torch.Tensor | None, q_a_norm, q_b, kv_a: torch.Tensor, kv_a_norm, w_uk, w_uv, o,
           indexer: IndexerWeights | None = None) -> AttentionWeights:
        """The layer's weights from the checkpoint's separate projections: q_a [q_lora, D] (None without q
        LoRA) and kv_a [kv_lora + rope, D] concatenated once into ``qkv_a``."""
        qkv_a = kv_a if q_a is None else cat_rows([q_a, kv_a])
        return cls(attn_norm, qkv_a, q_a_norm, q_b, kv_a_norm, w_uk, w_uv, o, indexer)

    @property
    def q_lora(self) -> int:
        """q LoRA rank (0 without q LoRA): the rows of ``qkv_a`` that are q_a_proj."""
        return 0 if self.q_a_norm is None else self.q_a_norm.shape[0]

    @property
    def q_a(self) -> torch.Tensor | None:
        """[q_lora, D] view of ``qkv_a`` (None without q LoRA)."""
        return self.qkv_a[: self.q_lora] if self.q_lora else None

    @property
    def kv_a(self) -> torch.Tensor:
        """[kv_lora + rope, D] view of ``qkv_a`` (kv_a_proj_with_mqa)."""
        return self.qkv_a[self.q_lora :]

    @property
    def tensors(self) -> list[torch.Tensor]:
        return _tensors(self)


@dataclass
class LinearLayerWeights:
    """A lightning-style linear-attention layer: SiLU(q), SiLU(k), v, per-head recurrent state, out norm."""

    attn_norm: torch.Tensor  # [D]
    wq: torch.Tensor  # [D, Hl * dk]
    wk: torch.Tensor  # [D, Hl * dk]
    wv: torch.Tensor  # [D, Hl * dv]
    out_norm: torch.Tensor  # [Hl * dv]
    wo: torch.Tensor  # [Hl * dv, D]

    @property
    def tensors(self) -> list[torch.Tensor]:
        return _tensors(self)


@dataclass
class DenseMLPWeights:
    """SwiGLU: down(silu(gate x) * up x)."""

    gate_up: torch.Tensor  # [2 * I, D]  (gate rows, then up rows)
    down: torch.Tensor  # [D, I]

    @property
    def tensors(self) -> list[torch.Tensor]:
        return _tensors(self)


@dataclass
class MoEWeights:
    """Router, routed experts (stacked), shared experts."""

    gate: torch.Tensor  # [E, D] router: float32, or the model's 16-bit dtype as stored (stored.router_dtype)
    bias: torch.Tensor | None  # [E] float32 e_score_correction_bias (sigmoid routing)
    gate_up: torch.Tensor  # [E, 2 * I_moe, D]
    down: torch.Tensor  # [E, D, I_moe]
    shared: DenseMLPWeights | None  # intermediate I_moe * n_shared_experts
    first_expert: int = 0  # global id of gate_up[0] (expert parallelism: this rank's first expert)
    # (gate_up [E + 1, 2 I, D], down [E + 1, D, I]): the routed experts and the shared expert in one stack, the
    # shared one last (model.shared_expert_fusion); gate_up / down / shared above are views of it. The fused ops'
    # grouped GEMMs take the shared expert as one more group; None: it has products of its own
    stacked: tuple | None = None

    @property
    def tensors(self) -> list[torch.Tensor]:
        return _tensors(self)


@dataclass
class DecoderLayerWeights:
    attn: AttentionWeights | LinearLayerWeights
    mlp_norm: torch.Tensor | None = None  # [D] post_attention_layernorm (None: attention-only layer)
    mlp: DenseMLPWeights | MoEWeights | None = None

    @property
    def tensors(self) -> list[torch.Tensor]:
        return _tensors(self)


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [V, D] (tensor parallelism: this rank's vocabulary rows [vocab_start, + V / tp))
    layers: list[DecoderLayerWeights]
    final_norm: torch.Tensor  # [D]
    lm_head: torch.Tensor  # [V, D] (the embedding itself when tied; rows as embed's)
    load_seconds: float = 0.0
    peak_host_bytes: int = 0
    source: str = "random"
    stored_dtypes: dict = field(default_factory=dict)  # checkpoint dtype -> tensors read in it (dequantized / cast)
    extra: dict = field(default_factory=dict)
    vocab_start: int = 0  # first vocabulary id of embed / lm_head (0 without tensor parallelism)

    def first(self, n: int) -> ModelWeights:
        """The same tensors (by reference) with only the first ``n`` layers: the speculative draft."""
        return ModelWeights(self.embed, self.layers[:n], self.final_norm, self.lm_head, source=self.source,
                            vocab_start=self.vocab_start)

    def named(self):
        """(group, tensor or BlockFP8) of every weight once (a tied lm_head is the embedding); groups name the field
        across layers: ``embed``, ``attn.q_b``, ``mlp.gate_up``, ``mlp.shared.down``, ..."""
        yield "embed", self.embed
        yield "final_norm", self.final_norm
        if self.lm_head is not self.embed:
            yield "lm_head", self.lm_head
        for lw in self.layers:
            yield from _named(lw)

    @property
    def nbytes(self) -> int:
        """The bytes the weights hold on the device, as stored (fp8 values, their scales, 16-bit tensors)."""
        return sum(self.bytes_by_dtype().values())

    def bytes_by_dtype(self) -> dict[str, int]:
        """dtype -> bytes as held (:func:`runtime.model.quantized.bytes_by_dtype`)."""
        return bytes_by_dtype(v for _, v in self.named())

    def unquantized_bytes(self) -> dict[str, int]:
        """Weight group -> bytes of the weights held in a float dtype (not block-fp8): with stored fp8 weights, what
        the release keeps in 16 / 32 bits plus ``attn.w_uk`` / ``attn.w_uv`` (kv_b_proj, dequantized for the
        absorbed path)."""
        out: dict[str, int] = {}
        seen: set[int] = set()
        for group, v in self.named():
            if isinstance(v, torch.Tensor) and id(v) not in seen:
                seen.add(id(v))
                out[group] = out.get(group, 0) + v.numel() * v.element_size()
        return out


def stacks_shared(spec: ModelSpec, shard: Sharding) -> bool:
    """Whether a MoE layer's expert stacks take the shared expert as one more slot (``model.shared_expert_fusion``):
    one shared expert, as wide as a routed one on this rank (not under expert parallelism, where a rank holds whole
    routed experts and a slice of the shared one)."""
    return spec.shared_expert_fusion and spec.n_shared_experts == 1 and not shard.expert_parallel


def moe_weights(gate, bias, gate_up, down, shared: DenseMLPWeights | None, n_local: int,
                first_expert: int) -> MoEWeights:
    """The MoE layer over expert stacks of ``n_local`` routed experts, or of ``n_local + 1`` slots
    (:func:`stacks_shared`), whose last slot receives the shared expert (copied in; ``shared`` then views it)."""
    if gate_up.shape[0] == n_local:
        return MoEWeights(gate, bias, gate_up, down, shared, first_expert)
    if (shared is None or gate_up.shape[0] != n_local + 1 or type(shared.gate_up) is not type(gate_up)
            or tuple(shared.gate_up.shape) != tuple(gate_up.shape[1:])
            or tuple(shared.down.shape) != tuple(down.shape[1:]) or shared.gate_up.dtype != gate_up.dtype):
        raise ValueError(f"the shared expert's slot: got stacks of {gate_up.shape[0]} experts for {n_local} routed "
                         f"ones and a shared expert {None if shared is None else tuple(shared.gate_up.shape)}; "
                         f"expected one shared expert of the routed experts' shape and storage "
                         f"{tuple(gate_up.shape[1:])}. Fix: model.shared_expert_fusion=false")
    gate_up[n_local], down[n_local] = shared.gate_up, shared.down
    return MoEWeights(gate, bias, gate_up[:n_local], down[:n_local],
                      DenseMLPWeights(gate_up[n_local], down[n_local]), first_expert, stacked=(gate_up, down))


def split_kv_b(kv_b: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj.weight [H * (qk_nope + v_head), kv_lora] -> w_uk [H, qk_nope, kv_lora], w_uv [H, kv_lora, v_head]
    (H: the heads the tensor holds: all of them, or a tensor-parallel rank's)."""
    w = kv_b.view(-1, spec.qk_nope_head_dim + spec.v_head_dim, spec.kv_lora_rank)
    return (w[:, : spec.qk_nope_head_dim].contiguous(),
            w[:, spec.qk_nope_head_dim :].transpose(1, 2).contiguous())


def random_weights(spec: ModelSpec, device: torch.device, shard: Sharding = ONE_RANK) -> ModelWeights:
    """Seeded random weights of ``spec`` (a function of ``spec.weight_seed`` and the device kind: the generator
    runs on ``device`` so real-width experts need no host copy). With tensor parallelism (``shard``) every full
    tensor is generated in the same order and this rank keeps its slice (:mod:`.sharding`), so every tp serves
    the same model; the experts of other ranks (moe=ep) are generated and dropped."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(spec.weight_seed)
    s = spec
    fp8 = spec.weights == "fp8"

    def w(*shape: int, fan_in: int, residual: bool = False, dtype: torch.dtype | None = None,
          name: str = "") -> torch.Tensor | BlockFP8 | None:
        """The next seeded tensor (generated whole; block-fp8 where the fp8 release stores it so, with
        ``model.weights=fp8``); this rank's cut of it, None when it holds none of it."""
        scale = fan_in * (2 * s.num_layers if residual else 1)
        t = torch.randn(*shape, generator=gen, dtype=torch.float32, device=device) / scale**0.5
        cut = tensor_cut(name, tuple(shape), s, shard) if name else FULL
        if cut is None:
            return None
        if fp8 and dtype is None and release_fp8(name, tuple(shape)):
            return cut.apply(BlockFP8.quantize(t)).contiguous()
        return cut.apply(t).to(dtype or s.dtype).contiguous()

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=s.dtype)

    def gate_up(inter: int, prefix: str) -> torch.Tensor | BlockFP8 | None:
        """Full [2I, D] generated at once (gate rows, then up rows); this rank's gate rows, then its up rows."""
        t = w(2 * inter, d, fan_in=d, dtype=torch.float32)
        cut = tensor_cut(f"{prefix}.gate_proj.weight", (inter, d), s, shard)
        if cut is None:
            return None
        t = BlockFP8.quantize(t) if fp8 else t.to(s.dtype)
        return cat_rows([cut.apply(t[:inter]), cut.apply(t[inter:])])

    def mlp(inter: int, prefix: str) -> DenseMLPWeights:
        return DenseMLPWeights(gate_up=gate_up(inter, prefix),
                               down=w(d, inter, fan_in=inter, residual=True, name=f"{prefix}.down_proj.weight"))

    h, d = s.num_heads, s.hidden_size
    hl, dl = s.linear_num_heads, s.linear_head_dim
    vocab = shard.part(s.vocab_size)
    embed = w(s.vocab_size, d, fan_in=1, name="model.embed_tokens.weight")
    layers = []
    for i, (kind, mkind) in enumerate(zip(s.layer_kinds, s.mlp_kinds)):
        p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
        if kind == LayerKind.linear:
            attn = LinearLayerWeights(
                attn_norm=ones(d), wq=w(d, hl * dl, fan_in=d), wk=w(d, hl * dl, fan_in=d),
                wv=w(d, hl * dl, fan_in=d), out_norm=ones(hl * dl), wo=w(hl * dl, d, fan_in=hl * dl, residual=True))
        else:
            q_in = s.q_lora_rank or d
            kv_b = w(h * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank, fan_in=s.kv_lora_rank,
                     name=f"{a}.kv_b_proj.weight")
            w_uk, w_uv = split_kv_b(kv_b.dequantize(s.dtype) if isinstance(kv_b, BlockFP8) else kv_b, s)
            attn = AttentionWeights.of(
                attn_norm=ones(d),
                q_a=w(s.q_lora_rank, d, fan_in=d, name=f"{a}.q_a_proj.weight") if s.q_lora_rank else None,
                q_a_norm=ones(s.q_lora_rank) if s.q_lora_rank else None,
                q_b=w(h * s.qk_head_dim, q_in, fan_in=q_in,
                      name=f"{a}.q_b_proj.weight" if s.q_lora_rank else f"{a}.q_proj.weight"),
                kv_a=w(s.kv_row_dim, d, fan_in=d, name=f"{a}.kv_a_proj_with_mqa.weight"),
                kv_a_norm=ones(s.kv_lora_rank),
                w_uk=w_uk, w_uv=w_uv,
                o=w(d, h * s.v_head_dim, fan_in=h * s.v_head_dim, residual=True, name=f"{a}.o_proj.weight"),
                indexer=_random_indexer(s, w, q_in, f"{a}.indexer") if kind == LayerKind.sparse else None,
            )
        layer = DecoderLayerWeights(attn)
        if mkind == MLPLayer.dense:
            layer.mlp_norm, layer.mlp = ones(d), mlp(s.intermediate_size, f"{p}.mlp")
        elif mkind == MLPLayer.moe:
            e, im = s.n_routed_experts, s.moe_intermediate_size
            mine = experts_of(s.n_routed_experts, shard)
            im_local = im if shard.expert_parallel else len(range(im)[shard.part(im)])
            slots = len(mine) + stacks_shared(s, shard)  # the shared expert's slot last
            if fp8:
                gate_ups = BlockFP8.empty((slots, 2 * im_local, d), device)
                downs = BlockFP8.empty((slots, d, im_local), device)
            else:
                gate_ups = torch.empty(slots, 2 * im_local, d, dtype=s.dtype, device=device)
                downs = torch.empty(slots, d, im_local, dtype=s.dtype, device=device)
            for x in range(e):  # one expert at a time: no float32 copy of all experts
                ex = f"{p}.mlp.experts.{x}"
                gu = gate_up(im, ex)
                down = w(d, im, fan_in=im, residual=True, name=f"{ex}.down_proj.weight")
                if x in mine:
                    gate_ups[x - mine.start], downs[x - mine.start] = gu, down
            layer.mlp_norm = ones(d)
            layer.mlp = moe_weights(
                gate=w(e, d, fan_in=d, dtype=torch.bfloat16).to(router_dtype(RELEASE_ROUTER, s.dtype)),
                bias=w(e, fan_in=1e4, dtype=torch.float32) if s.scoring_func == "sigmoid" else None,
                gate_up=gate_ups, down=downs,
                shared=mlp(im * s.n_shared_experts, f"{p}.mlp.shared_experts") if s.n_shared_experts else None,
                n_local=len(mine), first_expert=mine.start)
        layers.append(layer)
    final_norm = ones(d)
    lm_head = embed if s.tie_word_embeddings else w(s.vocab_size, d, fan_in=d, name="lm_head.weight")
    return ModelWeights(embed, layers, final_norm, lm_head, vocab_start=vocab.start)


def _random_indexer(s: ModelSpec, w, q_in: int, prefix: str) -> IndexerWeights:
    hi, di, d = s.index_n_heads, s.index_head_dim, s.hidden_size
    dev = w(1, fan_in=1).device
    return IndexerWeights(
        wq_b=w(hi * di, q_in, fan_in=q_in, name=f"{prefix}.wq_b.weight"),
        wk=w(di, d, fan_in=d, name=f"{prefix}.wk.weight"),
        k_norm_weight=torch.ones(di, dtype=s.dtype, device=dev), k_norm_bias=torch.zeros(di, dtype=s.dtype, device=dev),
        weights_proj=w(hi, d, fan_in=d, dtype=torch.float32))

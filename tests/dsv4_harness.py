"""Tiny random DeepSeek-V4 models from transformers (the oracle) and a minimal driver of our V4 layers over the
V4 pools (not the engine): requests get request-table rows, every step builds a ForwardBatch."""

from __future__ import annotations

import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from backends.dsv4 import DSV4Backend
from runtime.core.batch import ForwardMode, make_batch
from runtime.core.dsv4_pools import DSV4Pools
from runtime.core.model_spec import ModelSpec
from runtime.core.parallel import SingleRank
from runtime.model.deepseek.ops import TorchOps
from runtime.model.dsv4.config import DSV4Config
from runtime.model.dsv4.model import DSV4Model
from runtime.model.dsv4.weights import ModelWeights

LAYERS = ["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
          "compressed_sparse_attention"]


def tiny_hf_config(**over) -> DeepseekV4Config:
    """CSA every 2 tokens (overlapping windows of 4), HCA every 4, window 5, top-3 entries: 20 tokens cross
    many windows. Hash MoE on layer 0, routed elsewhere; YaRN on the compress rope."""
    kw = dict(vocab_size=97, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
              head_dim=16, q_lora_rank=24, partial_rotary_factor=0.25, num_experts_per_tok=2, n_routed_experts=5,
              n_shared_experts=1, layer_types=LAYERS,
              compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
              hc_mult=3, hc_sinkhorn_iters=6, mlp_layer_types=["hash_moe", "moe", "moe", "hash_moe"],
              sliding_window=5, o_groups=2, o_lora_rank=8, index_n_heads=8, index_head_dim=8, index_topk=3,
              swiglu_limit=0.5, rope_theta=50.0, compress_rope_theta=400.0,
              rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                               "beta_fast": 8, "beta_slow": 1},
              max_position_embeddings=32, attn_implementation="eager", experts_implementation="eager", eos_token_id=None, bos_token_id=None)
    kw.update(over)
    return DeepseekV4Config(**kw)


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter and routing buffer non-trivial values (HF zero-inits sinks, position biases, mHC
    bases, tid2eid)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith((".scale", "hc_scale")):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.randint(0, model.config.n_routed_experts, b.shape, generator=g))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def tiny_pair(seed: int = 0, dtype=torch.float64, **over):
    """(HF model in ``dtype``, eval, random; our DSV4Config; our ModelWeights from its state dict)."""
    hf_cfg = tiny_hf_config(**over)
    torch.manual_seed(seed)
    ref = DeepseekV4ForCausalLM(hf_cfg).eval()
    randomize_(ref, seed)
    ref = ref.to(dtype)
    cfg = DSV4Config.from_hf_config(hf_cfg.to_dict())
    weights = ModelWeights.load(dict(ref.state_dict()), cfg=cfg)
    return ref, cfg, weights


class Driver:
    """Our V4 model over fresh pools; runs steps of several requests. ``ops``: the decoder ops (default the torch
    ones, the reference)."""

    def __init__(self, cfg: DSV4Config, weights: ModelWeights, max_requests: int = 4, max_context: int = 64,
                 dtype=torch.float64, entry_page_size: int = 3, impl: str = "torch", ops=None):
        self.pools = DSV4Pools.build(cfg.attention, max_requests, max_context, entry_pages=64,
                                     entry_page_size=entry_page_size, dtype=dtype, device=torch.device("cpu"))
        self.backend = DSV4Backend(self.pools, "float64" if dtype == torch.float64 else "float32", impl=impl)
        spec = ModelSpec.from_config({"name": "tiny_v4", "num_layers": cfg.attention.num_layers,
                                      "hidden_size": cfg.hidden_size, "num_heads": cfg.attention.num_heads,
                                      "vocab_size": cfg.vocab_size, "dtype": str(dtype).removeprefix("torch.")})
        self.model = DSV4Model(spec, cfg, weights, self.pools, self.backend, SingleRank(torch.device("cpu")),
                               ops or TorchOps())
        self.lens: dict[int, int] = {}

    def admit(self, row: int) -> None:
        self.pools.admit(row)
        self.lens[row] = 0

    def step(self, rows: list[int], chunks: list[torch.Tensor], mode: ForwardMode | None = None) -> torch.Tensor:
        """Feed ``chunks[i]`` (token ids [n_i]) to request ``rows[i]`` -> hidden [sum n_i, hidden]."""
        ext = [int(c.numel()) for c in chunks]
        if mode is None:
            mode = ForwardMode.DECODE if all(e == 1 for e in ext) else ForwardMode.EXTEND
        prefix = [self.lens[r] for r in rows]
        for r, p, e in zip(rows, prefix, ext):
            self.pools.reserve(r, p + e)
        batch = make_batch(mode, rows, prefix, ext, [0] * sum(ext), torch.device("cpu"))
        self.backend.init_forward_metadata(batch)
        h = self.model.hidden(torch.cat(chunks), batch)
        for r, e in zip(rows, ext):
            self.lens[r] += e
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(h, self.model.w.lm_head)


def guard_indexer_ties(monkeypatch) -> list:
    """Record every query whose indexer scores tie exactly at the top-k boundary (which pick wins a tie is not
    defined, in the reference either: relu makes exact zeros). A test that compares selections asserts the list
    stays empty: its premise, not a tolerance. Wraps the backend's batched indexer (either impl)."""
    import backends.dsv4 as dsv4
    from backends.kernels.dsv4.dsv4_indexer import indexer_topk_paged

    ties = []

    def checked(index_q, index_weights, keys, table, req_rows, qo_indptr, positions, rate, top_k, *args):
        ties.extend(boundary_ties(index_q, index_weights, keys, table, req_rows, qo_indptr, positions, rate, top_k))
        return indexer_topk_paged(index_q, index_weights, keys, table, req_rows, qo_indptr, positions, rate, top_k,
                                  *args)

    monkeypatch.setattr(dsv4, "indexer_topk_paged", checked)
    return ties


def boundary_ties(index_q, index_weights, keys, table, req_rows, qo_indptr, positions, rate, top_k,
                  gap: float = 1e-9) -> list[int]:
    """Positions of the queries whose k-th and (k+1)-th visible indexer scores are within ``gap`` (in index_q's
    dtype), one request and query at a time."""
    out, qo = [], qo_indptr.tolist()
    for b, row in enumerate(req_rows.tolist()):
        for i in range(qo[b], qo[b + 1]):
            p = int(positions[i])
            k = keys[table[row, : (p + 1) // rate].long()].to(index_q.dtype)
            v = (torch.relu(index_q[i] @ k.T) * index_weights[i, :, None].to(index_q.dtype)).sum(0)
            v = v.sort(descending=True).values
            if v.numel() > top_k and v[top_k - 1] - v[top_k] < gap:
                out.append(p)
    return out


def saved_reference(folder, seed: int, prompt_lens, new: int, min_gap: float, **over):
    """Save a tiny random V4 model (float64, ``tiny_hf_config(**over)``) to ``folder``; random prompts of
    ``prompt_lens`` tokens and transformers' greedy continuation of each (alone, ``new`` tokens). A reference margin
    (top-1 minus top-2 logit) at or below ``min_gap`` anywhere fails: reseed. Returns (folder, prompts, tokens)."""
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(tiny_hf_config(**{"max_position_embeddings": 64, **over})).eval()
    randomize_(model, seed)
    model = model.double()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(folder)
    gen = torch.Generator().manual_seed(100 + seed)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in prompt_lens]
    return folder, prompts, greedy_reference(model, prompts, new, min_gap)


def greedy_reference(model, prompts: list[list[int]], new: int, min_gap: float) -> list[list[int]]:
    """transformers' greedy continuation (``new`` tokens) of each prompt alone; fails on a top-1 / top-2 logit
    margin at or below ``min_gap`` anywhere (a near-tie: reseed)."""
    tokens, gap = [], float("inf")
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)
            tokens.append(out.sequences[0, len(p):].tolist())
            gap = min([gap] + [float(s[0].topk(2).values.diff().abs()) for s in out.scores])
    assert gap > min_gap, f"reference near-tie ({gap:.2e}): reseed"
    return tokens

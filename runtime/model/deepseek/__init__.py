"""DeepSeek-V2/V3/V3.2 decoder pieces: config.json parsing, RoPE/YaRN, MLA attention, dense MLP, MoE, weights
(seeded random or loaded from a Hugging Face folder)."""

"""DeepSeek-V4 decoder math as plain torch over explicit weights (dataclasses keyed to the Hugging Face parameter
names), driven through the V4 pools (runtime/core/dsv4_pools.py) and the ``dsv4`` attention backend.

Files: ``config`` (hyper-parameters from config.json), ``rope`` (interleaved partial RoPE, default and YaRN),
``weights`` (dataclasses + state-dict loading), ``compressor`` (CSA/HCA compressors, indexer queries),
``hyper`` (mHC's mixing linear and head; the Sinkhorn math after the linear in ``runtime/model/mhc.py``), ``moe``
(hash / top-k routing, swiglu_limit experts), ``layer`` (attention block and decoder layer), ``model`` (embedding,
layers, head), ``checkpoint`` / ``stored`` (reading folders, the release's fp8 / fp4 tensors), ``sharding`` (what
each tensor-parallel rank holds).
"""

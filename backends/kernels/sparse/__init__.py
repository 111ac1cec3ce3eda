"""DeepSeek-V3.2 sparse attention (DSA) and HiSparse: sparse absorbed-MLA decode over indexer-selected rows
(:mod:`~backends.kernels.sparse.sparse_mla_decode`), the sparse prefill / extend over the paged cache
(:mod:`~backends.kernels.sparse.sparse_mla_extend`), the indexer top-k (:mod:`~backends.kernels.sparse.indexer`; for
extend tokens in tiles of query tokens: :mod:`~backends.kernels.sparse.indexer_extend`), and the indexed row copies
between a pinned host KV pool and device rows (:mod:`~backends.kernels.sparse.host_gather`).
"""

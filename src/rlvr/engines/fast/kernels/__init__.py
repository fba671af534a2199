"""The fast engine's Triton kernels: decode attention over the shared prompt and response caches
(``decode_attention``) and fused sampling (``sampling``)."""

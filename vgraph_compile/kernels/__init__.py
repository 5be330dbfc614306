"""The attention kernels behind ``vgraph::varlen_attention``, each with ``available(device, dtype)``.

Order, and why (from the bottom up):
1. ``segments``: offsets from lengths, the padding rows zeroed, and ``confined`` (NaN/Inf kept in its segment for
   kernels that multiply across segments), with ``confine_triton`` its fused GPU epilogue.
2. The kernels, one module each, named as in ``registry.BACKENDS``: ``sdpa`` (block-diagonal reference),
   ``torch_varlen`` (torch's FlashAttention-2), ``cudnn``, ``fa4``, ``flashinfer``, ``flex`` and
   ``qkv_offsets_reference`` (the CPU reference of the ``[Q/K/O | V]`` offsets layout); ``sequence``: attention
   over a sequence-parallel process group.
3. ``registry``: every kernel by its name (written once), what it needs and what it supports.
4. ``ops``: the ``torch.library`` custom ops that dispatch to a kernel by name.
Beside them, ``gemm_epilogues``: ``vgraph::linear_gelu_tanh``, a linear with its tanh GELU in the GEMM's epilogue
(``rewrite/gelu_epilogues``).
Optional packages are imported when their kernel is chosen, never at import.
"""

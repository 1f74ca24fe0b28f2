"""Distributed kernels on pair tiles, as autograd functions on local blocks.

:mod:`~physicsnemo_foldcp.kernels.triangle_product` (triangle multiplication, panel by
panel), :mod:`~physicsnemo_foldcp.kernels.triangle_attention` (streamed triangle
attention) and :mod:`~physicsnemo_foldcp.kernels.outer_product` (the MSA's outer product
mean, tile by tile); the Boltz module handlers of :mod:`physicsnemo_foldcp.boltz` call
them.
"""

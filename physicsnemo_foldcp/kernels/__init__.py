"""Distributed kernels on pair tiles, as autograd functions on local blocks.

:mod:`~physicsnemo_foldcp.kernels.triangle_product` (triangle multiplication, panel by
panel) and :mod:`~physicsnemo_foldcp.kernels.triangle_attention` (streamed triangle
attention); the Boltz module handlers of :mod:`physicsnemo_foldcp.boltz` call them.
"""

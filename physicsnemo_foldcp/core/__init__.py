"""The plugin's tensor and its handler registry, blocks, compat, tags.

Above ``versions`` and ``distributed`` only (see
:data:`physicsnemo_foldcp.testing.layers.LAYERS`): every layer above imports from here,
nothing here imports them. :mod:`~physicsnemo_foldcp.core.compat` holds every private upstream name.
"""

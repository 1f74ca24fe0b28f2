"""The bottom layer: the plugin's tensor and its handler registry, blocks, compat, tags.

Every other subpackage imports from here; nothing here imports the plugin's other
subpackages. :mod:`~physicsnemo_foldcp.core.compat` holds every private upstream name.
"""

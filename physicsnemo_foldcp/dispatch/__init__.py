"""Generic ops on the plugin's tensors: the rule table's generic rows and the local-block engine.

Importing :mod:`~physicsnemo_foldcp.dispatch.rules` registers the generic rows and the
fallback in :mod:`physicsnemo_foldcp.core.tensor`'s registry.
"""

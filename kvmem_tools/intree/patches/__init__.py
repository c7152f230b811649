"""The patches of the in-tree series, one module each (``series.ORDER``)."""

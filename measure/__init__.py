"""enginesmith.measure."""

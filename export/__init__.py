"""enginesmith.export."""

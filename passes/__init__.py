"""enginesmith.passes."""

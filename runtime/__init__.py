"""enginesmith.runtime."""

"""enginesmith.models."""

"""KV cache managers, one per layout (dense, ring, H2O, paged), and the paged block manager."""

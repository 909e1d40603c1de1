"""The node's KV memory: the preallocated paged pool and the block manager with its prefix cache."""

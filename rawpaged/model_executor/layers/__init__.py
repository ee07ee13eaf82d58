"""Model building blocks: RoPE variants computed once at load, and a layer's paged attention call."""

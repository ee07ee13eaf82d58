"""Model building blocks computed once at load (RoPE variants)."""

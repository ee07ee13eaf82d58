"""``POST /v1/embeddings``: the request and answer (``protocol``) and the handler (``serving``)."""

"""``POST /v1/chat/completions``: the request (``protocol``) and its handler (``serving``)."""

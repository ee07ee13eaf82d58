"""``POST /v1/completions``: the request (``protocol``) and its handler (``serving``)."""

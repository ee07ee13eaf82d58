"""vLLM's ``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``: the requests
(``protocol``) and their handlers (``serving``)."""

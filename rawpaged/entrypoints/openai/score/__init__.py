"""``POST /v1/score`` and ``POST /v1/rerank``: the requests and answers (``protocol``) and the handlers
(``serving``), scoring by the cosine similarity of embeddings."""

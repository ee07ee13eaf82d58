"""``GET /v1/models`` and ``GET /v1/models/{model}`` (``serving``)."""

"""``/v1/responses``: the request (``protocol``), its handlers (``serving``) and the response's output
items and events (``output_items``)."""

"""Ways in: the offline ``LLM`` (``llm``), the HTTP server (``app`` with the OpenAI routes in ``openai/``,
the websocket in ``websocket``, health and metrics in ``health``; run by ``launcher``) and the ``rawpaged``
command (``cli``)."""

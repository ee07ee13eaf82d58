"""The OpenAI-compatible API, one folder per API, each with its request model (``protocol``) and its
route handlers (``serving``), as vLLM's ``entrypoints/openai/``: ``/v1/chat/completions``
(``chat_completion``), ``/v1/completions`` (``completion``), ``/v1/responses`` (``responses``, with
``output_items``), vLLM's ``/tokenize`` and ``/detokenize`` (``tokenize``) and ``/v1/models`` (``models``).
Each handler runs the steps of ``rawpaged.entrypoints.generation``."""

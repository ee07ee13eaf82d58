"""The OpenAI-compatible API: ``/v1/completions`` (``serving_completion``), ``/v1/chat/completions``
(``serving_chat``), ``/v1/models`` (``serving_models``); request and response shapes in ``protocol``."""

"""The OpenAI-compatible API: ``/v1/completions`` (``serving_completion``), ``/v1/chat/completions``
(``serving_chat``), ``/v1/models`` (``serving_models``); request models in ``protocol``, response shapes in
``response_builders``."""

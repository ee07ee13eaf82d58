"""The OpenAI-compatible API: ``/v1/completions`` (``serving_completion``), ``/v1/chat/completions``
(``serving_chat``), ``/v1/models`` (``serving_models``). A generation request goes one way through the steps
each handler calls in order: ``request_body`` parses it into a ``protocol`` model, ``preprocessing`` makes its
prompts the engine's inputs (``SamplingParams`` from ``sampling``), ``engine_requests`` submits them, and
``response_writer`` answers in ``response_builders``' shapes."""

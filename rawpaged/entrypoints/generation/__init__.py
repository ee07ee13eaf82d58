"""The generation pipeline that the OpenAI routes and the websocket share, step by step: ``admission``
lets a request in, ``request_body`` parses it into a ``protocol`` model (``chat_messages``,
``protocol_extensions``; ``tool_requests``: the tool rules), ``preprocessing`` makes its prompts the
engine's inputs (``chat_utils`` renders a conversation; ``sampling`` makes its ``SamplingParams``),
``engine_requests`` submits them, and ``reply_writer`` answers with the JSON that ``output_json`` builds
(a choice's text split by ``choice_parser``: ``reasoning_parsers``, then ``tool_parsers``), streamed by
``http.sse``."""

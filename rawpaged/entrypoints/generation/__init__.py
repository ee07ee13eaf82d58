"""The generation pipeline that the OpenAI routes and the websocket share, step by step: ``admission``
lets a request in, ``request_body`` parses it into a ``protocol`` model (``chat_messages``,
``protocol_extensions``), ``preprocessing`` makes its prompts the engine's inputs (``chat_utils`` renders
a conversation; ``sampling`` makes its ``SamplingParams``), ``engine_requests`` submits them, and
``reply_writer`` answers with the JSON that ``output_json`` builds (text split by ``reasoning_parsers``
and ``tool_parsers``)."""

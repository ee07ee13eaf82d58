"""Ways in: the offline ``LLM`` (``llm``), the HTTP server (``api_server`` builds the app from the folders
below and ``launcher`` runs it; ``health`` has the operations routes) and the ``rawpaged`` command (``cli``).

From the bottom up, each folder importing only those before it: ``server/`` (configuration, state,
metrics, engine start-up and shutdown), ``http/`` (body, errors, middleware, auth, CORS, hosts,
connections, the playground's files), ``generation/`` (the pipeline every generation route shares: admit,
parse, prepare, submit, answer), ``openai/`` (one folder per API: its protocol and its serving module) and
``websocket/``."""

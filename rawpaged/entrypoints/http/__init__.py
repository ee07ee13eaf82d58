"""HTTP plumbing under every route: the error type and bodies (``errors``, ``json_reply``), the request
body (``body``), server-sent events (``sse``), the middleware (``middleware``, with ``auth``, ``cors`` and
``hosts``), the connection gate (``connections``) and the playground's static files (``playground``)."""

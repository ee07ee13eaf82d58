"""The server's state and lifecycle: its configuration (``config``), the state its routes share
(``state``), its counters (``metrics``), and the engine's start-up and shutdown (``startup``,
``lifecycle``). Knows the engine, not HTTP."""

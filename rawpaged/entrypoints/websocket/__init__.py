"""The websocket ``/v1/ws``: its ``generate`` message (``protocol``), its other messages and their replies
(``messages``), and the connection's handler (``serving``)."""

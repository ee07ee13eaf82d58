"""``/v1/messages`` (Anthropic's Messages API): the request (``protocol``), its handlers (``serving``) and
the answer's content blocks and stream events (``content_blocks``)."""

"""OpenAI's Batch API file format (``rawpaged run-batch``)."""

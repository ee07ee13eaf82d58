"""The engine: requests in, one ``step()`` at a time, outputs out.

``llm_engine`` (add/abort/step) drives ``rawpaged.core`` (scheduler, KV cache) and the model runner;
``input_processor`` validates prompts, ``output_processor`` turns tokens into text and outputs,
``parallel_sampling`` and ``beam_search`` fork and select sequences, ``async_engine`` runs it under asyncio.
"""

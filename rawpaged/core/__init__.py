"""The paged core: block pool, block tables, prefix cache, KV-cache manager, sequences, scheduler.

Knows block ids and token ids, never arrays: the model runner turns a ``SchedulerOutput`` into them.
"""

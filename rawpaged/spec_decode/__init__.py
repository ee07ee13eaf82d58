"""Speculative decoding: proposers that guess a sequence's next tokens cheaply (``ngram_proposer``), the
rule that keeps the target model's distribution when it checks them (``rejection_sampler``), and the
counters of drafts and acceptances (``metrics``). ``Speculator`` gives each decoding sequence its drafts
for the next step; the scheduler budgets them, the model runner computes their k + 1 positions in the step,
and ``engine.token_selection`` accepts a prefix of them (docs/speculative_decoding.md)."""

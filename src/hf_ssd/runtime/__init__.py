"""The round loop and what it stands on: the slot KV cache, logits processing, stats, the budget probe."""

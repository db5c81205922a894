"""KV bookkeeping: the block pool (ref counts, the free queue with lazy eviction, prefix-cache
hashes) and each sequence's block table on top of it (allocation, copy-on-write, rollback). The
physical K/V storage and the attention that reads it are the model's (engine.model.kv_storage,
engine.model.paged_attention)."""

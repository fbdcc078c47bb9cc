"""The target LM: loading and the forward adapter, the named targets, assets, KV caches and replay rollback for recurrent layers."""

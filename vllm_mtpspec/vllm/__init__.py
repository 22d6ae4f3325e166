"""The only place that imports vLLM: the plugin, the proposer and the patches they need."""

"""Self-speculative decoding with multi-token-prediction heads."""
__version__ = "0.1.0"

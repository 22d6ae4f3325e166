"""`mtpspec bench`: every speculation method through vLLM, side by side, in one run."""

"""The Ray job that trains drafters for vllm_mtpspec (`mtpspec train`, `python -m
vllm_mtpspec_train.data`, ...). It imports the library; the library never imports it."""

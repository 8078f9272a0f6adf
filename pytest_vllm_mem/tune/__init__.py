"""The utilization search: the highest (or lowest) stable gpu_memory_utilization for a config."""

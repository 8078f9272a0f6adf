"""`python -m pytest_vllm_mem`: the tune and plan commands without pytest."""

"""`python -m pytest_vllm_mem`: see pytest_vllm_mem.cli.main."""

from pytest_vllm_mem.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())

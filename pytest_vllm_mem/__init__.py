"""pytest-vllm-mem: vLLM serving regression tests that fail on startup OOM, memory and throughput regressions."""

from pytest_vllm_mem.config import VLLMConfig
from pytest_vllm_mem.launch.server import VLLMServer, VLLMStartupError

__all__ = ["VLLMConfig", "VLLMServer", "VLLMStartupError", "__version__"]
__version__ = "0.4.0"

"""Reading vLLM's logs: startup figures, failure kind and phase, and the advice they support.

Pure: no process, no pytest.
"""

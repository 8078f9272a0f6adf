"""Stands in for a healthy vLLM server, in well under a second: GET /health, GET /v1/models and streaming
POST /v1/completions (one token chunk per max_tokens, then a usage chunk), on --host:--port. With FAKE_KV_BLOCKS it
also serves GET /metrics with vLLM's `vllm:cache_config_info` gauge holding that many blocks.

Like vLLM it prints its arguments to the log ("non-default args: ..."), and when the port is taken it dies with
`OSError: [Errno 98] Address already in use`. It exits on SIGTERM. FAKE_STARTUP_S delays listening (default 0).
"""

from __future__ import annotations

import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def arg(name: str, default: str) -> str:
    argv = sys.argv[1:]
    return argv[argv.index(name) + 1] if name in argv[:-1] else default


def model() -> str:
    """The model, positional as `vllm serve` takes it (sys.argv[1]); --model as older launches passed it."""
    argv = sys.argv[1:]
    return argv[0] if argv[:1] and not argv[0].startswith("-") else arg("--model", "stub")


MODEL = arg("--served-model-name", model())


class Handler(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # quiet: the server log is what the plugin quotes
        pass

    def _json(self, data: dict[str, object]) -> None:
        body = json.dumps(data).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/metrics" and os.environ.get("FAKE_KV_BLOCKS"):
            body = (
                "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
                "# TYPE vllm:cache_config_info gauge\n"
                f'vllm:cache_config_info{{block_size="16",engine="0",num_cpu_blocks="None",'
                f'num_gpu_blocks="{os.environ["FAKE_KV_BLOCKS"]}"}} 1.0\n'
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif self.path == "/v1/models":
            self._json({"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 1024}]})
        else:
            self.send_error(404)

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        tokens = int(request.get("max_tokens", 16))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()  # HTTP/1.0: the body ends when the connection closes
        for index in range(tokens):
            chunk = {"object": "text_completion", "choices": [{"index": 0, "text": f" t{index}"}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.001)
        usage = {"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": tokens}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        # vLLM's access log line for each request (uvicorn's), so tests can count what reached the server.
        print(f'INFO:     127.0.0.1 - "POST /v1/completions HTTP/1.1" 200 OK max_tokens={tokens}', flush=True)


def main() -> None:
    print(f"(APIServer pid={os.getpid()}) INFO [api_utils.py:286] non-default args: {sys.argv[1:]}", flush=True)
    compile_env = {
        name: os.environ.get(name) for name in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "VLLM_USE_AOT_COMPILE")
    }
    print(f"FAKE compile env: {json.dumps(compile_env)}", flush=True)
    if os.environ.get("FAKE_LOG_LINE"):  # a line real vLLM would log during startup, for the plugin to react to
        print(os.environ["FAKE_LOG_LINE"], flush=True)
    time.sleep(float(os.environ.get("FAKE_STARTUP_S", "0")))
    host = arg("--host", "127.0.0.1")
    server = ThreadingHTTPServer((host, int(arg("--port", "0"))), Handler)
    print(
        f"(APIServer pid={os.getpid()}) INFO [entry.py:140] Starting vLLM server on http://{host}:{server.server_port}",
        flush=True,
    )
    server.serve_forever()


if __name__ == "__main__":
    main()

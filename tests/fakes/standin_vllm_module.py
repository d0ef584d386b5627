"""A stand-in vLLM server as a real process, launched the way the configuration launches vLLM.

`install(root)` writes a tiny package `vllm/entrypoints/openai/api_server.py` under `root`;
with `root` on the server's PYTHONPATH, `python -m vllm.entrypoints.openai.api_server --model M
--port P` runs it: a real process with vLLM's command line (so configuration validation and
the runtimes take it for a server), standing in for vLLM. What each start does comes from
STANDIN_PLAN, one word per start, the last one repeating:

* `serve`: answer /health, /v1/models, /v1/completions and /metrics (the text of the file
  STANDIN_METRICS names, read on each scrape; empty without it);
* `exit`: print an error as vLLM would and exit with code 3;
* `hang`: start a child in its process group, then wait forever without listening;
* `engine`: `serve`, with an engine child (in its process group) that ignores SIGTERM, as
  vLLM's engine core may once its API server is gone;
* `detached`: `engine`, the child in a session of its own (as `setsid` would put it).

Every process it starts carries STANDIN_TAG in its command line, so a test can tell whether
any is left. Starts are counted in the file STANDIN_STARTS. Only the standard library.
"""

from __future__ import annotations

from pathlib import Path

SERVER_SOURCE = """
import json, os, subprocess, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

def option(name, default=None):
    args = sys.argv[1:]
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
    return default

def next_mode():
    counter = os.environ["STANDIN_STARTS"]
    try:
        with open(counter) as f:
            done = int(f.read() or 0)
    except FileNotFoundError:
        done = 0
    with open(counter, "w") as f:
        f.write(str(done + 1))
    plan = os.environ.get("STANDIN_PLAN", "serve").split(",")
    return plan[min(done, len(plan) - 1)]

class Handler(BaseHTTPRequestHandler):
    def reply(self, status, body, kind="application/json"):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self.reply(200, {})
        elif self.path == "/v1/models":
            self.reply(200, {"data": [{"id": option("--model")}]})
        elif self.path == "/metrics":
            path = os.environ.get("STANDIN_METRICS")
            text = open(path, "rb").read() if path and os.path.exists(path) else b""
            self.reply(200, text, "text/plain; version=0.0.4")
        else:
            self.reply(404, {})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        tokens = int(body.get("max_tokens") or 1)
        usage = {"completion_tokens": tokens}
        self.reply(200, {"choices": [{"text": "x" * tokens}], "usage": usage})

    def log_message(self, *args):
        pass

mode = next_mode()
tag = os.environ.get("STANDIN_TAG", "standin")
print(f"stand-in vLLM ({tag}): start in mode {mode}", flush=True)
if mode == "exit":
    print("RuntimeError: stand-in vLLM failed to start (no KV cache memory)", file=sys.stderr)
    sys.exit(3)
if mode == "hang":
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", tag])
    while True:
        time.sleep(60)
if mode in ("engine", "detached"):
    engine = (
        "import os, signal, time\\n"
        f"if {mode == 'detached'}: os.setsid()\\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
        "time.sleep(600)\\n"
    )
    subprocess.Popen([sys.executable, "-c", engine, tag])
server = ThreadingHTTPServer(("127.0.0.1", int(option("--port", "8000"))), Handler)
server.serve_forever()
"""


def install(root: Path) -> Path:
    """Writes the stand-in package under `root`; returns `root` (for PYTHONPATH)."""
    package = root / "vllm" / "entrypoints" / "openai"
    package.mkdir(parents=True, exist_ok=True)
    for folder in (root / "vllm", root / "vllm" / "entrypoints", package):
        (folder / "__init__.py").write_text("")
    (package / "api_server.py").write_text(SERVER_SOURCE)
    return root

"""A stand-in for a vLLM server (stdlib ``http.server`` in a thread) for the test suite.

It serves the routes ``rollout.backend: vllm`` calls (jaxrl/rollout/vllm/client.py) and generates
by a deterministic rule: completion token i of a prompt ending in token p is
``(p + i + 1 + shift) % vocab`` where ``shift`` is the number of reloads it has done, with
log-prob ``-(i + 1) / 8``; it stops after an eos id (``stop_token_ids``) or ``max_tokens``.
``fault`` makes it fail the way real servers do: ``hang`` (answers after ``hang_s``),
``http500``, ``fewer`` (one completion fewer), ``malformed`` (log-probs missing),
``bad_token`` (ids past the vocabulary: another model), ``drop`` (closes the connection without
an answer, as a killed server), ``reload_fails`` (``/collective_rpc`` answers 500 after
``/update_weight_version`` said "updating"). The GPU weight-transfer routes
(``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``) record what they are sent; a finished update counts as a reload.
"""

from __future__ import annotations

import base64
import http.server
import json
import pickle
import threading
import time
from pathlib import Path
from urllib.parse import urlparse


class StubVLLM:
    def __init__(self, vocab: int, *, logprobs_mode: str = "raw_logprobs"):
        self.vocab = vocab
        self.logprobs_mode = logprobs_mode
        self.max_model_len = 64
        self.fault: str | None = None
        self.hang_s = 30.0
        self.version: str | None = None
        self.reloads: list[str] = []  # weights paths loaded
        self.requests: list[dict] = []  # completion request bodies
        self.served: list = []  # the server's weight version when each request came
        self.calls: list[str] = []  # "METHOD /path" in order
        self.prompt_logprobs = None  # ids -> log-probs of ids[1:] (the weight check's answer)
        self.world_size = 1  # /get_world_size (the NCCL group: trainer + this many workers)
        self.transfer_init = None  # /init_weight_transfer_engine's init_info (GPU transfer)
        self.transfers: list = []  # /update_weights' update_info, IPC handles unpickled
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, code: int, body) -> None:
                raw = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                stub.calls.append(f"GET {urlparse(self.path).path}")
                self._route("GET", None)

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                stub.calls.append(f"POST {urlparse(self.path).path}")
                self._route("POST", body)

            def _route(self, method: str, body) -> None:
                path = urlparse(self.path).path
                fault = stub.fault
                if fault == "drop":
                    self.close_connection = True
                    self.connection.close()
                    return
                if fault == "hang" and path != "/health":
                    time.sleep(stub.hang_s)
                if fault == "http500" and path == "/v1/completions":
                    return self._send(500, {"message": "EngineCore encountered an issue"})
                answer = stub.answer(method, path, body)
                if answer is None:
                    return self._send(404, {"detail": "Not Found"})
                self._send(*answer)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def answer(self, method: str, path: str, body):
        ok = (200, {})
        if path == "/health":
            return ok
        if path == "/v1/models":
            return 200, {"data": [{"id": "jaxrl", "max_model_len": 4096}]}
        if path == "/server_info":
            model = {"logprobs_mode": self.logprobs_mode, "max_model_len": self.max_model_len}
            return 200, {"vllm_config": {"model_config": model}}
        if path == "/weight_info":
            return 200, {"weight_version": self.version}
        if path == "/update_weight_version":
            self.version = body["new_version"]
            return 200, {"success": True}
        if path in ("/pause", "/resume", "/reset_prefix_cache"):
            return ok
        if path == "/collective_rpc":
            if self.fault == "reload_fails":
                return 500, {"message": "size mismatch for model.embed_tokens.weight"}
            weights = Path(body["kwargs"]["weights_path"])
            assert (weights / "model.safetensors").is_file(), weights
            self.reloads.append(str(weights))
            return 200, {"results": [None]}
        if path == "/get_world_size":
            return 200, {"world_size": self.world_size}
        if path == "/init_weight_transfer_engine":
            self.transfer_init = body["init_info"]
            return ok
        if path == "/start_weight_update":
            return ok if self.transfer_init is not None else (500, {"error": "not initialized"})
        if path == "/update_weights":
            info = dict(body["update_info"])
            if "ipc_handles_pickled" in info:  # as vLLM with VLLM_ALLOW_INSECURE_SERIALIZATION
                raw = base64.b64decode(info.pop("ipc_handles_pickled"))
                info["ipc_handles"] = pickle.loads(raw)
            self.transfers.append(info)
            return ok
        if path == "/finish_weight_update":
            self.reloads.append("transfer")
            return ok
        if path == "/shutdown_weight_transfer_engine":
            self.transfer_init = None
            return ok
        if path == "/v1/completions":
            self.requests.append(body)
            self.served.append(self.version)
            return 200, self.complete(body)
        return None

    def complete(self, body) -> dict:
        prompt, n, limit = body["prompt"], body.get("n", 1), body["max_tokens"]
        eos = set(body.get("stop_token_ids") or [])
        shift = len(self.reloads)
        choices = []
        for j in range(n):
            ids, lps = [], []
            for i in range(limit):
                t = (prompt[-1] + i + 1 + shift) % self.vocab
                ids.append(t)
                lps.append(-(i + 1) / 8)
                if t in eos:
                    break
            reason = "stop" if ids[-1] in eos else "length"
            if self.fault == "bad_token":
                ids = [self.vocab + 5] * len(ids)
            logprobs = {"token_logprobs": lps, "tokens": [f"token_id:{t}" for t in ids]}
            if self.fault == "malformed":
                logprobs = None
            choices.append(
                {"index": j, "text": "", "token_ids": ids, "logprobs": logprobs,
                 "finish_reason": reason}
            )  # fmt: skip
        if self.fault == "fewer":
            choices = choices[:-1]
        if body.get("prompt_logprobs") is not None and self.prompt_logprobs is not None:
            values = self.prompt_logprobs(prompt)
            pairs = zip(prompt[1:], values, strict=True)
            per_token = [{str(t): {"logprob": float(v), "rank": 1}} for t, v in pairs]
            choices[0]["prompt_logprobs"] = [None, *per_token]
        return {"id": "cmpl-stub", "model": "jaxrl", "choices": choices}

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def main(argv: list[str]) -> None:
    """``python vllm_stub.py PORT VOCAB [--exit N]``: serve on 127.0.0.1:PORT (a process for
    jaxrl to start, own and stop), with a child process of its own (as vLLM's engine core);
    ``--exit N``: exit with code N at once (a server that fails to start)."""
    import subprocess
    import sys

    if "--exit" in argv:
        print("ValueError: stub told to fail at start", flush=True)
        sys.exit(int(argv[argv.index("--exit") + 1]))
    port, vocab = int(argv[0]), int(argv[1])
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # the "engine"
    stub = StubVLLM(vocab)
    stub.server.shutdown()
    stub.server.server_close()
    handler = stub.server.RequestHandlerClass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    print(f"serving on {port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])

"""A loopback stand-in for a llama.cpp (`/completion`) or OpenAI-compatible (`/v1/completions`) server
that streams `max_tokens` words as server-sent events, for testing the peer path without llama.cpp."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


TOKEN_DELAY_S = 0.002  # slept before each event: one stream's ceiling is one token every TOKEN_DELAY_S


class _Handler(BaseHTTPRequestHandler):
    delay_s = TOKEN_DELAY_S

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        llama = self.path == "/completion"
        n = body["n_predict"] if llama else body["max_tokens"]
        self.server.requests.append((self.path, body))
        self.server.headers.append(dict(self.headers))
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        events = [{"content": ""}] if llama else []  # llama.cpp may open with an empty event: not the TTFT
        events += [{"content": " word"} if llama else {"choices": [{"text": " word"}]} for _ in range(n)]
        for e in events:
            time.sleep(self.delay_s)
            self.wfile.write(b"data: " + json.dumps(e).encode() + b"\n\n")
            self.wfile.flush()
        if not llama:
            self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *a):
        pass


class FakePeer:
    def __enter__(self):
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.requests = []
        self.httpd.headers = []  # each request's headers, in order
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()

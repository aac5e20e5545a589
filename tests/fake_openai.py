"""A local OpenAI-compatible chat-completions server on 127.0.0.1 with scripted replies, for the real client."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeOpenAI:
    """replies: a list of dicts {content, status=200, delay=0, prompt_tokens=100, completion_tokens=20};
    once they run out, the last one repeats. requests: (time, body) of every request received."""

    def __init__(self, replies: list[dict]):
        self.replies = list(replies)
        self.requests: list[tuple[float, dict]] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                with outer.lock:
                    outer.requests.append((time.time(), body))
                    reply = outer.replies.pop(0) if len(outer.replies) > 1 else outer.replies[0]
                time.sleep(reply.get("delay", 0))
                status = reply.get("status", 200)
                if status != 200:
                    payload = {"error": {"message": "fake server error", "type": "server_error"}}
                else:
                    payload = {
                        "id": "chatcmpl-fake",
                        "object": "chat.completion",
                        "created": int(time.time()),
                        "model": body.get("model", "fake"),
                        "choices": [
                            {
                                "index": 0,
                                "finish_reason": "stop",
                                "message": {"role": "assistant", "content": reply["content"]},
                            }
                        ],
                        "usage": {
                            "prompt_tokens": reply.get("prompt_tokens", 100),
                            "completion_tokens": reply.get("completion_tokens", 20),
                            "total_tokens": reply.get("prompt_tokens", 100) + reply.get("completion_tokens", 20),
                        },
                    }
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def prompts(self) -> list[str]:
        return [body["messages"][-1]["content"] for _, body in self.requests]

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def edit(old: str, new: str, description: str) -> dict:
    return {"content": f"DESCRIPTION: {description}\n<<<<<<< SEARCH\n{old}\n=======\n{new}\n>>>>>>> REPLACE\n"}

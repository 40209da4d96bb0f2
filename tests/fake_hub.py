"""A tiny stand-in for the Hugging Face hub, for tests that must not touch the network.

`FakeHub(repos)` serves, on 127.0.0.1, the few HTTP endpoints huggingface_hub's
`snapshot_download` uses: a repo's info at a revision, its file tree, and each file (HEAD for
metadata, GET for bytes). Point a process at it with HF_ENDPOINT=hub.url (read when
huggingface_hub is imported, so set it for a subprocess). Every request is recorded in
`hub.requests`, so a test can check what was fetched.

    repos = {("model", "org/tok"): {"tokenizer.json": b"..."}, ("dataset", "org/data"): {...}}
"""

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, repos: dict[tuple[str, str], dict[str, bytes]]):
        self.repos = repos
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                hub._serve(self, body=False)

            def do_GET(self):
                hub._serve(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FakeHub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def fetched(self) -> list[str]:
        """Paths of the files whose bytes were downloaded."""
        return [path for method, path in self.requests if method == "GET" and "/resolve/" in path]

    def _repo(self, kind: str, repo_id: str):
        return self.repos.get((kind, repo_id))

    def _serve(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(handler.path).path)
        self.requests.append((handler.command, path))
        # /api/models/ORG/NAME/revision/REV and /api/datasets/ORG/NAME/revision/REV
        m = re.fullmatch(r"/api/(models|datasets)/([^/]+/[^/]+)/revision/[^/]+", path)
        if m:
            files = self._repo(m[1][:-1], m[2])
            if files is None:
                return self._send(handler, 404, b'{"error": "Repository not found"}', body,
                                  {"X-Error-Code": "RepoNotFound"})
            info = {"id": m[2], "sha": COMMIT, "siblings": [{"rfilename": f} for f in files]}
            return self._send(handler, 200, json.dumps(info).encode(), body)
        # /api/models/ORG/NAME/tree/REV[/PATH]
        m = re.fullmatch(r"/api/(models|datasets)/([^/]+/[^/]+)/tree/[^/]+(?:/(.*))?", path)
        if m:
            files = self._repo(m[1][:-1], m[2]) or {}
            prefix = (m[3] or "").strip("/")
            tree = [{"type": "file", "path": f, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                    for f, data in files.items() if not prefix or f.startswith(prefix + "/")]
            return self._send(handler, 200, json.dumps(tree).encode(), body)
        # /ORG/NAME/resolve/REV/FILE (models), /datasets/ORG/NAME/resolve/REV/FILE
        m = re.fullmatch(r"/(datasets/)?([^/]+/[^/]+)/resolve/[^/]+/(.+)", path)
        if m:
            files = self._repo("dataset" if m[1] else "model", m[2]) or {}
            if m[3] not in files:
                return self._send(handler, 404, b"Entry not found", body, {"X-Error-Code": "EntryNotFound"})
            data = files[m[3]]
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha1(data).hexdigest()}"'}
            return self._send(handler, 200, data, body, headers)
        return self._send(handler, 404, b"not found", body)

    @staticmethod
    def _send(handler, status: int, data: bytes, body: bool, headers: dict | None = None) -> None:
        handler.send_response(status)
        handler.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            handler.send_header(key, value)
        handler.end_headers()
        if body:
            handler.wfile.write(data)

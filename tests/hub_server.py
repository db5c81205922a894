"""A local HTTP server answering the Hugging Face Hub endpoints huggingface_hub calls, serving
real files: point HF_ENDPOINT at `HubServer.url`.

- GET  /api/models?search=&pipeline_tag=&sort=&limit=&expand=...   (HfApi.list_models)
- GET  /api/models/<repo>[/revision/<rev>][?blobs=true]              (HfApi.model_info)
- HEAD /<repo>/resolve/<rev>/<file>   X-Repo-Commit, ETag, Content-Length (get_hf_file_metadata)
- GET  /<repo>/resolve/<rev>/<file>   with Range support (206), as the Hub's CDN answers

What the real Hub computes from the files, this computes too: safetensors parameter counts from
the files' headers, the GGUF total, sizes, sha256 ETags. Gated repos answer 403 GatedRepo to
downloads without the right token; private ones 401 RepoNotFound. Faults for the tests: drop the
connection after N bytes of a file (`drop_after`), for a number of requests. `Repo.commit` moves
`main` to new files; the older commits stay fetchable by their hash, as on the Hub.
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

TOKEN = "hf_kvscope_test_token"


@dataclass
class Repo:
    repo_id: str
    files: dict[str, bytes]
    downloads: int = 0
    likes: int = 0
    license: str | None = "apache-2.0"
    gated: str | bool = False  # False, "auto" or "manual"
    private: bool = False
    pipeline_tag: str = "text-generation"

    _etags: dict[int, tuple[bytes, str]] = field(default_factory=dict, repr=False)  # id -> (bytes, sha256)
    history: dict[str, dict[str, bytes]] = field(default_factory=dict, repr=False)  # older commits

    @property
    def sha(self) -> str:
        return self.sha_of(self.files)

    def sha_of(self, files: dict[str, bytes]) -> str:
        h = hashlib.sha1(self.repo_id.encode())
        for name in sorted(files):
            h.update(name.encode() + self._etag_of(files[name]).encode())
        return h.hexdigest()

    def etag(self, name: str) -> str:
        return self._etag_of(self.files[name])

    def _etag_of(self, data: bytes) -> str:
        if id(data) not in self._etags:  # the bytes are kept with their hash, so the id stays theirs
            self._etags[id(data)] = (data, hashlib.sha256(data).hexdigest())
        return self._etags[id(data)][1]

    def commit(self, files: dict[str, bytes]) -> str:
        """Move `main` to `files` (a new commit); the current one stays reachable by its hash."""
        self.history[self.sha] = self.files
        self.files = files
        return self.sha

    def files_at(self, revision: str) -> dict[str, bytes] | None:
        if revision in ("main", self.sha):
            return self.files
        return self.history.get(revision)

    def safetensors(self) -> dict | None:
        params: dict[str, int] = {}
        for name, data in self.files.items():
            if not name.endswith(".safetensors"):
                continue
            try:
                (n,) = struct.unpack("<Q", data[:8])
                header = json.loads(data[8 : 8 + n])
            except (ValueError, struct.error):  # a broken file: the Hub shows no parameter count for it
                return None
            for key, t in header.items():
                if key == "__metadata__":
                    continue
                count = 1
                for d in t["shape"]:
                    count *= d
                params[t["dtype"]] = params.get(t["dtype"], 0) + count
        return {"parameters": params, "total": sum(params.values())} if params else None

    def config(self) -> dict | None:
        raw = self.files.get("config.json")
        if raw is None:
            return None
        cfg = json.loads(raw)
        return {k: cfg[k] for k in ("model_type", "architectures") if k in cfg}

    def info(self, blobs: bool) -> dict:
        siblings = []
        for name, data in sorted(self.files.items()):
            entry = {"rfilename": name}
            if blobs:
                entry.update(size=len(data), blobId=hashlib.sha1(data).hexdigest())
                if name.endswith((".safetensors", ".gguf")):
                    entry["lfs"] = {"size": len(data), "sha256": self.etag(name), "pointerSize": 134}
            siblings.append(entry)
        tags = [self.pipeline_tag, "transformers"]
        if self.license:
            tags.append(f"license:{self.license}")
        if any(n.endswith(".gguf") for n in self.files):
            tags.append("gguf")
        if any(n.endswith(".safetensors") for n in self.files):
            tags.append("safetensors")
        out = {
            "id": self.repo_id,
            "_id": self.sha[:24],
            "modelId": self.repo_id,
            "sha": self.sha,
            "downloads": self.downloads,
            "likes": self.likes,
            "gated": self.gated,
            "private": self.private,
            "tags": tags,
            "pipeline_tag": self.pipeline_tag,
            "library_name": "transformers",
            "siblings": siblings,
            "usedStorage": sum(len(d) for d in self.files.values()),
            "lastModified": "2025-06-01T12:00:00.000Z",
            "createdAt": "2025-01-01T12:00:00.000Z",
        }
        if self.safetensors():
            out["safetensors"] = self.safetensors()
        gguf = next((d for n, d in sorted(self.files.items()) if n.endswith(".gguf")), None)
        if gguf is not None:  # the Hub reads the first GGUF's header for these
            out["gguf"] = _gguf_summary(gguf)
        if self.config():
            out["config"] = self.config()
        return out


def _gguf_summary(data: bytes) -> dict:
    from engine.hub.gguf_header import GGUFHeaderError, read_header

    try:
        header = read_header(lambda start, end: data[start : end + 1])
    except (GGUFHeaderError, ValueError):
        return {}
    arch = header.fields.get("general.architecture")
    return {
        "total": header.params,
        "architecture": arch,
        "context_length": header.fields.get(f"{arch}.context_length"),
    }


def repo_from_folder(repo_id: str, folder: Path, **fields) -> Repo:
    files = {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }
    return Repo(repo_id, files, **fields)


@dataclass
class Fault:
    drop_after: int  # bytes of the body sent before the connection is cut
    times: int  # how many GETs of the file fail this way


@dataclass
class HubServer:
    repos: dict[str, Repo] = field(default_factory=dict)
    faults: dict[str, Fault] = field(default_factory=dict)  # file name -> fault
    requests: list[tuple[str, str, dict]] = field(default_factory=list)  # method, path, headers
    delay_s: float = 0.0  # pause between body chunks (a slow network, for cancel tests)

    def add(self, repo: Repo) -> Repo:
        self.repos[repo.repo_id] = repo
        return repo

    def start(self) -> HubServer:
        server = self

        class Handler(_Handler):
            hub = server

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def ranges_for(self, name: str) -> list[str]:
        return [h.get("Range", "") for m, p, h in self.requests if m == "GET" and p.endswith("/" + name)]


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    # ---- plumbing ------------------------------------------------------------------------
    def _send(self, status: int, body: bytes = b"", headers: dict | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, str(v))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, value, status: int = 200) -> None:
        self._send(status, json.dumps(value).encode(), {"Content-Type": "application/json"})

    def _error(self, status: int, code: str, message: str) -> None:
        self._send(
            status,
            json.dumps({"error": message}).encode(),
            {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json"},
        )

    def _authorized(self) -> bool:
        return self.headers.get("Authorization", "") == f"Bearer {TOKEN}"

    def _repo(self, repo_id: str) -> Repo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None or (repo.private and not self._authorized()):
            self._error(401, "RepoNotFound", "Repository not found")
            return None
        return repo

    # ---- routes --------------------------------------------------------------------------
    def do_HEAD(self) -> None:
        self._route()

    def do_GET(self) -> None:
        self._route()

    def _route(self) -> None:
        self.hub.requests.append((self.command, self.path, dict(self.headers)))
        try:
            self._answer()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as exc:  # noqa: BLE001 - a bug of this test server: answer 500, do not hang the client
            self._error(500, "ServerError", f"test hub server: {type(exc).__name__}: {exc}")

    def _answer(self) -> None:
        url = urlparse(self.path)
        path, query = unquote(url.path), parse_qs(url.query)
        if path == "/api/models":
            return self._list(query)
        if path.startswith("/api/models/"):
            rest = path.removeprefix("/api/models/")
            repo_id = "/".join(rest.split("/")[:2])
            repo = self._repo(repo_id)
            if repo is not None:
                self._json(repo.info(blobs=query.get("blobs", ["false"])[0].lower() == "true"))
            return None
        parts = path.strip("/").split("/")
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve("/".join(parts[:2]), parts[3], "/".join(parts[4:]))
        return self._error(404, "NotFound", "no such endpoint")

    def _list(self, query: dict) -> None:
        search = query.get("search", [""])[0].lower()
        tag = query.get("pipeline_tag", [None])[0]
        sort = query.get("sort", ["downloads"])[0]
        limit = int(query.get("limit", ["1000"])[0])
        repos = [
            r
            for r in self.hub.repos.values()
            if search in r.repo_id.lower() and (tag is None or r.pipeline_tag == tag) and not r.private
        ]
        repos.sort(
            key=lambda r: getattr(r, sort, 0) if sort in ("downloads", "likes") else r.repo_id, reverse=True
        )
        items = []
        for r in repos[:limit]:
            info = r.info(blobs=False)
            info.pop("siblings")
            items.append(info)
        self._json(items)

    def _resolve(self, repo_id: str, revision: str, name: str) -> None:
        repo = self._repo(repo_id)
        if repo is None:
            return
        files = repo.files_at(revision)
        if files is None:
            return self._error(404, "RevisionNotFound", "Invalid rev id")
        if name not in files:
            return self._error(404, "EntryNotFound", f"{name} does not exist")
        if repo.gated and not self._authorized():
            return self._error(
                403, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access."
            )
        data = files[name]
        headers = {
            "X-Repo-Commit": repo.sha if files is repo.files else revision,
            "ETag": f'"{repo._etag_of(data)}"',
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        start, status = 0, 200
        wanted = self.headers.get("Range", "")
        if wanted.startswith("bytes="):
            first, _, last = wanted.removeprefix("bytes=").partition("-")
            start = int(first or 0)
            end = int(last) if last else len(data) - 1
            if start >= len(data):
                return self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"})
            end = min(end, len(data) - 1)
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            data, status = data[start : end + 1], 206
        if self.command == "HEAD":
            self.send_response(200)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(files[name])))
            self.end_headers()
            return None
        fault = self.hub.faults.get(name)
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if fault is not None and fault.times > 0:
            fault.times -= 1
            self.wfile.write(data[: max(0, fault.drop_after - start)])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)  # the network goes away mid-file
            return None
        self._write_body(data)
        return None

    def _write_body(self, data: bytes) -> None:
        import time

        step = 64 * 1024
        try:
            for i in range(0, len(data), step):
                self.wfile.write(data[i : i + step])
                if self.hub.delay_s:
                    self.wfile.flush()
                    time.sleep(self.hub.delay_s)
        except (BrokenPipeError, ConnectionResetError):  # the client stopped (a cancel)
            self.close_connection = True


def use_hub(monkeypatch, server: HubServer, cache: Path, token: str | None = None) -> None:
    """Point huggingface_hub and kvscope at `server` with an empty HF cache in `cache`, as the app
    and the CLI run (offline by kvscope's default, online for Hub requests), restoring all after."""
    from huggingface_hub import constants

    from engine.hub.online import OFFLINE_IS_DEFAULT

    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv(OFFLINE_IS_DEFAULT, "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    if token:
        monkeypatch.setenv("HF_TOKEN", token)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", constants.HF_HUB_OFFLINE)  # restored after
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(cache.parent / "hf-token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(cache.parent / "hf-stored-tokens"))

"""A small Kubernetes API client speaking JSON dicts, for the platform's volume provisioner (``provisioner.py``).

It keeps objects as the API server's own JSON and reuses one TLS connection
pool, so the provisioner's resync (a list of claims and volumes every
second) costs no model deserialisation and the process does not import the
generated ``kubernetes`` client. (It was the retired node agent's client,
which also watched and wrote pod status as each node's identity.)
"""
from __future__ import annotations

import base64
import json
import os
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import urllib3
import yaml

USER_AGENT = "rayproof-provisioner/0.1 (linux/amd64) kubernetes/embedded"
REQUEST_TIMEOUT_S = 30.0


class ApiError(RuntimeError):
    """A non-2xx answer of the API server."""

    def __init__(self, status: int, method: str, path: str, body: str):
        self.status = status
        self.method = method
        self.path = path
        self.body = body
        try:
            self.reason = json.loads(body).get("reason", "")
            message = json.loads(body).get("message", body)
        except ValueError:
            self.reason, message = "", body
        super().__init__(f"{method} {path}: HTTP {status} {self.reason}: {message[:500]}")

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409


@dataclass(frozen=True)
class Credentials:
    """Where to reach the API server and as whom."""

    server: str
    ca_file: str | None
    cert_file: str | None = None
    key_file: str | None = None
    token: str | None = None
    insecure: bool = False


def load_kubeconfig(path: str | Path, materialise_dir: Path) -> Credentials:
    """The current context of a kubeconfig; inline certificate data is written
    to files under ``materialise_dir`` (mode 0600) because TLS wants paths."""
    cfg = yaml.safe_load(Path(path).read_text())
    ctx_name = cfg.get("current-context")
    contexts = {c["name"]: c["context"] for c in cfg.get("contexts") or []}
    if ctx_name not in contexts:
        raise ValueError(f"{path}: current-context {ctx_name!r} is not among its contexts")
    ctx = contexts[ctx_name]
    cluster = {c["name"]: c["cluster"] for c in cfg.get("clusters") or []}[ctx["cluster"]]
    user = {u["name"]: u["user"] for u in cfg.get("users") or []}.get(ctx.get("user"), {}) or {}
    materialise_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(materialise_dir, 0o700)

    def file_of(data_key: str, file_key: str, section: Mapping[str, Any], stem: str) -> str | None:
        if section.get(data_key):
            out = materialise_dir / stem
            fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(base64.b64decode(section[data_key]))
            return str(out)
        if section.get(file_key):
            p = Path(section[file_key])
            return str(p if p.is_absolute() else Path(path).parent / p)
        return None

    return Credentials(
        server=cluster["server"].rstrip("/"),
        ca_file=file_of("certificate-authority-data", "certificate-authority", cluster, "ca.crt"),
        cert_file=file_of("client-certificate-data", "client-certificate", user, "client.crt"),
        key_file=file_of("client-key-data", "client-key", user, "client.key"),
        token=user.get("token"),
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
    )


class KubeClient:
    """JSON over HTTPS to one API server as one identity. Thread-safe."""

    def __init__(self, creds: Credentials, user_agent: str = USER_AGENT):
        self.creds = creds
        self.user_agent = user_agent
        kw: dict[str, Any] = {"num_pools": 2, "maxsize": 16, "block": False, "retries": False}
        if creds.insecure:
            kw["cert_reqs"] = "CERT_NONE"
        else:
            kw["cert_reqs"] = "CERT_REQUIRED"
            kw["ca_certs"] = creds.ca_file
        if creds.cert_file:
            kw["cert_file"] = creds.cert_file
            kw["key_file"] = creds.key_file
        self._pool = urllib3.PoolManager(**kw)

    def _headers(self, content_type: str | None = None) -> dict[str, str]:
        h = {"Accept": "application/json", "User-Agent": self.user_agent}
        if content_type:
            h["Content-Type"] = content_type
        if self.creds.token:
            h["Authorization"] = f"Bearer {self.creds.token}"
        return h

    def _url(self, path: str, params: Mapping[str, Any] | None) -> str:
        url = self.creds.server + path
        if params:
            clean = {k: ("true" if v is True else "false" if v is False else v) for k, v in params.items()
                     if v is not None}
            url += "?" + urllib.parse.urlencode(clean)
        return url

    def request(self, method: str, path: str, body: Any = None, *, params: Mapping[str, Any] | None = None,
                content_type: str = "application/json", timeout: float = REQUEST_TIMEOUT_S) -> Any:
        """One API call; returns the decoded JSON (or raw text), raises :class:`ApiError`."""
        data = None if body is None else (body if isinstance(body, (bytes, str)) else json.dumps(body))
        try:
            resp = self._pool.request(method, self._url(path, params), body=data,
                                      headers=self._headers(content_type if data is not None else None),
                                      timeout=urllib3.Timeout(connect=5.0, read=timeout), preload_content=True)
        except urllib3.exceptions.HTTPError as exc:
            # One exception family for "the API server could not be reached".
            raise ConnectionError(f"{method} {path}: {exc}") from exc
        text = resp.data.decode("utf-8", errors="replace")
        if resp.status >= 300:
            raise ApiError(resp.status, method, path, text)
        if not text:
            return None
        try:
            return json.loads(text)
        except ValueError:
            return text

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params=params)

    def post(self, path: str, body: Any, **params: Any) -> Any:
        return self.request("POST", path, body, params=params)

    def delete(self, path: str, body: Any = None, **params: Any) -> Any:
        return self.request("DELETE", path, body, params=params)

    def close(self) -> None:
        self._pool.clear()

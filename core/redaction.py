"""Secrets out of everything a run reports.

Evidence, attached logs, failure messages and Allure attachments pass
through :func:`redact` before they are written: every secret this process
registered (:func:`register`, for instance a local Redis password) and every
value that follows a password option or variable is replaced by
``[REDACTED]``. A certificate is meant to be published; a log of Ray's
processes can hold a password on a command line (Ray itself passes the
Redis password to the GCS as an argument).
"""
from __future__ import annotations

import re
from pathlib import Path

REDACTED = "[REDACTED]"
# A password given as an option, a setting or a variable, in any of the
# spellings Ray, redis-server, redis-cli and KubeRay use.
_PATTERNS = (
    re.compile(r"(?i)(--?redis[-_]password[= ]+)(['\"]?)[^\s'\"]+"),
    re.compile(r"(?i)(\brequirepass[= ]+)(['\"]?)[^\s'\"]+"),
    re.compile(r"(?i)(\b(?:RAY_)?REDIS_PASSWORD[\"']?\s*[=:]\s*)(['\"]?)[^\s'\",}]+"),
    re.compile(r"(?i)(\bREDISCLI_AUTH[\"']?\s*[=:]\s*)(['\"]?)[^\s'\",}]+"),
)
_secrets: set[str] = set()


def register(secret: str) -> str:
    """Redact ``secret`` wherever it appears from now on; returns it."""
    if len(secret) >= 6:  # shorter strings would redact ordinary words
        _secrets.add(secret)
    return secret


def redact(text: str) -> str:
    for secret in sorted(_secrets, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    for pattern in _PATTERNS:
        text = pattern.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)
    return text


def redact_files(directory: Path) -> list[Path]:
    """Redact, in place, every file under ``directory`` that holds a secret
    (reports other tools wrote, such as Allure's results); returns those
    rewritten. A file without one is not touched."""
    rewritten = []
    for path in sorted(directory.rglob("*")) if directory.is_dir() else []:
        if not path.is_file() or path.is_symlink():
            continue
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError):
            continue  # binary attachments are the suite's own (none hold text secrets)
        clean = redact(text)
        if clean != text:
            path.write_text(clean)
            rewritten.append(path)
    return rewritten


# Fields (and env entries, by their name) whose values are credentials: the
# name ends so (redisPassword, HF_TOKEN, AWS_SECRET_ACCESS_KEY; not tokenizer).
SECRET_NAME = re.compile(r"(?i)(password|passwd|secret|token|api[-_]?key|access[-_]?key|private[-_]?key|"
                         r"credentials?)$")


def redact_secret_fields(node: object) -> tuple[object, list[str]]:
    """A copy of a parsed YAML/JSON document with the literal value of every
    field whose name says it is a credential (``redisPassword: hunter2``),
    and of every ``{name, value}`` entry so named (an env variable), replaced
    by ``[REDACTED]``; with the paths it redacted. References to where a
    secret lives (``valueFrom``, ``secretKeyRef``) are kept: they hold none."""
    redacted: list[str] = []

    def walk(value: object, path: str, secret: bool = False) -> object:
        """``secret``: ``value`` is the value of a credential's field (KubeRay's
        ``redisPassword: {value: ...}``), whose own ``value`` is the credential."""
        if isinstance(value, dict):
            secret = secret or bool(isinstance(value.get("name"), str) and SECRET_NAME.search(value["name"]))
            out: dict[object, object] = {}
            for key, item in value.items():
                here = f"{path}.{key}" if path else str(key)
                named = bool(SECRET_NAME.search(str(key)))
                if isinstance(item, (str, int, float)) and not isinstance(item, bool) and (
                        named or (secret and key == "value")):
                    out[key] = REDACTED
                    redacted.append(here)
                else:
                    out[key] = walk(item, here, named and isinstance(item, dict))
            return out
        if isinstance(value, list):
            return [walk(item, f"{path}[{i}]") for i, item in enumerate(value)]
        return value

    return walk(node, ""), redacted

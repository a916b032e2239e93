"""The steer admin key on the routes that change steers and presets.

With ``--steer-admin-key`` (or ``VLLM_STEER_ADMIN_KEY``; :func:`vllm_steer.config.admin_key`)
the management routes, ``POST /v1/steers``, ``DELETE /v1/steers/NAME``, ``POST
/v1/steer-presets``, ``PUT`` and ``DELETE /v1/steer-presets/NAME``, need ``Authorization:
Bearer ADMIN_KEY``:

- no key: HTTP 401;
- one of vLLM's API keys (``--api-key`` / ``VLLM_API_KEY``, the inference keys): HTTP 403,
  the message saying that key serves requests only;
- any other key: HTTP 401 (when vLLM checks API keys, its own check answers first).

Without an admin key nothing changes: every client that may send requests may use them
(with ``--enable-steer-updates``). vLLM's check lets the admin key through on ``/v1`` routes
because the plugin adds it to vLLM's keys
(:func:`vllm_steer.integrations.frontend.cli_args.admit_admin_key`). Keys are compared as vLLM
compares its own (SHA-256 digests, ``secrets.compare_digest``).
"""

from __future__ import annotations

import hashlib
import os
import secrets

from fastapi import Request
from fastapi.responses import JSONResponse

from vllm_steer.config import ADMIN_KEY_ENV, SecretKey, admin_key
from vllm_steer.integrations import vllm_access as va
from vllm_steer.server.errors import error_response

#: The routes the admin key guards: (method, path) as the routers declare them.
ADMIN_ROUTES = (("POST", "/v1/steers"), ("DELETE", "/v1/steers/{name}"),
                ("POST", "/v1/steer-presets"), ("PUT", "/v1/steer-presets/{name}"),
                ("DELETE", "/v1/steer-presets/{name}"))


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def _same(a: str, b: str) -> bool:
    return secrets.compare_digest(_digest(a), _digest(b))


def _bearer(raw: Request) -> str | None:
    scheme, _, value = (raw.headers.get("authorization") or "").partition(" ")
    return value if scheme.lower() == "bearer" and value else None


def _inference_keys(args) -> list[str]:
    """vLLM's API keys, as its check reads them, without the admin key the plugin added."""
    keys = va.api_keys(args) or [os.environ.get("VLLM_API_KEY")]
    return [k for k in keys if k and not isinstance(k, SecretKey)]


def admin_refused(raw: Request, what: str) -> JSONResponse | None:
    """None when the request may ``what`` (no admin key set, or the request sends it); else
    the refusal (401 or 403) saying which key the route needs."""
    args = va.app_state_args(raw.app.state)
    key = admin_key(args)
    if not key:
        return None
    sent = _bearer(raw)
    if sent is not None and _same(sent, key):
        return None
    how = (f"send the steer admin key (the server's --steer-admin-key or {ADMIN_KEY_ENV}) "
           "as 'Authorization: Bearer ADMIN_KEY'")
    if sent is None:
        return error_response(401, f"this route needs the steer admin key to {what}; {how}",
                              "AuthenticationError")
    if any(_same(sent, k) for k in _inference_keys(args)):
        return error_response(403, f"the key sent is an API key (--api-key / VLLM_API_KEY): "
                              f"it may send requests but not {what}; {how}",
                              "PermissionError")
    return error_response(401, f"the key sent is not the steer admin key, needed to {what}; "
                          f"{how}", "AuthenticationError")

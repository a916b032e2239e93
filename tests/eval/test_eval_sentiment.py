"""The SST-2 sentiment classifier (trained by the project), VADER and the positivity metric."""

import json
import os

import pytest

from vllm_steer.eval.sentiment import (SST2Classifier, VaderScorer, positivity_metrics,
                                       preprocess, read_sst2)

pytestmark = pytest.mark.data


@pytest.fixture(scope="module")
def clf(data_dir):
    return SST2Classifier.cached(str(data_dir))


def test_sst2_dev_accuracy_at_least_075(clf, data_dir):
    texts, labels = read_sst2(os.path.join(data_dir, "sst2", "dev.tsv"))
    acc = clf.accuracy(texts, labels)
    assert acc >= 0.75
    assert clf.info["dev_accuracy"] == pytest.approx(acc)
    assert clf.info["test_accuracy"] >= 0.75


def test_scores_are_probabilities_and_order_obvious_cases(clf):
    pos, neg = clf.score(["a wonderful , moving and beautiful film",
                          "a dull , boring and painful mess"])
    assert 0.5 < pos <= 1 and 0 <= neg < 0.5
    # negation survives tokenisation in both spellings
    assert preprocess("It doesn't work") == preprocess("it does n't work") == "it does not work"


def test_json_cache_round_trip_without_retraining(clf, data_dir, tmp_path, monkeypatch):
    from vllm_steer.eval.sentiment import SST2_RECIPE
    from vllm_steer.train.data import file_sha256

    texts = ["great acting", "terrible plot", "the film"]
    again = SST2Classifier.from_json(json.loads(json.dumps(clf.to_json())))
    assert again.score(texts) == pytest.approx(clf.score(texts))
    key = file_sha256(os.path.join(data_dir, "sst2", "train.tsv"))[:16]
    (tmp_path / f"sst2-tfidf-lr-{key}-v{SST2_RECIPE['version']}.json").write_text(
        json.dumps(clf.to_json()))
    monkeypatch.setattr(SST2Classifier, "train", classmethod(lambda *a, **k: 1 / 0))
    loaded = SST2Classifier.cached(str(data_dir), cache=tmp_path)  # no training
    assert loaded.score(texts) == pytest.approx(clf.score(texts))


def test_missing_data_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="sst2/train.tsv"):
        SST2Classifier.cached(str(tmp_path), cache=tmp_path)
    bad = tmp_path / "bad.tsv"
    bad.write_text("text\tlabel\nfoo\t1\n")
    with pytest.raises(ValueError, match="sentence<TAB>label"):
        read_sst2(str(bad))


def test_vader_maps_compound_to_unit_interval():
    pos, neg, neu = VaderScorer().score(["I love this, it is great!", "I hate this, awful.",
                                         "The table."])
    assert pos > 0.5 > neg and neu == 0.5


def test_positivity_is_mean_over_prompts_of_fraction_positive():
    m = positivity_metrics([[0.9, 0.2, 0.6, 0.1], [0.51, 0.5]])
    assert m["positivity"] == pytest.approx((2 / 4 + 1 / 2) / 2)
    assert m["mean_p_positive"] == pytest.approx((0.9 + 0.2 + 0.6 + 0.1 + 0.51 + 0.5) / 6)
